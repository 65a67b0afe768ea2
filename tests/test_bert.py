"""BERT profiled from shapes: entry layout, FLOPs against closed forms and real modules,
bytes against real parameter counts, and the training job's refusal."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from simhelpers import make_cfg
from tiers import examples
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from sky_flower.core.bert import (
    ENTRY_TYPES,
    BertAttention,
    BertEmbeddings,
    BertIntermediate,
    BertOutput,
    BertPooler,
    bert_entry_costs,
    bert_layer_profiles,
)
from sky_flower.run import run_job

TINY = dict(hidden=32, heads=2, intermediate=64, seq_len=8, num_classes=3, vocab_size=100)


def tiny_cpu_modules(hidden=32, heads=2, intermediate=64, num_classes=3, vocab_size=100):
    return {
        "embeddings": BertEmbeddings(vocab_size, hidden, 512, 2),
        "attention": BertAttention(hidden, heads),
        "intermediate": BertIntermediate(hidden, intermediate),
        "output": BertOutput(hidden, intermediate),
        "pooler": BertPooler(hidden),
        "classifier": nn.Linear(hidden, num_classes),
    }


def tiny_cpu_inputs(kind, batch, seq_len=8, hidden=32, intermediate=64):
    if kind == "embeddings":
        return [torch.randint(0, 100, (batch, seq_len))]
    if kind == "output":
        return [
            torch.randn(batch, seq_len, intermediate, requires_grad=True),
            torch.randn(batch, seq_len, hidden, requires_grad=True),
        ]
    if kind == "classifier":
        return [torch.randn(batch, hidden, requires_grad=True)]
    return [torch.randn(batch, seq_len, hidden, requires_grad=True)]


def closed_form_fwd(s, h, inter, c):
    return {
        "embeddings": 0,
        "attention": 4 * (2 * s * h * h) + 2 * (2 * s * s * h),
        "intermediate": 2 * s * h * inter,
        "output": 2 * s * inter * h,
        "pooler": 2 * h * h,
        "classifier": 2 * h * c,
    }


@pytest.mark.parametrize("num_layers", [1, 2, 24, 160])
def test_entry_layout(num_layers):
    prof = bert_layer_profiles(num_layers=num_layers)
    assert len(prof) == 1 + 3 * num_layers + 2
    assert [p.index for p in prof] == list(range(len(prof)))
    names = [p.name.split(":", 1)[1] for p in prof]
    assert names[0] == "embeddings" and names[-2:] == ["pooler", "classifier"]
    last = num_layers - 1
    assert names[-5:-2] == [f"layer{last}.attention", f"layer{last}.intermediate",
                            f"layer{last}.output"]  # fmt: skip
    assert names[1:4] == ["layer0.attention", "layer0.intermediate", "layer0.output"]


def test_bert_large_flops_match_closed_form():
    s, h, inter, c = 128, 1024, 4096, 3
    prof = bert_layer_profiles(num_layers=2)
    want = closed_form_fwd(s, h, inter, c)
    kinds = ["embeddings"] + ["attention", "intermediate", "output"] * 2 + ["pooler", "classifier"]
    for p, kind in zip(prof, kinds, strict=True):
        assert p.fwd_flops == want[kind], p.name
        # backward: input + weight gradients = 2x forward; embeddings: none counted
        assert p.bwd_flops == 2 * want[kind], p.name
    # the brief's example: Linear(h, 4h) over s tokens
    assert prof[2].fwd_flops == 2 * s * h * 4 * h
    assert prof[1].fwd_flops == 8 * s * h * h + 4 * s * s * h


@settings(max_examples=examples(15), deadline=None)
@given(
    head_dim=st.integers(1, 16),
    heads=st.integers(1, 4),
    inter=st.integers(1, 64),
    seq_len=st.integers(1, 32),
    classes=st.integers(1, 10),
)
def test_flops_closed_form_any_shape(head_dim, heads, inter, seq_len, classes):
    h = head_dim * heads
    costs = bert_entry_costs(
        hidden=h, heads=heads, intermediate=inter, seq_len=seq_len, num_classes=classes
    )
    want = closed_form_fwd(seq_len, h, inter, classes)
    assert {k: c.fwd_flops for k, c in costs.items()} == want
    assert {k: c.bwd_flops for k, c in costs.items()} == {k: 2 * v for k, v in want.items()}


def test_flops_identical_across_layers_and_160_layers_runs():
    prof = bert_layer_profiles(num_layers=160)
    assert len(prof) == 483
    for offset in range(3):  # attention, intermediate, output
        same = prof[1 + offset :: 3][:160]
        assert len({(p.fwd_flops, p.bwd_flops, p.param_bytes, p.act_out_bytes) for p in same}) == 1
    total = sum(p.fwd_flops + p.bwd_flops for p in prof)
    per_layer = 3 * (8 * 128 * 1024**2 + 4 * 128**2 * 1024 + 4 * 128 * 1024 * 4096)
    assert total == 160 * per_layer + 3 * (2 * 1024**2 + 2 * 1024 * 3)


def test_meta_counts_equal_real_cpu_counts_per_sample():
    """FlopCounterMode on meta tensors counts what it counts on real CPU tensors, and
    per-sample figures are the batch's divided by the batch size."""
    costs = bert_entry_costs(**TINY)
    torch.manual_seed(0)
    batch = 3
    for kind, module in tiny_cpu_modules().items():
        inputs = tiny_cpu_inputs(kind, batch)
        with FlopCounterMode(display=False) as fwd:
            out = module(*inputs)
        bwd_flops = 0
        if out.requires_grad:
            with FlopCounterMode(display=False) as bwd:
                out.backward(torch.ones_like(out))
            bwd_flops = bwd.get_total_flops()
        assert costs[kind].fwd_flops == fwd.get_total_flops() / batch, kind
        assert costs[kind].bwd_flops == bwd_flops / batch, kind


def test_param_bytes_match_real_modules():
    prof = bert_layer_profiles(num_layers=1, **TINY)
    modules = tiny_cpu_modules()
    for p, kind in zip(prof, ENTRY_TYPES, strict=True):  # one layer: one of each type
        numel = sum(t.numel() for t in modules[kind].parameters())
        assert p.param_bytes == 4 * numel, kind
    # an encoder layer holds exactly what torch's own transformer layer holds
    reference = nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64)
    assert sum(p.param_bytes for p in prof[1:4]) == 4 * sum(
        t.numel() for t in reference.parameters()
    )
    # BERT-large (24 layers, pooler included): Hugging Face's bert-large-uncased holds
    # 335,141,888 parameters; plus the 3-way classifier
    large = bert_layer_profiles()
    assert sum(p.param_bytes for p in large) == 4 * (335_141_888 + 1024 * 3 + 3)


@pytest.mark.parametrize(("optimizer", "copies"), [("adam", 2), ("sgd", 0), ("sgd_momentum", 1)])
def test_optimizer_state_and_dtype(optimizer, copies):
    prof = bert_layer_profiles(num_layers=1, optimizer=optimizer, **TINY)
    assert all(p.optimizer_state_bytes == copies * p.param_bytes for p in prof)
    half = bert_layer_profiles(num_layers=1, optimizer=optimizer, dtype_bytes=2, **TINY)
    assert [2 * p.param_bytes for p in half] == [p.param_bytes for p in prof]
    assert [2 * p.act_out_bytes for p in half] == [p.act_out_bytes for p in prof]
    assert half[0].act_in_bytes == prof[0].act_in_bytes == 8 * 8  # int64 token ids


def test_activation_bytes_from_shapes():
    s, h, inter, c = 128, 1024, 4096, 3
    emb, att, mid, out, pool, cls = bert_layer_profiles(num_layers=1)
    assert emb.act_in_bytes == s * 8 and emb.act_out_bytes == s * h * 4
    assert att.act_in_bytes == att.act_out_bytes == s * h * 4
    # the residual travels with the intermediate activation (SkyComputing's BertLayer_Body)
    assert mid.act_out_bytes == out.act_in_bytes == s * (inter + h) * 4
    assert out.act_out_bytes == pool.act_in_bytes == s * h * 4
    assert pool.act_out_bytes == cls.act_in_bytes == h * 4
    assert cls.act_out_bytes == c * 4
    # each entry's output is the next one's input
    prof = bert_layer_profiles(num_layers=3)
    assert all(a.act_out_bytes == b.act_in_bytes for a, b in zip(prof[1:], prof[2:], strict=False))


def test_stash_bytes_match_real_saved_tensors():
    """Meta-measured stash equals the distinct storages autograd saves on real CPU
    tensors (parameters excluded)."""
    stash = [p.stash_bytes for p in bert_layer_profiles(num_layers=1, **TINY)]
    assert len(stash) == 1 + 3 + 2
    kinds = ["embeddings", "attention", "intermediate", "output", "pooler", "classifier"]
    for kind, want in zip(kinds, stash, strict=True):
        module = tiny_cpu_modules()[kind]
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        saved = {}

        def pack(t, params=params, saved=saved):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(*tiny_cpu_inputs(kind, 1))
        assert sum(saved.values()) == want, kind
    # attention at BERT-large size: 6 s x h activations + the s x s probabilities per head
    large = bert_layer_profiles(num_layers=1)
    assert large[1].stash_bytes >= (6 * 128 * 1024 + 16 * 128 * 128) * 4


def test_bad_input_refused():
    with pytest.raises(ValueError, match="multiple of heads"):
        bert_layer_profiles(hidden=30, heads=4)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        bert_layer_profiles(num_layers=0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        bert_layer_profiles(optimizer="lamb")
    with pytest.raises(ValueError, match="exceeds max_position"):
        bert_layer_profiles(seq_len=1024)
    with pytest.raises(ValueError, match="positive integers"):
        bert_entry_costs(intermediate=0)


def test_training_job_refuses_planning_only_model(tmp_path):
    cfg = make_cfg(["model=bert_large", "model.num_layers=160"])
    assert cfg.model.planning_only is True
    with pytest.raises(ValueError, match=r"planning only.*python -m sky_flower\.plan"):
        run_job(cfg, tmp_path)
