"""Model profile: FLOPs from FlopCounterMode, bytes from real tensors."""

import pytest
import torch
from torch import nn

from sky_flower.core.profile import default_optimizer_factory, profile_layers, time_layers
from sky_flower.pipeline.models import build_model


def test_linear_flops_and_bytes():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    prof = profile_layers(model, (8,), microbatch_size=5)
    assert [p.name for p in prof] == ["0:Linear", "1:ReLU", "2:Linear"]
    # forward: one multiply-add = 2 FLOPs per weight per sample
    assert prof[0].fwd_flops == 2 * 8 * 16
    assert prof[2].fwd_flops == 2 * 16 * 4
    # first layer: weight gradient only (input needs none); later: input + weight grads
    assert prof[0].bwd_flops == 2 * 8 * 16
    assert prof[2].bwd_flops == 2 * (2 * 16 * 4)
    assert prof[1].fwd_flops == 0 and prof[1].param_bytes == 0
    assert prof[0].param_bytes == (8 * 16 + 16) * 4
    assert prof[0].act_in_bytes == 8 * 4 and prof[0].act_out_bytes == 16 * 4
    assert prof[2].act_out_bytes == 4 * 4


@pytest.mark.parametrize(
    ("name", "per_param_copies"), [("adam", 2), ("sgd_momentum", 1), ("sgd", 0)]
)
def test_optimizer_state_bytes(name, per_param_copies):
    model = nn.Sequential(nn.Linear(10, 20))
    prof = profile_layers(model, (10,), 2, default_optimizer_factory(name))
    params = prof[0].param_bytes
    # Adam also keeps a float32 `step` per parameter tensor (2 tensors here).
    extra = 2 * 4 if name == "adam" else 0
    assert prof[0].optimizer_state_bytes == per_param_copies * params + extra


def test_profile_leaves_model_untouched():
    model = build_model({"name": "mlp", "hidden_width": 32, "hidden_layers": 2})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile_layers(model, (64,), 4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_bad_inputs():
    with pytest.raises(TypeError, match="nn.Sequential or a list"):
        profile_layers(nn.Linear(3, 3), (3,), 1)
    with pytest.raises(ValueError, match="does not accept input"):
        profile_layers(nn.Sequential(nn.Linear(3, 3)), (4,), 1)
    with pytest.raises(ValueError, match="unknown optimizer"):
        default_optimizer_factory("lamb")
    with pytest.raises(ValueError, match="unknown model"):
        build_model({"name": "resnet"})


def test_time_layers_shapes():
    model = build_model({"name": "mlp", "hidden_width": 64, "hidden_layers": 3})
    fwd, bwd = time_layers(model, (64,), 8, warmup=1, repeats=3)
    assert len(fwd) == len(bwd) == 4
    assert all(t > 0 for t in fwd) and all(t > 0 for t in bwd)


class _TwoBlocks(nn.Module):
    """A user's model as Flower apps write it: named submodules, a functional forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.fc2, self.bn2 = nn.Linear(16, 512), nn.BatchNorm1d(512)
        self.head = nn.Sequential(nn.Linear(512, 4), nn.Identity())

    def forward(self, x):
        x = torch.relu(self.bn1(self.fc1(x)))
        return self.head(torch.relu(self.bn2(self.fc2(x))))


def _holding(model, *paths):
    """A stand-in unit holding ``model``'s submodules at ``paths`` (as a traced unit
    holds them: under their paths)."""
    unit = nn.Module()
    for path in paths:
        unit.add_module(path, model.get_submodule(path))
    return unit


def test_units_are_named_by_the_user_modules_they_hold():
    """One module by its path, two as ``a+b``, more as ``first..last``; a container held
    whole by its own path; a unit holding no tensor by the split point it starts at."""
    from sky_flower.pipeline.graph import unit_names

    model = _TwoBlocks()
    seq = nn.Sequential(
        _holding(model, "fc1"),
        nn.ReLU(),
        _holding(model, "bn1", "fc2", "bn2"),
        _holding(model, "head"),
    )
    points = ["relu", "bn1", "head"]
    assert unit_names(model, seq, points) == ["fc1", "relu", "bn1..bn2", "head"]
    seq = nn.Sequential(_holding(model, "fc1", "bn1"), _holding(model, "fc2", "bn2", "head"))
    assert unit_names(model, seq, ["fc2"]) == ["fc1+bn1", "fc2..head"]


@pytest.mark.e2e  # a model traced twice (about 1 s); the naming itself: the test above
def test_a_converted_model_too_big_for_its_owner_names_its_modules_and_helpers():
    """The trial's phone: a converted model's layer too big for the only node, a data
    owner. The error said ``layer 1 (1:TracedUnit)`` and suggested no helpers: it names
    the user's modules and the fix that applies, nodes that hold no data."""
    from sky_flower.core.cost import Schedule
    from sky_flower.core.federated import plan_federation
    from sky_flower.core.partition import InfeasibleMemoryError
    from sky_flower.core.profile import NodeProfile
    from sky_flower.pipeline.graph import sequential_of

    torch.manual_seed(0)
    model = sequential_of(_TwoBlocks(), [8], split_points=["fc2", "head"])
    layers = profile_layers(model, (8,), microbatch_size=4)
    assert [p.name for p in layers] == ["0:fc1+bn1", "1:fc2+bn2", "2:head"]
    schedule = Schedule(batch_size=8, microbatches=1, kind="sequential", transport="direct")
    need = max(lp.param_bytes for lp in layers)
    phone = NodeProfile(
        name="phone",
        layer_fwd_s=(0.0,) * 3,
        layer_bwd_s=(0.0,) * 3,
        memory_bytes=need // 2,
        holds_data=True,
    )
    with pytest.raises(InfeasibleMemoryError) as err:
        plan_federation(layers, [phone], {"phone": 64}, schedule)
    text = str(err.value)
    assert "every helper (0)" in text and "layer 1 (1:fc2+bn2)" in text, text
    assert "sky-holds-data=false" in text and "holds_data: false" in text, text


def test_an_owner_too_small_without_helpers_is_told_to_add_helpers():
    """A data owner that cannot hold the model and has no helper (every node holds data,
    as under flwr run's simulation) was told to add memory, lower the batch or split the
    layer: the fix that applies, nodes that hold no data, is named; with a helper, it is
    not."""
    from sky_flower.core.cost import Schedule
    from sky_flower.core.federated import plan_federation
    from sky_flower.core.partition import MIB, InfeasibleMemoryError
    from sky_flower.core.profile import NodeProfile
    from tests.factories import fake_layer

    layers = [fake_layer(i, param=10 * MIB) for i in range(3)]
    schedule = Schedule(batch_size=8, microbatches=1, kind="sequential", transport="direct")

    def node(name, mib, holds_data=True):
        return NodeProfile(
            name=name, layer_fwd_s=(0.0,) * 3, layer_bwd_s=(0.0,) * 3,
            memory_bytes=mib * MIB, holds_data=holds_data,
        )  # fmt: skip

    with pytest.raises(InfeasibleMemoryError) as err:
        plan_federation(layers, [node("phone", 15)], {"phone": 64}, schedule)
    assert "every helper (0)" in str(err.value)
    assert "sky-holds-data=false" in str(err.value) and "holds_data: false" in str(err.value)
    with pytest.raises(InfeasibleMemoryError) as err:  # a helper, still too small
        plan_federation(layers, [node("phone", 15), node("h", 15, False)], {"phone": 64}, schedule)
    assert "every helper (1)" in str(err.value) and "sky-holds-data" not in str(err.value)
