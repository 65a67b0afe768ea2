"""Interleaved 1F1B and zero bubble: torch's op order, the chunk simulator, the planner's pick."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.core.schedule import choose_schedule, orders_for, predict
from sky_flower.core.simulate import simulate
from sky_flower.core.virtual import (
    VIRTUAL_KINDS,
    check_virtual,
    rank_orders,
    simulate_chunks,
    split_chunks,
)

TIME = st.floats(min_value=0.0, max_value=10.0)


def torch_orders(kind, S, v, M):
    """torch 2.13's own per-rank compute order (its ``pipeline_order`` without idle
    slots), computed by the schedule class's own methods without a process group."""
    from torch.distributed.pipelining import schedules as ts

    cls = ts.ScheduleInterleaved1F1B if kind == "interleaved" else ts.ScheduleInterleavedZeroBubble
    sched = cls.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = S, v, M
    sched.number_of_rounds = max(1, M // S)
    sched.microbatches_per_round = M // sched.number_of_rounds
    sched.pipeline_order = {r: sched._calculate_single_rank_operations(r) for r in range(S)}
    if kind == "zero_bubble":
        sched.pipeline_order = sched._add_bubbles_to_actions(S * v)
    name = {"F": "F", "B": "B", "I": "I", "W": "W"}
    out = []
    for r in range(S):
        ops = []
        for a in sched.pipeline_order[r]:
            if a is None:
                continue
            code = str(a.computation_type.value)
            ops.append((name[code], a.stage_index, a.microbatch_index))
        out.append(ops)
    return out


@pytest.mark.parametrize("kind", VIRTUAL_KINDS)
def test_orders_equal_torchs_pipeline_order(kind):
    checked = 0
    for S in range(1, 6):
        for v in (1, 2, 3):
            for M in range(1, 13):
                try:
                    check_virtual(kind, S, v, M)
                except ValueError:
                    continue
                assert rank_orders(kind, S, v, M) == torch_orders(kind, S, v, M), (S, v, M)
                checked += 1
    assert checked > 100


@given(
    st.integers(1, 5),
    st.integers(1, 7),
    st.sampled_from(["sequential", "gpipe", "1f1b"]),
    st.data(),
)
@settings(max_examples=examples(60), deadline=None)
def test_chunk_simulator_equals_stage_simulator(S, M, kind, data):
    f = data.draw(st.lists(TIME, min_size=S, max_size=S))
    b = data.draw(st.lists(TIME, min_size=S, max_size=S))
    fl = data.draw(st.lists(TIME, min_size=S - 1, max_size=S - 1))
    bl = data.draw(st.lists(TIME, min_size=S - 1, max_size=S - 1))
    ref = simulate(f, b, fl, bl, M, kind)
    got = simulate_chunks(orders_for(kind, S, 1, M), f, b, fl, bl, M)
    assert math.isclose(got.step_time_s, ref.step_time_s, rel_tol=1e-9, abs_tol=1e-9)
    assert got.peak_stash == ref.peak_inflight
    for name, busy in ref.busy_s.items():
        assert math.isclose(got.busy_s.get(name, 0.0), busy, rel_tol=1e-9, abs_tol=1e-9)


@given(st.integers(1, 5), st.sampled_from([1, 2, 3]), st.integers(1, 12), st.data())
@settings(max_examples=examples(60), deadline=None)
def test_virtual_timeline_is_consistent(S, v, M, data):
    kind = data.draw(st.sampled_from(VIRTUAL_KINDS))
    try:
        orders = rank_orders(kind, S, v, M)
    except ValueError:
        return
    C = S * v
    f = data.draw(st.lists(TIME, min_size=C, max_size=C))
    b = data.draw(st.lists(TIME, min_size=C, max_size=C))
    ln = data.draw(st.lists(TIME, min_size=C - 1, max_size=C - 1))
    res = simulate_chunks(orders, f, b, ln, ln, M)
    eps = 1e-9
    end = {(o[1], o[2], o[3]): o[5] for o in res.ops if o[0].startswith("stage")}
    start = {(o[1], o[2], o[3]): o[4] for o in res.ops if o[0].startswith("stage")}
    assert len(end) == sum(len(o) for o in orders)  # every op ran once
    bwd = "I" if kind == "zero_bubble" else "B"
    for c in range(C):
        for m in range(M):
            assert start[(bwd, c, m)] >= end[("F", c, m)] - eps
            if c > 0:
                assert start[("F", c, m)] >= end[("F", c - 1, m)] - eps
                assert start[(bwd, c - 1, m)] >= end[(bwd, c, m)] - eps
            if kind == "zero_bubble":
                assert start[("W", c, m)] >= end[("I", c, m)] - eps
    # one op at a time per resource
    by_res: dict = {}
    for o in res.ops:
        by_res.setdefault(o[0], []).append((o[4], o[5]))
    for spans in by_res.values():
        spans.sort()
        assert all(a[1] <= b_[0] + eps for a, b_ in zip(spans, spans[1:], strict=False))
    work = M * (sum(f) + sum(b))
    assert res.step_time_s >= work / S - eps  # no rank does more than its share at once


@pytest.mark.parametrize("S,v,M", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 6)])
def test_interleaving_shrinks_the_bubble(S, v, M):
    # uniform chunks, no links: 1F1B's bubble (S-1)(f+b), interleaved's (S-1)(f+b)/v
    f, b = 1.0, 2.0
    C = S * v
    base = simulate([f] * S, [b] * S, [0.0] * (S - 1), [0.0] * (S - 1), M, "1f1b").step_time_s
    inter = simulate_chunks(
        rank_orders("interleaved", S, v, M),
        [f / v] * C,
        [b / v] * C,
        [0.0] * (C - 1),
        [0.0] * (C - 1),
        M,
    ).step_time_s
    zb = simulate_chunks(
        rank_orders("zero_bubble", S, v, M),
        [f / v] * C,
        [b / v] * C,
        [0.0] * (C - 1),
        [0.0] * (C - 1),
        M,
    ).step_time_s
    assert base == pytest.approx((M + S - 1) * (f + b))
    assert inter == pytest.approx(M * (f + b) + (S - 1) * (f + b) / v)
    assert zb < inter


def test_split_chunks():
    stages = [(0, 0, 3), (2, 4, 5), (1, 6, 7)]  # 8 layers, shares 4:2:2
    parts = split_chunks(stages, 2)
    assert [p[0] for p in parts] == [0, 2, 1, 0, 2, 1]
    assert parts[0][1] == 0 and parts[-1][2] == 7
    assert all(parts[i][2] + 1 == parts[i + 1][1] for i in range(5))
    assert [p[2] - p[1] + 1 for p in parts] == [2, 1, 1, 2, 1, 1]
    assert split_chunks(stages, 1) == stages
    with pytest.raises(ValueError, match="need at least 9 layers"):
        split_chunks(stages, 3)


def test_check_virtual_refuses_what_torch_refuses():
    with pytest.raises(ValueError, match="multiple of max"):
        check_virtual("interleaved", 4, 2, 9)
    with pytest.raises(ValueError, match="unknown schedule kind"):
        check_virtual("zbv", 4, 2, 8)


def _cost(M=8, S=4, L=8, slow=(1.0, 1.0, 1.0, 1.0), bw=1e9):
    layers = [LayerProfile(j, f"l{j}", 1.0, 2.0, 1000, 2000, 64, 64, 64) for j in range(L)]
    nodes = [
        NodeProfile(
            f"n{i}",
            (0.01 * slow[i],) * L,
            (0.02 * slow[i],) * L,
            10**12,
            latency_s=0.001,
            bandwidth_bps=bw,
            holds_data=i == 0,
        )
        for i in range(S)
    ]
    return CostModel(layers, nodes, Schedule(64, M, "1f1b", "direct"))


def test_predict_and_choose_schedule():
    cost = _cost()
    stages = [(0, 0, 1), (1, 2, 3), (2, 4, 5), (3, 6, 7)]
    one = predict(cost, stages, "1f1b")
    assert one.step_time_s == pytest.approx(cost.step_time(stages))  # the cost model's 1F1B
    gp = predict(cost, stages, "gpipe")
    assert gp.step_time_s == pytest.approx(
        CostModel(cost.layers, cost.nodes, replace(cost.schedule, kind="gpipe")).step_time(stages)
    )
    assert gp.memory_bytes[0] > one.memory_bytes[0]  # GPipe stashes all M
    best, table = choose_schedule(cost, stages, chunks=2)
    assert set(table) == {"gpipe", "1f1b", "interleaved", "zero_bubble"}
    assert best.kind == min(table, key=lambda k: table[k])
    assert best.kind in VIRTUAL_KINDS and best.bubble_share < one.bubble_share
    # with slow links interleaving's extra hops (and the wrap-around link) cost more
    slow_links = _cost(bw=2e3)
    best_slow, table_slow = choose_schedule(slow_links, stages, chunks=2)
    assert table_slow["interleaved"] > table_slow["1f1b"]
    assert best_slow.kind in ("1f1b", "gpipe", "zero_bubble")
    # too few layers for 4 chunks per rank: the virtual kinds drop out
    _, few = choose_schedule(cost, stages, chunks=4)
    assert few["interleaved"] is None and few["zero_bubble"] is None


def test_planner_picks_and_records_the_schedule():
    # schedule.kind=auto: the partitioners search with GPipe, then every direct kind is
    # predicted for the plan and the fastest recorded in plan.schedule
    from sky_flower.core.partition import partition
    from sky_flower.sky.planning.planning import chosen_schedule

    cost = _cost()
    auto = CostModel(cost.layers, cost.nodes, replace(cost.schedule, kind="auto"))
    plan = partition(CostModel(cost.layers, cost.nodes, auto.schedule.for_search()), "even")
    got, got_cost = chosen_schedule(plan, auto)
    table = got.schedule["predicted_step_by_kind_s"]
    kind = got.schedule["kind"]
    assert kind == min((k for k in table if table[k] is not None), key=table.get)
    assert got.predicted_step_time_s == pytest.approx(table[kind])
    assert got_cost.schedule.kind == kind and got.schedule["chunks"] == 2
    assert got_cost.step_time(plan.spec) == pytest.approx(got.predicted_step_time_s)
    assert len(got.schedule["chunk_layers"]) == 8
    # each stage's compute is its rank's chunks' (uniform nodes here: 1/4 of the model)
    total = cost.stage_fwd(0, 0, 7) + cost.stage_bwd(0, 0, 7, True)
    assert [st.compute_s for st in got.stages] == pytest.approx([total / 4] * 4)
    with pytest.raises(ValueError, match="transport=direct only"):
        Schedule(64, 8, "interleaved", "relay")
    # partition() itself searches a chunked kind with its search kind
    inter = CostModel(cost.layers, cost.nodes, replace(cost.schedule, kind="interleaved"))
    search = CostModel(cost.layers, cost.nodes, inter.schedule.for_search())
    assert search.schedule.kind == "1f1b"
    got = partition(inter, "optimal", time_limit_s=5.0)
    assert got.spec == partition(search, "optimal", time_limit_s=5.0).spec


def test_the_round_log_names_the_schedule_auto_picked_per_pipeline():
    from types import SimpleNamespace as NS

    from sky_flower.core.cost import Schedule
    from sky_flower.sky.transport.direct import kinds_label

    def run(kind: str | None) -> NS:
        return NS(pipeline=NS(plan=NS(schedule={} if kind is None else {"kind": kind})))

    auto = Schedule(batch_size=32, microbatches=4, kind="auto", transport="direct")
    direct = NS(label="direct")
    assert kinds_label(direct, [run("1f1b")], auto) == "direct, 1f1b"
    assert (
        kinds_label(direct, [run("interleaved"), run("gpipe")], auto) == "direct, gpipe/interleaved"
    )
    gpipe = Schedule(batch_size=32, microbatches=4, kind="gpipe", transport="direct")
    assert kinds_label(direct, [run(None)], gpipe) == "direct, gpipe"
