"""Partitioner properties on random small instances, plus hand-checked cases."""

import math
import re

import pytest
from factories import fake_layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sky_flower.cost import CostModel, Schedule
from sky_flower.partition import (
    MIB,
    InfeasibleMemoryError,
    _speed_proportional,
    brute_force,
    even,
    feasible_bounds,
    heuristic,
    lower_bound,
    optimal,
    partition,
)
from sky_flower.profile import NodeProfile

REL = 1e-6  # relative tolerance (MILP stops at mip_rel_gap=1e-6)
ABS = 1e-9  # seconds


def _le(a, b):
    """a <= b up to floating-point / solver tolerance."""
    return a <= b + REL * abs(b) + ABS


_layer = fake_layer


def _node(name, fwd, bwd, memory=2**50, **kw):
    return NodeProfile(
        name=name, layer_fwd_s=tuple(fwd), layer_bwd_s=tuple(bwd), memory_bytes=memory, **kw
    )


# --------------------------------------------------------------------------------------
# random instances
# --------------------------------------------------------------------------------------
@st.composite
def instances(draw, min_nodes=1):
    n = draw(st.integers(min_nodes, 4))
    n_layers = draw(st.integers(n, 8))
    micro = draw(st.sampled_from([1, 2, 4]))
    batch = micro * draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["sequential", "gpipe"]))
    transport = draw(st.sampled_from(["relay", "direct"]))
    byte = st.integers(0, 4 * MIB)
    # activation bytes per sample; the scale sets how much transfers weigh against compute
    act_scale = draw(st.sampled_from([1024, 16 * 1024, 256 * 1024]))
    acts = [draw(st.integers(0, act_scale)) for _ in range(n_layers + 1)]
    layers = [
        _layer(j, draw(byte), draw(byte), float(acts[j]), float(acts[j + 1]))
        for j in range(n_layers)
    ]
    schedule = Schedule(batch, micro, kind, transport)
    # memory the layers need, to size node memory around it
    need = sum(
        2 * lp.param_bytes + lp.optimizer_state_bytes + batch * lp.act_out_bytes for lp in layers
    )
    t = st.floats(1e-4, 1e-1, allow_nan=False, allow_infinity=False)
    nodes = []
    for i in range(n):
        if draw(st.booleans()):
            memory = 2**50  # effectively unlimited
        else:  # tight: a random fraction of what an equal share would need
            memory = int(need / n * draw(st.floats(0.5, 3.0)))
        nodes.append(
            _node(
                f"n{i}",
                [draw(t) for _ in range(n_layers)],
                [draw(t) for _ in range(n_layers)],
                memory=memory,
                latency_s=draw(st.floats(0.0, 0.2)),
                bandwidth_bps=draw(st.sampled_from([math.inf, 1e6, 1e7, 1e8])),
                state_s_per_byte=draw(st.sampled_from([0.0, 1e-9, 1e-8, 1e-7])),
            )
        )
    return CostModel(layers, nodes, schedule)


PROPS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _try(method, cost):
    try:
        return method(cost)
    except InfeasibleMemoryError:
        return None


def _assert_valid_assignment(cost, plan):
    bounds = plan.bounds
    cost.check_bounds(bounds)  # must not raise
    # and explicitly: each layer once, contiguous, in node order, >= 1 layer per node
    assert len(bounds) == cost.num_nodes
    assert [s.node_index for s in plan.stages] == list(range(cost.num_nodes))
    assert [s.node for s in plan.stages] == [n.name for n in cost.nodes]
    owner = [i for i, (a, b) in enumerate(bounds) for _ in range(a, b + 1)]
    assert owner == sorted(owner)  # in node order, contiguous
    assert len(owner) == cost.num_layers  # every layer exactly once
    assert set(owner) == set(range(cost.num_nodes))  # every node >= 1 layer
    assert bounds[0][0] == 0 and bounds[-1][1] == cost.num_layers - 1


def _assert_fits(cost, plan):
    for i, (a, b) in enumerate(plan.bounds):
        assert cost.stage_memory(a, b) <= cost.capacity[i], (plan.method, i, a, b)
        assert plan.stages[i].memory_bytes == cost.stage_memory(a, b)
        assert plan.stages[i].memory_capacity_bytes == cost.capacity[i]


@PROPS
@given(instances())
def test_infeasible_exactly_when_brute_force_is(cost):
    bf = _try(brute_force, cost)
    for method in (heuristic, optimal, feasible_bounds):
        result = _try(method, cost)
        assert (result is None) == (bf is None), method.__name__
    if bf is None:
        # even can never fit where nothing fits
        assert _try(even, cost) is None


@PROPS
@given(instances())
def test_plans_are_valid_and_respect_memory(cost):
    for method in (even, heuristic, optimal, brute_force):
        plan = _try(method, cost)
        if plan is None:
            continue
        _assert_valid_assignment(cost, plan)
        _assert_fits(cost, plan)  # even too: it raises rather than overfill a node
        # stage figures and the prediction are the cost model's own
        for i, s in enumerate(plan.stages):
            assert s.compute_s == cost.stage_compute(i, s.first_layer, s.last_layer)
            assert s.transfer_s == cost.stage_transfer(i, s.first_layer, s.last_layer)
        assert plan.predicted_step_time_s == cost.step_time(plan.bounds)
    fb = _try(feasible_bounds, cost)
    if fb is not None:
        cost.check_bounds(fb)
        assert cost.fits(fb)


@PROPS
@given(instances())
def test_optimal_le_heuristic_le_even(cost):
    h = _try(heuristic, cost)
    o = _try(optimal, cost)
    e = _try(even, cost)
    if h is None:
        assert o is None and e is None
        return
    assert _le(o.predicted_step_time_s, h.predicted_step_time_s), (o.bounds, h.bounds)
    if e is not None:
        assert _le(h.predicted_step_time_s, e.predicted_step_time_s), (h.bounds, e.bounds)
        assert _le(o.predicted_step_time_s, e.predicted_step_time_s), (o.bounds, e.bounds)


# The sharpest check of the MILP, and cheap: more examples (one node: one plan only).
@settings(PROPS, max_examples=150)
@given(instances(min_nodes=2))
def test_optimal_matches_brute_force(cost):
    bf = _try(brute_force, cost)
    o = _try(optimal, cost)
    if bf is None:
        assert o is None
        return
    assert o.proven_optimal, o.note  # tiny instances: HiGHS must finish
    assert o.predicted_step_time_s == pytest.approx(bf.predicted_step_time_s, rel=REL, abs=ABS), (
        o.bounds,
        bf.bounds,
    )
    assert _le(bf.predicted_step_time_s, o.predicted_step_time_s)


@PROPS
@given(instances())
def test_lower_bound_below_every_plan(cost):
    plans = [p for p in (_try(m, cost) for m in (even, heuristic, optimal, brute_force)) if p]
    if not plans:
        return
    best = min(p.predicted_step_time_s for p in plans)
    lb = lower_bound(cost)
    assert math.isfinite(lb)
    assert _le(lb, best)
    for p in plans:
        assert p.predicted_step_time_s == cost.step_time(p.bounds)
        assert _le(p.lower_bound_s, p.predicted_step_time_s), (p.method, p.lower_bound_s)
        # the bound holds for every fitting assignment, so also for the best one found
        assert _le(p.lower_bound_s, best), (p.method, p.lower_bound_s, best)


# --------------------------------------------------------------------------------------
# infeasible instances and bad arguments
# --------------------------------------------------------------------------------------
def _uniform(n_layers, n_nodes, memories, layer_kw=None, t=0.01):
    layer_kw = layer_kw or {}
    layers = [_layer(j, **layer_kw.get(j, {"param": MIB})) for j in range(n_layers)]
    nodes = [_node(f"n{i}", [t] * n_layers, [t] * n_layers, memories[i]) for i in range(n_nodes)]
    return CostModel(layers, nodes, Schedule(batch_size=4))


def test_layer_bigger_than_every_node():
    # layer 2: 2 * 3 MIB params + 4 MIB optimizer = 10 MIB; other layers 2 * 1 MIB = 2 MIB
    cost = _uniform(4, 2, [6 * MIB, 8 * MIB], {2: {"param": 3 * MIB, "opt": 4 * MIB}})
    for method in (heuristic, optimal, brute_force, feasible_bounds):
        with pytest.raises(InfeasibleMemoryError) as info:
            method(cost)
        msg = str(info.value)
        assert "layer 2 (2:Fake)" in msg, msg
        assert "10.0 MiB" in msg and "8.0 MiB" in msg, msg  # needed, largest node available
        assert "layer 0" not in msg and "layer 1 " not in msg
    with pytest.raises(InfeasibleMemoryError, match=r"layer 2 \(2:Fake\) needs 10\.0 MiB"):
        partition(cost, "optimal")
    with pytest.raises(InfeasibleMemoryError, match=r"largest node has 8\.0 MiB"):
        partition(cost, "heuristic")
    # even puts layers 0..1 on n0 (4 MIB fits) and 2..3 on n1: 10 + 2 = 12 MIB > 8 MIB
    with pytest.raises(InfeasibleMemoryError, match=r"2\.\.3 on node 'n1': 12\.0 MiB needed"):
        even(cost)


def test_globally_infeasible():
    # 5 layers of 2 MIB each = 10 MIB; nodes have 3 + 4 = 7 MIB; every layer fits a node alone
    cost = _uniform(5, 2, [3 * MIB, 4 * MIB])
    for method in (heuristic, optimal, brute_force, feasible_bounds):
        with pytest.raises(InfeasibleMemoryError) as info:
            method(cost)
        msg = str(info.value)
        assert re.search(r"needs 10\.0 MiB .* against 7\.0 MiB available", msg), msg
        assert "n0=3.0" in msg and "n1=4.0" in msg, msg


def test_infeasible_only_because_every_node_needs_a_layer():
    # 3 layers of 2 MIB; node 0 could hold all of them (6 MIB) but node 1 has only 1 MIB
    cost = _uniform(3, 2, [6 * MIB, 1 * MIB])
    for method in (heuristic, optimal, brute_force):
        with pytest.raises(InfeasibleMemoryError, match="at least one layer"):
            method(cost)


def test_unknown_method():
    cost = _uniform(4, 2, [2**50, 2**50])
    with pytest.raises(ValueError, match="unknown allocation 'fastest'") as info:
        partition(cost, "fastest")
    assert not isinstance(info.value, InfeasibleMemoryError)
    for name in ("even", "heuristic", "optimal"):
        assert name in str(info.value)


def test_fewer_layers_than_nodes():
    cost = _uniform(2, 3, [2**50] * 3)
    for method in (even, heuristic, optimal, brute_force, feasible_bounds):
        with pytest.raises(ValueError, match=r"2 layers but the fleet has 3 nodes") as info:
            method(cost)
        assert not isinstance(info.value, InfeasibleMemoryError)
    with pytest.raises(ValueError, match="at most 2 nodes"):
        partition(cost, "heuristic")


# --------------------------------------------------------------------------------------
# hand-checked instances
# --------------------------------------------------------------------------------------
def test_slow_second_node_gets_one_layer():
    # 2 nodes, 4 identical layers, no transfers (no bytes, latency 0, bandwidth inf, no
    # state cost). Sequential, relay, M = 1. Node 0 (not last stage, recomputes fwd):
    #   per layer 2 * 0.01 + 0.02 = 0.04 s. Node 1 (last, 10x slower): 0.1 + 0.2 = 0.3 s.
    # k layers on node 0: T(k) = 0.04 k + 0.3 (4 - k)
    #   T(1) = 0.04 + 0.9 = 0.94, T(2) = 0.08 + 0.6 = 0.68, T(3) = 0.12 + 0.3 = 0.42
    layers = [_layer(j) for j in range(4)]
    nodes = [
        _node("fast", [0.01] * 4, [0.02] * 4),
        _node("slow", [0.1] * 4, [0.2] * 4),
    ]
    cost = CostModel(layers, nodes, Schedule(batch_size=8, microbatches=1))
    for method in (optimal, heuristic, brute_force):
        plan = method(cost)
        assert plan.bounds == [(0, 2), (3, 3)], method.__name__
        assert plan.predicted_step_time_s == pytest.approx(0.42)
    assert optimal(cost).proven_optimal
    assert even(cost).bounds == [(0, 1), (2, 3)]
    assert even(cost).predicted_step_time_s == pytest.approx(0.68)
    assert lower_bound(cost) <= 0.42 + 1e-9


def _boundary_instance(cut_bytes):
    """2 equal nodes, 6 equal layers, direct transport (no recompute bias), sequential.

    Compute is the same for every cut, so only the bytes crossing the cut matter:
    cutting after layer c sends act_out[c] (and receives it as act_in[c + 1]).
    """
    acts = [64.0, *cut_bytes, 4.0]  # act_in[0], act_out[0..4] = cut_bytes, act_out[5]
    layers = [_layer(j, param=MIB, act_in=acts[j], act_out=acts[j + 1]) for j in range(6)]
    nodes = [_node(f"n{i}", [0.01] * 6, [0.02] * 6, bandwidth_bps=1e6) for i in range(2)]
    return CostModel(layers, nodes, Schedule(batch_size=8, transport="direct"))


@pytest.mark.parametrize(
    ("cut_bytes", "expected"),
    [
        # cost falls as the cut moves right: 3/3 -> 4/2 -> 5/1
        ([1e5, 1e5, 1e5, 1e4, 1e2], [(0, 4), (5, 5)]),
        # the mirror: cost falls as the cut moves left: 3/3 -> 2/4 -> 1/5
        ([1e2, 1e4, 1e5, 1e5, 1e5], [(0, 0), (1, 5)]),
    ],
    ids=["moves-right", "moves-left"],
)
def test_heuristic_moves_boundary_both_ways(cut_bytes, expected):
    cost = _boundary_instance(cut_bytes)
    # both heuristic starts (speed-proportional with equal speeds, and even) are 3/3
    assert _speed_proportional(cost) == [(0, 2), (3, 5)]
    assert even(cost).bounds == [(0, 2), (3, 5)]
    assert brute_force(cost).bounds == expected
    h = heuristic(cost)
    assert h.bounds == expected
    assert h.predicted_step_time_s == pytest.approx(brute_force(cost).predicted_step_time_s)
    assert h.predicted_step_time_s < even(cost).predicted_step_time_s
    assert optimal(cost).bounds == expected


def test_heuristic_respects_memory_over_speed():
    # node 0 is 10x faster but can hold only one 2 MIB layer: heuristic must not overfill it
    layers = [_layer(j, param=MIB) for j in range(4)]
    nodes = [
        _node("fast", [0.001] * 4, [0.002] * 4, memory=int(2.5 * MIB)),
        _node("slow", [0.01] * 4, [0.02] * 4),
    ]
    cost = CostModel(layers, nodes, Schedule(batch_size=4))
    for method in (heuristic, optimal, brute_force):
        assert method(cost).bounds == [(0, 0), (1, 3)], method.__name__
