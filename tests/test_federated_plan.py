"""Joint planner (issue 13): one pipeline per data owner, helpers shared, FedAvg floor."""

from __future__ import annotations

import itertools
import math

import pytest

from sky_flower.core.cost import Schedule
from sky_flower.core.federated import (
    FederatedPlan,
    InfeasibleMemoryError,
    plan_federation,
    steps_in_round,
)
from sky_flower.core.profile import NodeProfile
from tests.factories import fake_layer

MiB = 1024 * 1024
SEQ = Schedule(batch_size=8, microbatches=1, kind="sequential", transport="direct")


def layers_of(n: int, param: int = MiB) -> list:
    return [fake_layer(j, param=param, act_out=1024.0) for j in range(n)]


def node(name: str, speed: float, L: int, mem: int = 64 * MiB, owner: bool = False) -> NodeProfile:
    """A node taking ``1 / speed`` seconds forward and twice that backward per layer."""
    return NodeProfile(
        name=name,
        layer_fwd_s=(1.0 / speed,) * L,
        layer_bwd_s=(2.0 / speed,) * L,
        memory_bytes=mem,
        bandwidth_bps=1e9,
        latency_s=1e-3,
        holds_data=owner,
    )


def check_plan(fp: FederatedPlan, owners: list[str]) -> None:
    """Structural invariants every plan keeps."""
    assert sorted(p.owner for p in fp.pipelines) == sorted(owners)
    for i, p in enumerate(fp.pipelines):
        assert p.plan.stages[0].node == p.owner
        assert p.time_s == pytest.approx(p.steps * p.plan.predicted_step_time_s)
        assert all(j < i for j in p.after)
        for j in p.after:
            assert fp.pipelines[j].end_s <= p.start_s + 1e-9
    for i, j in itertools.combinations(range(len(fp.pipelines)), 2):
        a, b = fp.pipelines[i], fp.pipelines[j]
        if set(a.nodes) & set(b.nodes):
            assert i in b.after, "pipelines sharing a node must be ordered"
    assert fp.round_time_s == pytest.approx(max(p.end_s for p in fp.pipelines))
    assert fp.lower_bound_s <= fp.round_time_s * (1 + 1e-9)


def test_steps_in_round_rule() -> None:
    assert steps_in_round(5, 1.0, 10, 8) == 5
    assert steps_in_round(0, 2.0, 100, 8) == 24  # 2 x (100 // 8)
    with pytest.raises(ValueError, match="fewer than one batch"):
        steps_in_round(0, 1.0, 3, 8)


def test_even_deals_helpers_round_robin_by_samples() -> None:
    L = 6
    nodes = [
        node("a", 1.0, L, owner=True),
        node("b", 1.0, L, owner=True),
        node("h0", 2.0, L),
        node("h1", 2.0, L),
        node("h2", 2.0, L),
    ]
    fp = plan_federation(layers_of(L), nodes, {"a": 16, "b": 64}, SEQ, "even")
    check_plan(fp, ["a", "b"])
    by = {p.owner: p for p in fp.pipelines}
    # b has the most samples: ranked first, so it takes helpers 0 and 2, a takes 1
    assert by["b"].nodes == ("b", "h0", "h2")
    assert by["a"].nodes == ("a", "h1")
    assert [s.num_layers for s in by["b"].plan.stages] == [2, 2, 2]
    assert by["b"].steps == 8 and by["a"].steps == 2
    assert all(p.start_s == 0.0 and not p.after for p in fp.pipelines)
    assert "b" in fp.table() and "h0[2-3]" in fp.table()


def test_even_shares_helpers_when_owners_outnumber_them() -> None:
    L = 4
    nodes = [node(f"o{i}", 1.0, L, owner=True) for i in range(3)] + [node("h", 4.0, L)]
    fp = plan_federation(layers_of(L), nodes, {"o0": 8, "o1": 24, "o2": 16}, SEQ, "even")
    check_plan(fp, ["o0", "o1", "o2"])
    assert [p.owner for p in fp.pipelines] == ["o1", "o2", "o0"]  # most samples first
    assert [p.after for p in fp.pipelines] == [(), (0,), (0, 1)]
    assert fp.round_time_s == pytest.approx(sum(p.time_s for p in fp.pipelines))


def test_errors_name_the_owner() -> None:
    L = 4
    nodes = [node("a", 1.0, L, owner=True), node("h", 1.0, L)]
    with pytest.raises(ValueError, match="no data owners"):
        plan_federation(layers_of(L), [node("h", 1.0, L)], {}, SEQ, "even")
    with pytest.raises(ValueError, match="'a'"):
        plan_federation(layers_of(L), nodes, {}, SEQ, "even")
    with pytest.raises(ValueError, match="unknown method"):
        plan_federation(layers_of(L), nodes, {"a": 8}, SEQ, "best")
    tiny = [node("a", 1.0, L, mem=3 * MiB, owner=True), node("h", 1.0, L, mem=3 * MiB)]
    for method in ("even", "heuristic", "optimal"):
        with pytest.raises(InfeasibleMemoryError, match="'a'"):
            plan_federation(layers_of(L), tiny, {"a": 8}, SEQ, method)
    assert math.isfinite(plan_federation(layers_of(L), nodes, {"a": 8}, SEQ).round_time_s)
