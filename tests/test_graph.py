"""Non-Sequential models cut at module boundaries by torch.distributed.pipelining
(sky_flower/pipeline/graph.py): the converted nn.Sequential is the model."""

from functools import cache

import pytest
import torch
from torch import nn

from sky_flower.core.profile import profile_layers
from sky_flower.pipeline.graph import as_sequential, original_state_dict, sequential_of
from sky_flower.pipeline.stage import StageExecutor, build_stage, run_split_step, slice_state


class ResidualMLP(nn.Module):
    """A skip connection across two children (``b`` and ``c``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.d = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.d(self.c(torch.relu(self.b(h))) + h)


class DictNet(nn.Module):
    """Submodules in an ``nn.ModuleDict`` (never called itself)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.blocks = nn.ModuleDict({"p": nn.Linear(16, 16), "q": nn.Linear(16, 16)})
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        for key in ("p", "q"):
            h = torch.relu(self.blocks[key](h))
        return self.head(h)


class GatherBlock(nn.Module):
    """A block whose indices are made from the batch size (``arange(B * 8)``)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        idx = torch.arange(x.shape[0] * 8).reshape(x.shape[0], 8) % 7
        return torch.relu(torch.gather(self.lin(x), 1, idx))


class SizedBlocks(nn.Module):
    """The root reads the batch size first, so every block's ``B * 8`` is one traced
    value: made in block 0 from block 0's copy of the size, read by blocks 1 and 2
    (Mixtral's and Bloom's blocks do the same)."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(8, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList([GatherBlock() for _ in range(3)])

    def forward(self, x):
        x = self.inp(x).view(x.shape[0], 8)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class StackEncoder(nn.Module):
    """An embedding and a stack of blocks in an ``nn.ModuleList`` (DistilBERT's and
    ELECTRA's layout: their ``transformers`` classes declare no ``_no_split_modules``)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer(h)
        return h


class StackClassifier(nn.Module):
    """The encoder wrapped beside a head, as ``*ForSequenceClassification`` does."""

    def __init__(self):
        super().__init__()
        self.encoder, self.head = StackEncoder(), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


def test_a_stack_of_blocks_is_cut_where_the_model_declares_none():
    """The default cuts go down to an ``nn.ModuleList``'s blocks (one class, each called
    once), as to a declared ``_no_split_modules`` class: before, the encoder was one
    unit and only the head could be cut off."""
    torch.manual_seed(0)
    model, x = StackClassifier(), torch.randn(4, 8)
    seq = as_sequential(model, x)
    assert seq.split_points == [f"encoder.layers.{i}" for i in range(3)] + ["head"]
    _assert_same_function(model, seq, x)


class ViewHead(nn.Module):
    """Takes two ``(B, 2, 4)`` tensors and views each as ``(2B, 4)``: a view that merges
    the batch dimension (T5's attention does the same to its hidden states)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, y, h):
        return self.lin(y.view(-1, 4) + h.view(-1, 4)).view(y.shape[0], -1)


class SkipIntoView(nn.Module):
    """A skip connection into :class:`ViewHead`: the cut before ``c`` carries two
    tensors, packed side by side, and ``c`` views them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), ViewHead()

    def forward(self, x):
        h = torch.tanh(self.a(x.view(x.shape[0], 2, 4)))
        return self.c(self.b(h), h)


class TiedLM(nn.Module):
    """A head tied to the embedding: one parameter at both ends."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid = nn.Embedding(10, 8), nn.Linear(8, 8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.relu(self.mid(self.emb(ids))))


def _assert_same_function(model, seq, x):
    """Outputs and parameter gradients of ``seq`` equal ``model``'s within 1e-6."""
    y, y_seq = model(x), seq(x)
    torch.testing.assert_close(y_seq, y, rtol=0, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    y_seq.backward(g)
    grads = {k: p.grad for k, p in seq.named_parameters()}
    mapped = original_state_dict(grads)
    for k, p in model.named_parameters():
        torch.testing.assert_close(mapped[k], p.grad, rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize(
    ("make", "units", "names"),
    [
        (ResidualMLP, 4, [["a"], ["b"], ["c"], ["d"]]),  # the skip crosses two cuts
        (DictNet, 4, [["enc"], ["blocks.p"], ["blocks.q"], ["head"]]),
        # a size computed again in every block reads that block's own copy, crossing
        # no cut (it read block 0's, and blocks 1 and 2 were merged away)
        # the unpacked tensors are contiguous, as traced: a view across the batch
        # dimension of a slice of the packed tensor failed ("view size is not compatible")
        (SkipIntoView, 3, [["a"], ["b"], ["c.lin"]]),
        (SizedBlocks, 5, [["inp"]] + [[f"blocks.{i}.lin"] for i in range(3)] + [["head"]]),
    ],
)
def test_converted_model_equals_the_original(make, units, names):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(5, 8)
    seq = as_sequential(model, x)
    assert isinstance(seq, nn.Sequential) and len(seq) == units
    for unit, expected in zip(seq, names, strict=True):
        held = {k.rsplit(".", 1)[0] for k, _ in unit.named_parameters()}
        assert held == set(expected)
    _assert_same_function(model, seq, x)


def test_state_dict_maps_back_to_the_users_module():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    seq = as_sequential(ResidualMLP(), x)
    with torch.no_grad():  # "train" the converted model
        for p in seq.parameters():
            p.add_(torch.randn_like(p))
    user = ResidualMLP()
    user.load_state_dict(original_state_dict(seq.state_dict()), strict=True)
    torch.testing.assert_close(user(x), seq(x), rtol=0, atol=1e-6)


class InstanceNormNet(nn.Module):
    """An InstanceNorm with running statistics: its ``num_batches_tracked`` is a key of
    the state dict that its forward never reads (so no unit holds it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)
        self.norm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)

    def forward(self, x):
        return self.b(self.norm(self.a(x).view(x.shape[0], 4, 4)).flatten(1))


def test_an_entry_the_forward_never_reads_comes_back_from_the_module():
    torch.manual_seed(0)
    model, x = InstanceNormNet(), torch.randn(4, 8)
    seq = as_sequential(model, x)
    seq(x)  # a training forward: the running statistics move
    state = original_state_dict(seq.state_dict(), like=model)
    assert list(state) == list(model.state_dict())
    model.load_state_dict(state, strict=True)
    assert torch.equal(model.norm.running_mean, seq[1].state_dict()["norm.running_mean"])
    with pytest.raises(ValueError, match=r"lacks \['b.weight'\]"):  # a trained one never
        original_state_dict({k: v for k, v in seq.state_dict().items() if "b.w" not in k}, model)


def test_chosen_split_points_and_merging():
    x = torch.randn(4, 8)
    seq = as_sequential(DictNet(), x, ["blocks.q"])
    assert len(seq) == 2
    # the cut inside the residual MLP's skip carries the skip and the branch, packed
    seq = as_sequential(ResidualMLP(), x, ["c"])
    assert len(seq) == 2 and seq.split_points == ["c"]
    assert seq[0](x).shape == (4, 32)  # h (16) and relu(b(h)) (16) side by side


def test_tied_parameter_is_never_split():
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.randint(0, 10, (3, 5))
    with pytest.warns(UserWarning, match="one trainable parameter read by stages 0 and 2"):
        seq = as_sequential(model, ids)
    assert len(seq) == 1  # every cut would split the tied weight: merged
    assert seq[0].emb.weight is seq[0].out.weight
    _assert_same_function(model, seq, ids)


def test_split_execution_of_a_converted_model_equals_the_original():
    """The converted model on the in-process split path (meta build, stage weights)."""
    torch.manual_seed(0)
    model, x = DictNet(), torch.randn(8, 8)
    y = torch.randint(0, 3, (8,))

    def model_fn():
        return as_sequential(DictNet(), torch.randn(2, 8))

    state = {f"{k}": v for k, v in as_sequential(model, x).state_dict().items()}
    stages = []
    for a, b in [(0, 1), (2, 3)]:
        module = build_stage(model_fn, a, b, slice_state(state, a, b))
        stages.append(StageExecutor(module, torch.optim.SGD(module.parameters(), lr=1.0), 2))
    run_split_step(stages, x, y)
    for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
        (nn.functional.cross_entropy(model(xm), ym) / 2).backward()
    split = original_state_dict({k: v for st in stages for k, v in st.module.state_dict().items()})
    for k, p in model.named_parameters():
        torch.testing.assert_close(split[k], p.detach() - p.grad, rtol=0, atol=1e-6, msg=k)


def test_profile_of_a_converted_model():
    seq = as_sequential(DictNet(), torch.randn(2, 8))
    profiles = profile_layers(seq, (8,), microbatch_size=4)
    assert [p.act_out_bytes for p in profiles] == [64, 64, 64, 12]


class TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


class WithDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.drop = nn.Linear(4, 4), nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.a(x))


class Scale(nn.Module):
    """Scales what the module handed to it computes (as peft's DoRA magnitude does)."""

    def __init__(self):
        super().__init__()
        self.m = nn.Parameter(torch.ones(4))

    def forward(self, x, lin):
        return lin(x) * self.m


class CallsSibling(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.scale, self.head = nn.Linear(4, 4), Scale(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.scale(x, self.lin))


def test_refusals_are_clear():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="TwoOut returns tuple, not one tensor"):
        as_sequential(TwoOut(), x)
    with pytest.raises(ValueError, match="not submodules"):
        as_sequential(ResidualMLP(), torch.randn(2, 8), ["nope"])
    with pytest.raises(ValueError, match="never called"):
        as_sequential(DictNet(), torch.randn(2, 8), ["blocks"])
    # a module that calls a module it does not hold (peft's DoRA): both named
    with pytest.raises(ValueError, match=r"scale calls lin, a module it does not hold"):
        as_sequential(CallsSibling(), x)
    # a cumulative BatchNorm reads num_batches_tracked as a number: named, with the fix
    # (it was blamed on control flow on a tensor's values)
    cumulative = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    with pytest.raises(ValueError, match=r"BatchNorm \['0\.1'\] has momentum=None.*e\.g\. 0\.1"):
        as_sequential(nn.Sequential(cumulative, nn.Linear(4, 2)), x)


def test_sequential_of_builds_its_own_example():
    with pytest.warns(UserWarning, match="TiedLM: emb.weight and out.weight"):
        seq = sequential_of(TiedLM(), [5], "int64")
    assert seq(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 10)


class Flatten(nn.Module):
    """A reshape by the batch size: traced with a dynamic batch dimension."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h.reshape(h.shape[0], -1))


@cache
def _flatten_converted() -> tuple[Flatten, nn.Sequential]:
    """One Flatten and its conversion, traced once for every batch size below (the
    tests only run them forward)."""
    model = Flatten()
    return model, as_sequential(model, torch.randn(2, 2, 8))


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_units_take_any_batch_size(batch):
    model, seq = _flatten_converted()
    assert len(seq) == 2
    x = torch.randn(batch, 2, 8)
    torch.testing.assert_close(seq(x), model(x), rtol=0, atol=1e-6)


def test_a_batch_of_one_is_refused_as_example():
    with pytest.raises(ValueError, match="at least 2"):
        as_sequential(Flatten(), torch.randn(1, 2, 8))


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(nn.functional.dropout(self.a(x), 0.5, self.training))


@pytest.mark.parametrize("make", [FunctionalDropout, WithDropout])
def test_a_forward_that_reads_the_mode_switches_with_train_and_eval(make):
    """A functional dropout (``self.training`` read in the forward, no layer type shows
    it) and an ``nn.Dropout``: the unit is traced once per mode and ``eval()`` switches
    it; the same draws in training mode."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(8, 4)
    seq = as_sequential(model, x)
    with torch.random.fork_rng():
        want = model(x)
    torch.testing.assert_close(seq(x), want, rtol=0, atol=0)
    model.eval(), seq.eval()
    torch.testing.assert_close(seq(x), model(x), rtol=0, atol=0)
    assert not torch.equal(seq.train()(x), seq.eval()(x))


class NoGradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            h = self.a(x)
        return self.b(h)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, y):
        return self.b(self.a(x) + y)


class FoldsChoices(nn.Module):
    """``(B, 3, 4)`` choices scored as ``(3B, 4)`` rows, as ``*ForMultipleChoice`` does:
    what crosses the cuts between ``a``, ``b`` and ``c`` has ``3B`` rows."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x.view(-1, 4)))))).view(-1, 3)


def test_a_batch_folded_with_another_dimension_is_named_in_the_merge_warning():
    with pytest.warns(
        UserWarning, match=r"no cut before b .*3 x the batch of 2: the forward folds"
    ):
        seq = as_sequential(FoldsChoices(), torch.randn(2, 3, 4))
    assert seq.split_points == []


def test_what_cannot_be_split_is_named_with_its_fix():
    with pytest.raises(ValueError, match=r"switches autograd, e.g. torch.no_grad\(\)"):
        as_sequential(NoGradInside(), torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"TwoInputs cannot run on the example.*inputs=\["):
        sequential_of(TwoInputs(), [4])
    with pytest.raises(ValueError, match=r"Flatten cannot run on the example input \(\(2, 3\) "):
        sequential_of(Flatten(), [3])  # a wrong input_shape


def test_several_inputs_are_packed_for_the_first_unit():
    from sky_flower.pipeline.graph import pack_inputs, unpack

    torch.manual_seed(0)
    model = TwoInputs()
    inputs = [{"shape": [4], "dtype": "float32"}, {"shape": [4], "dtype": "float32"}]
    with pytest.raises(ValueError, match=r"write input_shape: \[8\] and input_dtype: float32"):
        sequential_of(model, [4], inputs=inputs)
    seq = sequential_of(model, [8], inputs=inputs)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    packed = pack_inputs([x, y])
    assert packed.shape == (3, 8) and [t.shape for t in unpack(packed, seq.input_spec)] == [
        (3, 4),
        (3, 4),
    ]
    torch.testing.assert_close(seq(packed), model(x, y), rtol=0, atol=0)


class _Scaled(torch.nn.Module):
    """A plain tensor attribute (lifted by the trace as a constant) and a submodule the
    forward never reads (peft's original_module beside modules_to_save)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        self.scale = torch.tensor(0.5)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * self.scale)


def test_sequential_fn_traces_once_and_builds_every_call_from_a_fresh_module():
    from sky_flower.pipeline.graph import ModuleKeys, sequential_fn

    fn = sequential_fn(_Scaled, [4])
    first, second = fn(), fn()  # the second: the first's trace, a fresh module's weights
    assert list(first.state_dict()) == list(second.state_dict())
    assert not torch.equal(first.state_dict()["0.a.weight"], second.state_dict()["0.a.weight"])
    with torch.device("meta"):  # stage.meta_layers: shapes only, no values copied
        assert all(p.is_meta for p in fn().parameters())
    user = _Scaled().state_dict()
    keys = ModuleKeys.of(second, user)
    converted = keys.to_converted(user)
    trained = {k: v + 1 for k, v in converted.items()}
    back = keys.to_original(trained)
    assert list(back) == list(user)
    assert torch.equal(back["a.weight"], user["a.weight"] + 1)
    assert torch.equal(back["unused.weight"], user["unused.weight"])  # never read: as given


def test_sequential_fn_first_called_under_meta_still_traces_on_the_cpu():
    """A node process whose first build is for shapes only (stage.meta_layers): the trace
    is made on the CPU, so later CPU builds hold no meta constant."""
    from sky_flower.pipeline.graph import sequential_fn

    fn = sequential_fn(_Scaled, [4])
    with torch.device("meta"):
        assert all(p.is_meta for p in fn().parameters())
    model = fn()
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert model(torch.ones(3, 4)).shape == (3, 2)
