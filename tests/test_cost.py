"""CostModel on a tiny instance whose every number is worked out by hand below."""

import math

import pytest
from factories import fake_layer

from sky_flower.cost import CostModel, Schedule
from sky_flower.profile import NodeProfile

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


def _cost(batch=4, microbatches=2, kind="sequential", transport="relay", nodes=NODES):
    return CostModel(LAYERS, nodes, Schedule(batch, microbatches, kind, transport))


# --- compute ---------------------------------------------------------------------------
def test_compute_sequential_relay():
    cost = _cost()  # B=4, M=2, sequential: per step, times x M
    # node a is not the last stage: relay recomputes the forward (r = 2)
    #   layer 0: 2 * (2*1 + 4) = 12;  layer 1: 2 * (2*2 + 5) = 18;  layer 2: 2 * (2*3 + 6) = 24
    # node b is the last stage (r = 1)
    #   layer 0: 2 * (10 + 40) = 100; layer 1: 2 * (20 + 50) = 140; layer 2: 2 * (30 + 60) = 180
    assert cost.compute.tolist() == [[12.0, 18.0, 24.0], [100.0, 140.0, 180.0]]
    assert cost.stage_compute(0, 0, 0) == pytest.approx(12.0)
    assert cost.stage_compute(0, 0, 1) == pytest.approx(12.0 + 18.0)
    assert cost.stage_compute(1, 1, 2) == pytest.approx(140.0 + 180.0)
    assert cost.stage_compute(1, 2, 2) == pytest.approx(180.0)


def test_compute_direct_transport_has_no_recompute():
    cost = _cost(transport="direct")
    # r = 1 everywhere, times x M=2: a: 2*(1+4)=10, 2*(2+5)=14, 2*(3+6)=18
    assert cost.compute[0].tolist() == [10.0, 14.0, 18.0]
    assert cost.compute[1].tolist() == [100.0, 140.0, 180.0]


def test_compute_gpipe_is_per_microbatch():
    cost = _cost(kind="gpipe")
    # per micro-batch: no factor M; a (r=2): 2*1+4=6, 2*2+5=9, 2*3+6=12; b (r=1): 50, 70, 90
    assert cost.compute.tolist() == [[6.0, 9.0, 12.0], [50.0, 70.0, 90.0]]


# --- transfer and state ----------------------------------------------------------------
def test_transfer_sequential_split_a():
    cost = _cost()  # sequential: bytes for the whole batch, B = 4
    # node a (not last: 2 messages), layers 0..0
    #   latency 2 * 0.5 = 1.0
    #   labels leave the data owner: 8 * 4 = 32 bytes / 1000 = 0.032
    #   state: 2 msgs * 0.001 * (100 + 200) = 0.6
    #   send act_out[0] and its gradient back: 2 * 4 * 20 / 1000 = 0.16
    #   no receive (starts at layer 0)
    t_a = 1.0 + 0.032 + 0.6 + 0.16
    assert cost.stage_transfer(0, 0, 0) == pytest.approx(t_a)  # 1.792
    # node b (last: 1 message), layers 1..2
    #   latency 1 * 0.25 = 0.25
    #   labels reach the last stage: 32 / 500 = 0.064
    #   state: 1 msg * 0.002 * (300 + 600 + 50 + 100) = 2.1
    #   receive act_in[1] and return its gradient: 2 * 4 * 20 / 500 = 0.32
    #   no send (ends at the last layer)
    t_b = 0.25 + 0.064 + 2.1 + 0.32
    assert cost.stage_transfer(1, 1, 2) == pytest.approx(t_b)  # 2.734
    assert cost.stage_time(0, 0, 0) == pytest.approx(12.0 + t_a)
    assert cost.stage_time(1, 1, 2) == pytest.approx(320.0 + t_b)


def test_transfer_sequential_split_b():
    cost = _cost()
    # node a, layers 0..1: latency 1.0 + labels 0.032
    #   + state 2 * 0.001 * (100 + 200 + 300 + 600) = 2.4 + send 2 * 4 * act_out[1]=5 / 1000 = 0.04
    assert cost.stage_transfer(0, 0, 1) == pytest.approx(1.0 + 0.032 + 2.4 + 0.04)
    # node b, layer 2: latency 0.25 + labels 0.064 + state 1 * 0.002 * (50 + 100) = 0.3
    #   + receive 2 * 4 * act_in[2]=5 / 500 = 0.08
    assert cost.stage_transfer(1, 2, 2) == pytest.approx(0.25 + 0.064 + 0.3 + 0.08)


def test_transfer_arrays():
    cost = _cost()
    # messages: a 2, b 1 -> fixed = messages * latency + label bytes / bandwidth
    assert cost.fixed.tolist() == pytest.approx([2 * 0.5 + 32 / 1000, 1 * 0.25 + 32 / 500])
    # state[i, j] = messages_i * state_s_per_byte_i * (param_j + optimizer_j)
    assert cost.state.tolist() == [
        pytest.approx([2 * 0.001 * 300, 2 * 0.001 * 900, 2 * 0.001 * 150]),
        pytest.approx([1 * 0.002 * 300, 1 * 0.002 * 900, 1 * 0.002 * 150]),
    ]
    # send[i, j] = 2 * B * act_out[j] / bw_i ; recv[i, j] = 2 * B * act_in[j] / bw_i, 0 at j=0
    assert cost.send.tolist() == [
        pytest.approx([8 * 20 / 1000, 8 * 5 / 1000, 8 * 2 / 1000]),
        pytest.approx([8 * 20 / 500, 8 * 5 / 500, 8 * 2 / 500]),
    ]
    assert cost.recv.tolist() == [
        pytest.approx([0.0, 8 * 20 / 1000, 8 * 5 / 1000]),
        pytest.approx([0.0, 8 * 20 / 500, 8 * 5 / 500]),
    ]


def test_infinite_bandwidth_costs_latency_and_state_only():
    nodes = [
        NodeProfile(n.name, n.layer_fwd_s, n.layer_bwd_s, n.memory_bytes, n.latency_s)
        for n in NODES
    ]
    cost = _cost(nodes=nodes)  # bandwidth inf, state_s_per_byte 0
    assert cost.stage_transfer(0, 0, 0) == pytest.approx(2 * 0.5)
    assert cost.stage_transfer(1, 1, 2) == pytest.approx(1 * 0.25)


def test_single_node_has_one_message_and_no_label_transfer():
    cost = CostModel(LAYERS, NODES[:1], Schedule(4, 2))
    # the lone node is the last stage: r = 1, one message, labels never leave it
    assert cost.compute[0].tolist() == [2 * (1 + 4), 2 * (2 + 5), 2 * (3 + 6)]
    # latency 0.5 + state 1 * 0.001 * (300 + 900 + 150) = 1.35
    assert cost.stage_transfer(0, 0, 2) == pytest.approx(0.5 + 1.35)
    assert cost.step_time([(0, 2)]) == pytest.approx(10 + 14 + 18 + 0.5 + 1.35)


# --- memory ----------------------------------------------------------------------------
def test_memory():
    cost = _cost()  # B = 4
    # 2 * param + optimizer + B * act_out
    #   layer 0: 200 + 200 + 80 = 480; layer 1: 600 + 600 + 20 = 1220; layer 2: 100 + 100 + 8 = 208
    assert cost.memory.tolist() == [480.0, 1220.0, 208.0]
    assert cost.stage_memory(0, 0) == 480.0
    assert cost.stage_memory(1, 2) == 1220.0 + 208.0
    assert cost.stage_memory(0, 2) == 480.0 + 1220.0 + 208.0
    assert cost.capacity.tolist() == [10_000.0, 20_000.0]
    assert cost.fits(SPLIT_A)
    # the activation term uses the whole batch, whatever the micro-batch count
    assert _cost(batch=4, microbatches=4).memory.tolist() == [480.0, 1220.0, 208.0]


def test_fits_detects_overflow():
    tight = [
        NodeProfile("a", NODES[0].layer_fwd_s, NODES[0].layer_bwd_s, memory_bytes=480),
        NodeProfile("b", NODES[1].layer_fwd_s, NODES[1].layer_bwd_s, memory_bytes=1427),
    ]
    cost = _cost(nodes=tight)
    assert not cost.fits(SPLIT_A)  # node a 480 <= 480 fits, node b needs 1428 > 1427
    assert not cost.fits(SPLIT_B)  # node a needs 1700 > 480


# --- step time -------------------------------------------------------------------------
def test_step_time_sequential_is_sum():
    cost = _cost()
    t_a = 12.0 + (1.0 + 0.032 + 0.6 + 0.16)  # 13.792
    t_b = 320.0 + (0.25 + 0.064 + 2.1 + 0.32)  # 322.734
    assert cost.step_time(SPLIT_A) == pytest.approx(t_a + t_b)  # 336.526
    assert cost.combine([1.0, 2.0, 3.0]) == 6.0


def test_step_time_gpipe_adds_slowest_stage():
    cost = _cost(kind="gpipe")  # per micro-batch: 2 samples
    # node a, layer 0: compute 2*1 + 4 = 6
    #   latency 1.0 + labels 8 * 2 / 1000 = 0.016 + state 0.6 + send 2 * 2 * 20 / 1000 = 0.08
    t_a = 6.0 + 1.0 + 0.016 + 0.6 + 0.08  # 7.696
    # node b, layers 1..2: compute 70 + 90 = 160
    #   latency 0.25 + labels 16 / 500 = 0.032 + state 2.1 + recv 2 * 2 * 20 / 500 = 0.16
    t_b = 160.0 + 0.25 + 0.032 + 2.1 + 0.16  # 162.542
    assert cost.stage_time(0, 0, 0) == pytest.approx(t_a)
    assert cost.stage_time(1, 1, 2) == pytest.approx(t_b)
    # T = sum + (M - 1) * max, M = 2
    assert cost.step_time(SPLIT_A) == pytest.approx(t_a + t_b + 1 * t_b)  # 332.78
    assert cost.combine([1.0, 3.0, 2.0]) == pytest.approx(6.0 + 1 * 3.0)
    # M = 4 (micro-batches of 1 sample)
    cost4 = _cost(kind="gpipe", microbatches=4)
    assert cost4.combine([1.0, 3.0, 2.0]) == pytest.approx(6.0 + 3 * 3.0)


def test_check_bounds():
    cost = _cost()
    cost.check_bounds(SPLIT_A)
    cost.check_bounds(SPLIT_B)
    for bad in (
        [(0, 2)],  # one stage for two nodes
        [(0, 0), (1, 1)],  # layer 2 uncovered
        [(0, 1), (1, 2)],  # overlap
        [(0, 0), (2, 2)],  # gap
        [(1, 1), (2, 2)],  # does not start at 0
        [(0, 2), (3, 2)],  # empty stage
    ):
        with pytest.raises(ValueError):
            cost.check_bounds(bad)


# --- validation ------------------------------------------------------------------------
def test_schedule_rejects_microbatches_not_dividing_batch():
    with pytest.raises(ValueError, match=r"microbatches=3 must divide batch_size=64"):
        Schedule(batch_size=64, microbatches=3)
    assert Schedule(batch_size=64, microbatches=4).microbatch_size == 16


@pytest.mark.parametrize(("batch", "micro"), [(0, 1), (8, 0), (-4, 2)])
def test_schedule_rejects_non_positive(batch, micro):
    with pytest.raises(ValueError, match="must be >= 1"):
        Schedule(batch_size=batch, microbatches=micro)


def test_schedule_rejects_unknown_kind_and_transport():
    with pytest.raises(ValueError, match=r"unknown schedule kind '1f1b'.*sequential.*gpipe"):
        Schedule(kind="1f1b")  # type: ignore[arg-type]
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
    for arr in (cost.compute, cost.state, cost.send, cost.recv, cost.fixed, cost.memory):
        assert all(math.isfinite(float(v)) for v in arr.ravel())
