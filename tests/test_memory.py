"""Memory model against measurement: the autograd stash per layer, and a stage's predicted
peak (``CostModel.stage_memory``) against the peak of live tensors when the stage runs
its step (``sky_flower.core.memory.measure_stage_memory``)."""

from dataclasses import replace

import pytest
import torch
from factories import fake_layer
from torch import nn

from sky_flower.core.bert import (
    ENTRY_TYPES,
    BertAttention,
    BertIntermediate,
    bert_entry_costs,
    bert_layer_profiles,
)
from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.memory import measure_stage_memory, schedule_order
from sky_flower.core.profile import NodeProfile, profile_layers
from sky_flower.pipeline.models import build_mlp

MIB = 2**20


def one_node(num_layers):
    return NodeProfile("n", (0.0,) * num_layers, (0.0,) * num_layers, 10**12)


def test_stash_bytes_measured_for_linear_relu():
    """A Linear + ReLU block saves its input (for the weight gradient) and its output
    (ReLU's backward reads it): more than the output alone."""
    block = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
    (p,) = profile_layers([block], input_shape=(64,), microbatch_size=8)
    assert p.act_out_bytes == 32 * 4
    assert p.stash_bytes == (64 + 32) * 4 > p.act_out_bytes
    assert p.to_dict()["stash_bytes"] == p.stash_bytes
    # parameters are not stash; a view and its base count once (attention saves views)
    (lin,) = profile_layers([nn.Linear(16, 16)], input_shape=(16,), microbatch_size=4)
    assert lin.stash_bytes == 16 * 4


def test_bert_profiles_carry_the_stash():
    sizes = dict(hidden=32, heads=2, intermediate=64, seq_len=8)
    profiles = bert_layer_profiles(num_layers=1, **sizes)
    costs = bert_entry_costs(**sizes)
    assert [p.stash_bytes for p in profiles] == [costs[k].stash_bytes for k in ENTRY_TYPES]
    assert all(p.stash_bytes > 0 for p in profiles)


def test_cost_model_uses_stash_bytes_else_act_out():
    schedule = Schedule(batch_size=8, microbatches=2, kind="gpipe", transport="direct")
    unknown = [fake_layer(0, param=100, opt=200, act_out=10.0), fake_layer(1, act_out=20.0)]
    cost = CostModel(unknown, [one_node(2)], schedule)
    assert cost.stash.tolist() == [10.0, 20.0]  # fallback: the layer's output
    assert cost.stage_memory(0, 1, inflight=2) == 2 * 100 + 200 + 2 * 4 * 30.0
    known = [replace(lp, stash_bytes=3 * lp.act_out_bytes) for lp in unknown]
    cost = CostModel(known, [one_node(2)], schedule)
    assert cost.stash.tolist() == [30.0, 60.0]
    assert cost.stage_memory(0, 1, inflight=2) == 2 * 100 + 200 + 2 * 4 * 90.0


def test_schedule_orders():
    assert schedule_order("sequential", 2) == ["F0", "B0", "F1", "B1"]
    assert schedule_order("gpipe", 2) == ["F0", "F1", "B0", "B1"]
    assert schedule_order("1f1b", 3, inflight=2) == ["F0", "F1", "B0", "F2", "B1", "B2"]
    with pytest.raises(ValueError, match="unknown schedule kind"):
        schedule_order("zigzag", 2)


# --- predicted against measured peak ---------------------------------------------------
def mlp_case():
    """The default MLP (conf/model/mlp.yaml sizes), batch 64, a middle stage: blocks 6-7
    and the head (layers 6..8)."""
    return list(build_mlp(64, 1024, 8, 10)), (64,), 64, 6, 8


def bert_case():
    """A tiny BERT's attention and intermediate entries as one stage (hidden 64, 4 heads,
    intermediate 256, 32 tokens), batch 32."""
    torch.manual_seed(0)
    return [BertAttention(64, 4), BertIntermediate(64, 256)], (32, 64), 32, 0, 1


def step_transients(layers, profiles, first, last, mb, microbatches, inflight):
    """Upper bound on what the step holds beyond ``stage_memory`` (bytes), at its two
    candidate peak moments.

    * optimizer step (Adam, single-tensor on CPU): ``(exp_avg_sq.sqrt() / c).add_(eps)``
      makes two temporaries the size of the parameter being updated:
      ``2 x`` the largest parameter tensor;
    * backward: the outputs of the in-flight micro-batches, held for their backward and
      not in the stash unless the last layer saves them (``n mb act_out[last]``); the
      arriving output gradient (``mb act_out[last]``); the largest activation gradient
      inside the stage; the input gradient leaving (``mb act_in[first]``); and with
      ``M > 1`` the new weight gradient before it is added into ``.grad`` (the largest
      parameter tensor).
    """
    largest_param = max(p.numel() * p.element_size() for m in layers for p in m.parameters())
    acts = [profiles[first].act_in_bytes] + [p.act_out_bytes for p in profiles[first : last + 1]]
    out = profiles[last].act_out_bytes
    optimizer = 2 * largest_param
    backward = mb * ((inflight + 1) * out + max(acts) + profiles[first].act_in_bytes)
    if microbatches > 1:
        backward += largest_param
    return optimizer, backward


@pytest.mark.parametrize("case", [mlp_case, bert_case], ids=["mlp", "bert"])
@pytest.mark.parametrize("kind", ["sequential", "gpipe"])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_predicted_peak_against_measured(case, kind, microbatches):
    """Stated tolerance: ``predicted <= measured <= predicted + transients`` (1 % slack
    for Adam's per-tensor ``step`` counters and bias-correction scalars), with the
    transients itemised in :func:`step_transients`; in these cases that puts the measured
    peak at 1.0-1.8 x the prediction. The prediction (parameters + gradients + Adam state
    + the autograd stash of the in-flight micro-batches) is a lower bound on the real
    peak; what it leaves out are the step's transients.

    Measured here (MiB, predicted / measured; Adam, batch 64 for the MLP, 32 for BERT):

    ============  ==  =============  =============
    stage         M   sequential     gpipe
    ============  ==  =============  =============
    MLP 6..8      1   33.44 / 40.19  33.44 / 40.19
    MLP 6..8      4   32.50 / 40.19  33.44 / 40.19
    BERT att+int  1   3.77 / 6.64    3.77 / 6.64
    BERT att+int  4   1.32 / 2.07    3.77 / 5.14
    ============  ==  =============  =============

    The MLP stage peaks in the optimizer step, when no activation is alive: 2 x params +
    Adam state (32.2 MiB) + Adam's two temporaries of one 1024 x 1024 weight (8 MiB), so
    the cost model is 17-19 % short. The activation-heavy BERT stage peaks in the backward,
    36-76 % above the prediction: the outputs held for the backward, the arriving output
    gradient and the activation gradients (two to three micro-batches of the widest
    activation). The transient bound matches the MLP exactly and is 5-6 % above the
    measured BERT peak (it adds buffers that are not all alive at the same moment).
    """
    layers, shape, batch, first, last = case()
    mb = batch // microbatches
    profiles = profile_layers(layers, shape, mb)
    schedule = Schedule(batch, microbatches, kind, transport="direct")
    cost = CostModel(profiles, [one_node(len(layers))], schedule)
    inflight = cost.inflight(1, 2)  # a second stage of two
    predicted = cost.stage_memory(first, last, inflight=inflight)
    static = cost.stage_memory(first, last, inflight=0)

    x = torch.randn(mb, *shape)
    with torch.no_grad():
        for layer in layers[:first]:
            x = layer(x)
    stage = layers[first : last + 1]
    measured = measure_stage_memory(stage, x, microbatches, kind, "adam", input_grad=True).total

    opt_tmp, bwd_tmp = step_transients(stage, profiles, first, last, mb, microbatches, inflight)
    bound = max(static + opt_tmp, predicted + bwd_tmp)
    ratio = measured / predicted
    assert predicted <= measured, (predicted / MIB, measured / MIB)
    assert measured <= 1.01 * bound, (measured / MIB, bound / MIB)
    assert 1.0 <= ratio <= 1.8


def test_stash_of_in_flight_micro_batches_is_exact_for_bert():
    """What the forwards keep alive under gpipe (the most the ``forward`` category holds)
    is exactly the predicted stash of the ``M`` in-flight micro-batches plus their outputs
    (held for the backward; GELU saves its input, not its output)."""
    layers, shape, batch, first, last = bert_case()
    M = 4
    mb = batch // M
    profiles = profile_layers(layers, shape, mb)
    cost = CostModel(profiles, [one_node(2)], Schedule(batch, M, "gpipe", "direct"))
    result = measure_stage_memory(layers, torch.randn(mb, *shape), M, "gpipe")
    stash = cost.stage_memory(first, last, inflight=M) - cost.stage_memory(first, last, 0)
    outputs = M * mb * profiles[last].act_out_bytes
    assert result.category_peaks["forward"] == pytest.approx(stash + outputs, rel=1e-3)


def test_measurement_leaves_the_layers_alone_and_refuses_bad_input():
    layer = nn.Linear(4, 4)
    before = layer.weight.detach().clone()
    assert measure_stage_memory([layer], torch.randn(2, 4), 2, "sequential", "sgd").total > 0
    assert torch.equal(layer.weight, before) and layer.weight.grad is None
    with pytest.raises(ValueError, match="at least one layer"):
        measure_stage_memory([], torch.randn(2, 4), 1)
    with pytest.raises(ValueError, match="floating-point"):
        measure_stage_memory([nn.Embedding(5, 4)], torch.zeros(2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="unknown optimizer"):
        measure_stage_memory([layer], torch.randn(2, 4), 1, optimizer="lion")
