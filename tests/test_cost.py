"""CostModel on a tiny instance whose every number is worked out by hand below."""

import dataclasses
import math

import pytest
from factories import fake_layer

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.profile import NodeProfile
from sky_flower.core.simulate import simulate

_layer = fake_layer


# layer   param  optimizer  act_in  act_out   (bytes; act per sample)
#   0      100      200       10      20
#   1      300      600       20       5
#   2       50      100        5       2
LAYERS = [
    _layer(0, 100, 200, 10.0, 20.0),
    _layer(1, 300, 600, 20.0, 5.0),
    _layer(2, 50, 100, 5.0, 2.0),
]

# node  fwd s/mb     bwd s/mb     latency  bandwidth  state s/byte  memory
#  a    1, 2, 3      4, 5, 6        0.5     1000 B/s     0.001       10_000
#  b    10, 20, 30   40, 50, 60     0.25     500 B/s     0.002       20_000
NODES = [
    NodeProfile(
        name="a",
        layer_fwd_s=(1.0, 2.0, 3.0),
        layer_bwd_s=(4.0, 5.0, 6.0),
        memory_bytes=10_000,
        latency_s=0.5,
        bandwidth_bps=1000.0,
        state_s_per_byte=0.001,
    ),
    NodeProfile(
        name="b",
        layer_fwd_s=(10.0, 20.0, 30.0),
        layer_bwd_s=(40.0, 50.0, 60.0),
        memory_bytes=20_000,
        latency_s=0.25,
        bandwidth_bps=500.0,
        state_s_per_byte=0.002,
    ),
]

SPLIT_A = [(0, 0), (1, 2)]  # node a: layer 0; node b: layers 1, 2
SPLIT_B = [(0, 1), (2, 2)]  # node a: layers 0, 1; node b: layer 2


def _cost(batch=4, microbatches=2, kind="sequential", transport="relay", nodes=NODES, **extra):
    return CostModel(LAYERS, nodes, Schedule(batch, microbatches, kind, transport, **extra))


# --- hand-checked terms (B = 4, M = 2: micro-batches of 2) --------------------------------
def test_terms_relay_split_a():
    cost = _cost()  # sequential, relay
    t = cost.terms(SPLIT_A)
    # node a: layer 0; not the last stage, so relay recomputes its forward: b = 4 + 1
    # node b: layers 1-2; last stage: f = 20 + 30, b = 50 + 60
    assert t.fwd.tolist() == [1.0, 50.0]
    assert t.bwd.tolist() == [5.0, 110.0]
    # link: 2 samples x 20 bytes, up to the server at 1000 B/s and down at 500 B/s
    assert t.link.tolist() == pytest.approx([40 * (1 / 1000 + 1 / 500)])
    # overhead a: 2 messages x (0.5 + 0.001 x 300 state bytes) + 32 label bytes / 1000
    # overhead b: 1 message x (0.25 + 0.002 x 1050) + 32 / 500
    assert t.overhead.tolist() == pytest.approx([1.632, 2.414])


def test_step_time_sequential_relay():
    # M (sum f + b + 2 links) + overheads = 2 (166 + 0.24) + 4.046
    assert _cost().step_time(SPLIT_A) == pytest.approx(336.526)


def test_step_time_relay_gpipe_by_message_groups():
    # Per message: a 0.5 + 0.001 x 300 = 0.8, b 0.25 + 0.002 x 1050 = 2.35; payload on the
    # node per micro-batch: a 40 B / 1000 = 0.04, b 40 B / 500 = 0.08; labels 0.096.
    # c = 2 (one group, the sequential relay's messages): a F 0.8 + 2 x 1.04, b F+B
    # 2.35 + 2 x 160.16, a B 0.8 + 2 x 5.04 -> 336.43 + 0.096
    two = _cost(kind="gpipe", microbatches_per_message=2)
    assert two.step_time(SPLIT_A) == pytest.approx(336.526)
    assert two.step_time(SPLIT_A) == pytest.approx(_cost().step_time(SPLIT_A))
    # c = 1 (two groups; gradients ride along: + 0.1 on a, + 0.7 on b per message):
    # a F0 [0, 1.94] F1 [1.94, 3.88]; b F0B0 [1.94, 165.15] F1B1 [165.15, 328.36];
    # a B0 [165.15, 171.09], B1 [328.36, 334.30]; + 0.096
    one = _cost(kind="gpipe", microbatches_per_message=1)
    assert one.step_time(SPLIT_A) == pytest.approx(334.396)
    auto = _cost(kind="gpipe")  # 0: the cheaper of the two
    assert auto.relay_group_size(auto.terms(SPLIT_A)) == 1
    assert auto.step_time(SPLIT_A) == pytest.approx(334.396)


def test_schedule_rejects_bad_microbatches_per_message():
    with pytest.raises(ValueError, match="microbatches_per_message=3 must be 0.*divisor"):
        Schedule(8, 4, microbatches_per_message=3)


def test_direct_has_no_recompute_no_overhead_and_peer_links():
    cost = _cost(kind="gpipe", transport="direct")
    t = cost.terms(SPLIT_A)
    assert t.bwd.tolist() == [4.0, 110.0]
    assert t.overhead.tolist() == [0.0, 0.0]
    # (0.5 + 0.25) / 2 latency + 40 bytes at the slower 500 B/s
    assert t.link.tolist() == pytest.approx([0.375 + 0.08])
    assert cost.step_time(SPLIT_A) == pytest.approx(165 + 0.91 + 160)
    assert cost.period(SPLIT_A) == pytest.approx(160.0)


@pytest.mark.parametrize("kind", ["sequential", "gpipe", "1f1b"])
@pytest.mark.parametrize("transport", ["relay", "direct"])
@pytest.mark.parametrize("split", [SPLIT_A, SPLIT_B, [(1, 0, 1), (0, 2, 2)]])
def test_step_time_agrees_with_the_simulator(kind, transport, split):
    nodes = [dataclasses.replace(NODES[0], holds_data=True), NODES[1]]
    if split[0][0] == 1:
        nodes = [NODES[0], dataclasses.replace(NODES[1], holds_data=True)]
    cost = _cost(kind=kind, transport=transport, nodes=nodes)
    t = cost.terms(split)
    if transport == "direct" or kind == "sequential":
        sim = simulate(t.fwd, t.bwd, t.link, t.link, 2, kind)
        want = sim.step_time_s + t.overhead.sum()
    else:  # pipelined relay: per message group (test_step_time_relay_gpipe_by_message_groups)
        want = min(cost.relay_pipeline_time(t, c) for c in (1, 2))
    assert cost.step_time(split) == pytest.approx(want, rel=1e-12)
    assert cost.step_time(split) >= cost.step_lower_bound() - 1e-9
    assert cost.period(split) >= cost.period_lower_bound() - 1e-9


def test_infinite_bandwidth_costs_latency_and_state_only():
    fast = [dataclasses.replace(n, bandwidth_bps=math.inf) for n in NODES]
    t = _cost(nodes=fast).terms(SPLIT_A)
    assert t.link.tolist() == [0.0]
    assert t.overhead.tolist() == pytest.approx([1.6, 2.35])


def test_single_stage_has_one_message_and_no_label_transfer():
    cost = CostModel(LAYERS, NODES[:1], Schedule(4, 2))
    # 1 message x (0.5 + 0.001 x 1350 state bytes); compute 2 x (6 + 15) = 42
    assert cost.step_time([(0, 2)]) == pytest.approx(42 + 0.5 + 1.35)


# --- memory ------------------------------------------------------------------------
def test_memory_by_schedule():
    # relay keeps the whole batch: a: 2 x 100 + 200 + 2 x 2 x 20 = 480; b: 1400 + 2 x 2 x 7
    assert _cost().stage_memories(SPLIT_A) == [480.0, 1428.0]
    # direct sequential: one micro-batch; gpipe: all M; 1f1b: min(S - k, M)
    assert _cost(transport="direct").stage_memories(SPLIT_A) == [440.0, 1414.0]
    assert _cost(kind="gpipe", transport="direct").stage_memories(SPLIT_A) == [480.0, 1428.0]
    assert _cost(kind="1f1b", transport="direct").stage_memories(SPLIT_A) == [480.0, 1414.0]


def test_fits_detects_overflow():
    cost = _cost()
    assert cost.fits(SPLIT_A)
    tight = [
        dataclasses.replace(NODES[0], memory_bytes=480),
        dataclasses.replace(NODES[1], memory_bytes=1427),
    ]
    cost = _cost(nodes=tight)
    assert not cost.fits(SPLIT_A)  # a: 480 <= 480 fits; b needs 1428 > 1427
    assert not cost.fits(SPLIT_B)  # a needs 2 x 400 + 1200 + 100 = 1700 > 480


# --- plan validity -------------------------------------------------------------------
def test_check_stages():
    cost = _cost()
    cost.check_stages(SPLIT_A)
    cost.check_stages([(0, 0, 2)])  # node b idle
    for bad, msg in [
        ([(0, 0), (2, 2)], "start at 1"),
        ([(0, 0), (1, 1)], "cover 2 of 3"),
        ([(0, 1), (1, 0)], "start at 2"),
        ([(0, 0, 0), (0, 1, 2)], "holds two stages"),
        ([(0, 0, 0), (5, 1, 2)], "names node 5"),
        ([(1, 0, 0), (0, 1, 2)], "data owner"),
        ([], "at least one stage"),
    ]:
        with pytest.raises(ValueError, match=msg):
            cost.check_stages(bad)


def test_schedule_rejects_microbatches_not_dividing_batch():
    with pytest.raises(ValueError, match=r"microbatches=3 must divide batch_size=64"):
        Schedule(batch_size=64, microbatches=3)
    assert Schedule(batch_size=64, microbatches=4).microbatch_size == 16


@pytest.mark.parametrize(("batch", "micro"), [(0, 1), (8, 0), (-4, 2)])
def test_schedule_rejects_non_positive(batch, micro):
    with pytest.raises(ValueError, match="must be >= 1"):
        Schedule(batch_size=batch, microbatches=micro)


def test_schedule_rejects_unknown_kind_and_transport():
    with pytest.raises(ValueError, match=r"unknown schedule kind 'zb'.*sequential.*gpipe.*1f1b"):
        Schedule(kind="zb")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown transport 'grpc'.*relay.*direct"):
        Schedule(transport="grpc")  # type: ignore[arg-type]


def test_cost_model_rejects_mismatched_nodes():
    with pytest.raises(ValueError, match="no nodes"):
        CostModel(LAYERS, [], Schedule(4))
    with pytest.raises(ValueError, match="no layers"):
        CostModel([], NODES, Schedule(4))
    short = NodeProfile("short", (1.0, 2.0), (1.0, 2.0), memory_bytes=1)
    with pytest.raises(ValueError, match=r"'short' reports times for 2 layers.*has 3"):
        CostModel(LAYERS, [NODES[0], short], Schedule(4))


def test_all_terms_finite():
    cost = _cost()
    t = cost.terms(SPLIT_B)
    for arr in (t.fwd, t.bwd, t.link, t.overhead, cost.memory_static, cost.stash):
        assert all(math.isfinite(float(v)) for v in arr.ravel())


@pytest.mark.parametrize("kind", ["sequential", "gpipe", "1f1b"])
def test_stream_is_the_relay_without_context_state(kind):
    """transport=stream: every hop through the server as on the relay (recomputation,
    payload over each node's own bandwidth, one op at a time per stage), but a frame is
    no Flower message: each op costs the node's latency and nothing for context.state.
    So its terms and step time are the relay's on nodes whose state rate is 0."""
    stream = _cost(kind=kind, transport="stream")
    no_state = [dataclasses.replace(n, state_s_per_byte=0.0) for n in NODES]
    relay = _cost(kind=kind, transport="relay", nodes=no_state)
    for split in (SPLIT_A, SPLIT_B):
        t, r = stream.terms(split), relay.terms(split)
        for name in ("fwd", "bwd", "link", "overhead", "message", "node_link", "grad_state"):
            assert getattr(t, name).tolist() == getattr(r, name).tolist(), name
        assert stream.step_time(split) == relay.step_time(split)
    t = stream.terms(SPLIT_A)
    assert t.message.tolist() == [0.5, 0.25]  # the latency alone: no state shipping
    assert t.bwd.tolist() == [4.0 + 1.0, 110.0]  # stage 0 recomputes its forward
    assert stream.step_time(SPLIT_A) < _cost(kind=kind, transport="relay").step_time(SPLIT_A)
