"""``optimal`` with a link per pair of nodes (issue 15): the chain DP against brute force,
the GPipe step proven, the heuristic on small unequal fleets."""

import math

import numpy as np
import pytest
from factories import fake_layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers import ALL, examples

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.partition import MIB, InfeasibleMemoryError, brute_force, heuristic, optimal
from sky_flower.core.partition.chain import _chain_case
from sky_flower.core.profile import NodeProfile

FIXED = settings(
    max_examples=examples(120),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TIMES = st.floats(1e-3, 1e-1, allow_nan=False)
MODELLED = [
    ("sequential", "relay", 1),
    ("sequential", "direct", 2),
    ("gpipe", "direct", 1),
    ("gpipe", "direct", 2),
    ("gpipe", "direct", 4),
    ("1f1b", "direct", 1),
]


@st.composite
def per_pair_instances(draw):
    """Unequal nodes, each its own latency and bandwidth, memory binding or not, and a
    schedule the chain DP models exactly."""
    n = draw(st.integers(2, 4))
    L = draw(st.integers(2, 6))
    kind, transport, M = draw(st.sampled_from(MODELLED))
    layers = [
        fake_layer(
            j,
            param=draw(st.integers(0, 3)) * MIB,
            act_out=float(draw(st.sampled_from([1e3, 1e5, 1e6]))),
        )
        for j in range(L)
    ]
    nodes = [
        NodeProfile(
            name=f"n{i}",
            layer_fwd_s=tuple(draw(TIMES) for _ in range(L)),
            layer_bwd_s=tuple(draw(TIMES) for _ in range(L)),
            memory_bytes=draw(st.sampled_from([2**40, 4 * MIB, 8 * MIB, 12 * MIB])),
            latency_s=draw(st.floats(0.0, 0.05)),
            bandwidth_bps=draw(st.sampled_from([1e6, 1e7, 1e8, math.inf])),
            state_s_per_byte=draw(st.sampled_from([0.0, 1e-9])),
            holds_data=i == 0,
        )
        for i in range(n)
    ]
    return CostModel(layers, nodes, Schedule(4 * M, M, kind, transport))


@FIXED
@given(per_pair_instances(), st.sampled_from(["step", "throughput"]))
def test_chain_dp_matches_brute_force(cost, objective):
    try:
        bf = brute_force(cost, objective=objective)
    except InfeasibleMemoryError:
        with pytest.raises(InfeasibleMemoryError):
            optimal(cost, objective=objective, solver="chain")
        return
    o = optimal(cost, objective=objective, solver="chain")
    assert _chain_case(cost, objective) is not None
    assert o.proven_optimal and "(nodes in use, last node's link, layer)" in o.note, o.note
    assert o.objective_value_s == pytest.approx(bf.objective_value_s, rel=1e-9, abs=1e-12)
    assert cost.fits(o.spec)
    cost.check_stages(o.spec)


def _per_pair_fleet(seed, n=8, L=12, memory_binds=True):
    rng = np.random.default_rng(seed)
    layers = [
        fake_layer(j, param=int(rng.integers(1, 4)) * MIB, act_out=float(rng.choice([1e4, 1e5])))
        for j in range(L)
    ]
    need = sum(2 * lp.param_bytes for lp in layers)
    nodes = [
        NodeProfile(
            name=f"n{i}",
            layer_fwd_s=tuple(float(v) for v in rng.uniform(0.01, 0.03, L) * (1 + i % 4)),
            layer_bwd_s=tuple(float(v) for v in rng.uniform(0.02, 0.06, L) * (1 + i % 4)),
            memory_bytes=int(need * rng.uniform(0.2, 0.6)) if memory_binds else 2**40,
            latency_s=float(rng.uniform(0.0, 0.01)),
            bandwidth_bps=float(rng.choice([2e6, 1e7, 1e8])),
            holds_data=i == 0,
        )
        for i in range(n)
    ]
    return CostModel(layers, nodes, Schedule(8, 4, "gpipe", "direct"))


@pytest.mark.parametrize("objective", ["throughput", "step"])
def test_eight_node_per_pair_fleet_is_proven(objective):
    # the issue: "optimal is never proven when links differ between nodes"
    cost = _per_pair_fleet(3)
    assert len(set(cost.latency.tolist())) > 1
    o = optimal(cost, objective=objective, time_limit_s=60)
    assert o.proven_optimal, o.note
    assert o.lower_bound_s == pytest.approx(o.objective_value_s)
    h = heuristic(cost, objective=objective)
    assert o.objective_value_s <= h.objective_value_s * (1 + 1e-9)


def test_heuristic_within_five_percent_on_small_unequal_fleets():
    rng = np.random.default_rng(15)
    ratios = []
    for _ in range(40 if ALL else 12):  # make test: the first 12 of make test-all's 40
        L, N = int(rng.integers(5, 10)), int(rng.integers(2, 5))
        layers = [fake_layer(j, param=int(rng.integers(0, 3)) * MIB) for j in range(L)]
        nodes = [
            NodeProfile(
                name=f"n{i}",
                layer_fwd_s=tuple(float(v) for v in rng.uniform(1e-3, 1e-1, L)),
                layer_bwd_s=tuple(float(v) for v in rng.uniform(1e-3, 1e-1, L)),
                memory_bytes=int(rng.integers(4, 16)) * MIB,
                latency_s=float(rng.uniform(0, 0.02)),
                bandwidth_bps=float(rng.choice([1e6, 1e7])),
                holds_data=i == 0,
            )
            for i in range(N)
        ]
        cost = CostModel(layers, nodes, Schedule(8, 2, "gpipe", "direct"))
        try:
            bf = brute_force(cost, objective="step")
        except InfeasibleMemoryError:
            continue
        ratios.append(heuristic(cost).predicted_step_time_s / bf.predicted_step_time_s)
    assert ratios and max(ratios) <= 1.05


@pytest.mark.parametrize("objective", ["throughput", "step"])
def test_chain_dp_stopped_by_the_time_limit_says_not_proven(objective):
    cost = _per_pair_fleet(3)
    o = optimal(cost, objective=objective, time_limit_s=1e-6)
    assert not o.proven_optimal
    assert "time limit" in o.note and "not proven" in o.note, o.note
    assert cost.fits(o.spec)
    assert o.lower_bound_s <= o.objective_value_s
