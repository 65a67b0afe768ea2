"""Split equals whole: one step through any plan gives the unsplit model's weights."""

import copy

import pytest
import torch
from reference import make_optimizer, reference_rounds

from sky_flower.pipeline.models import build_model
from sky_flower.pipeline.stage import (
    StageExecutor,
    build_stage,
    optimizer_from_tensors,
    optimizer_to_tensors,
    run_split_step,
    slice_state,
)

MODEL = {"name": "mlp", "hidden_width": 32, "hidden_layers": 4}  # 5 layers


def _model():
    return build_model(MODEL)


LR = {"adam": 1e-2, "sgd_momentum": 0.1}


def _reference(state, x, y, opt_name, steps, microbatches=1):
    """The unsplit model after ``steps`` steps on the batch ``(x, y)``."""
    ((weights, _),) = reference_rounds(
        _model,
        [(x, y)],
        1,
        steps,
        LR.get(opt_name, 0.1),
        microbatches=microbatches,
        optimizer=opt_name,
        weights=state,
    )
    return weights


PLANS = [
    [(0, 4)],
    [(0, 1), (2, 4)],
    [(0, 0), (1, 3), (4, 4)],
    [(j, j) for j in range(5)],  # one stage per layer
]


@pytest.mark.parametrize("bounds", PLANS)
@pytest.mark.parametrize("opt_name", ["adam", "sgd_momentum"])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_split_equals_whole(bounds, opt_name, microbatches):
    torch.manual_seed(0)
    state = _model().state_dict()
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    steps = 3
    stages = []
    for a, b in bounds:
        module = build_stage(_model, a, b, slice_state(state, a, b))
        opt = make_optimizer(opt_name, module.parameters(), LR[opt_name])
        stages.append(StageExecutor(module, opt, microbatches))
    for _ in range(steps):
        run_split_step(stages, x, y)
    split = {}
    for st in stages:
        split.update(st.module.state_dict())
    expected = _reference(copy.deepcopy(state), x, y, opt_name, steps, microbatches)
    assert split.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(split[k], expected[k], rtol=1e-5, atol=1e-6)


def test_microbatched_gradients_match_whole_batch():
    """With M equal micro-batches the accumulated gradient is the whole batch's."""
    torch.manual_seed(1)
    state = _model().state_dict()
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    module = build_stage(_model, 0, 4, state)
    st = StageExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1), 4)
    st.forward_backward_loss(x, y, input_grad=False)
    expected = _reference(copy.deepcopy(state), x, y, "sgd", 1, microbatches=1)
    for k, v in module.state_dict().items():
        # SGD: w - lr * grad; whole-batch and micro-batched agree
        torch.testing.assert_close(v, expected[k], rtol=1e-5, atol=1e-6)


def test_optimizer_state_round_trip():
    module = build_stage(_model, 1, 2)
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    module(torch.randn(4, 32)).sum().backward()
    opt.step()
    opt2 = torch.optim.Adam(module.parameters(), lr=1e-3)
    optimizer_from_tensors(opt2, optimizer_to_tensors(opt))
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for pid in s1["state"]:
        for name, value in s1["state"][pid].items():
            torch.testing.assert_close(s2["state"][pid][name], value)


def test_build_stage_rejects_bad_range():
    with pytest.raises(ValueError, match="outside a model of 5 layers"):
        build_stage(_model, 3, 7)


def test_indivisible_microbatches():
    module = build_stage(_model, 0, 0)
    st = StageExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1), 3)
    with pytest.raises(ValueError, match="not divisible into 3 micro-batches"):
        st.forward(torch.randn(16, 64))


class ToLong(torch.nn.Module):
    """Quantises its input to indices 0..16 (an integer output: no gradient flows back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.abs() * 4).clamp(0, 16).long()


def _int_cut_model() -> torch.nn.Sequential:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        ToLong(), torch.nn.Embedding(17, 4), torch.nn.Flatten(), torch.nn.Linear(256, 10)
    )


@pytest.mark.parametrize("bounds", [[(0, 0), (1, 3)], [(0, 1), (2, 3)], [(0, 0), (1, 1), (2, 3)]])
def test_an_integer_tensor_crossing_a_cut_trains_as_the_whole_model(bounds):
    """A cut after a layer with an integer output (indices for an Embedding): the next
    stage takes no input gradient (zeros go back) and training equals the whole model."""
    state = _int_cut_model().state_dict()
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    stages = []
    for a, b in bounds:
        module = build_stage(_int_cut_model, a, b, slice_state(state, a, b))
        params = list(module.parameters())
        opt = torch.optim.SGD(params, lr=0.1) if params else None
        stages.append(StageExecutor(module, opt, 2))
    for _ in range(2):
        run_split_step(stages, x, y)
    whole = _int_cut_model()
    opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        sum(
            torch.nn.functional.cross_entropy(whole(xm), ym) / 2
            for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True)
        ).backward()
        opt.step()
    split = {}
    for st in stages:
        split.update(st.module.state_dict())
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(split[k], v, rtol=1e-5, atol=1e-6)


class TiedInside(torch.nn.Module):
    """Two linear maps sharing one weight, inside one entry."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _tied_inside() -> torch.nn.Sequential:
    torch.manual_seed(2)
    return torch.nn.Sequential(TiedInside(), torch.nn.ReLU(), torch.nn.Linear(64, 10))


@pytest.mark.parametrize("bounds", [[(0, 2)], [(0, 0), (1, 2)]])
def test_a_tie_inside_one_entry_is_kept_and_trains_as_the_whole_model(bounds):
    state = _tied_inside().state_dict()
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    stages = []
    for a, b in bounds:
        module = build_stage(_tied_inside, a, b, slice_state(state, a, b))
        stages.append(StageExecutor(module, torch.optim.Adam(module.parameters(), lr=0.01), 1))
    for _ in range(3):
        run_split_step(stages, x, y)
    split = {}
    for st in stages:
        split.update(st.module.state_dict())
    assert torch.equal(split["0.a.weight"], split["0.b.weight"])  # still one tensor
    whole = _tied_inside()
    opt = torch.optim.Adam(whole.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(whole(x), y).backward()
        opt.step()
    for k, v in whole.state_dict().items():
        torch.testing.assert_close(split[k], v, rtol=1e-5, atol=1e-6)


def test_a_weight_tied_across_entries_is_refused_naming_both():
    a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    b.weight = a.weight
    model = torch.nn.Sequential(a, torch.nn.ReLU(), b, torch.nn.Linear(64, 10))
    with pytest.raises(ValueError, match=r"0\.weight and 2\.weight are one tensor.*entries 0\.\.2"):
        build_stage(lambda: model, 0, 3)
