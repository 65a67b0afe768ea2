"""What a ``stream`` stage session costs, measured and charged: the benchmark round
times each node's Flower set-up (one ``query.sky_echo`` of the model's weight bytes,
:attr:`NodeProfile.setup_s`), the planner predicts a session's set-up as its slowest
stage's (:meth:`CostModel.session_setup_s`, ``Pipeline.setup_s``), and a round's
predicted time carries it only in the round that sets a session up.

Real parts: Sky's ClientApp handlers on threads of this process (``test_stream``'s
``ThreadedGrid``; ``ConcurrentGrid`` without processes for the whole strategy), a real
gRPC endpoint and real TLS on 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import pytest
from flwr.app import ArrayRecord
from test_exact_state import BATCH, stateful_net
from test_stream import ThreadedGrid, _app, _stream_threads

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.profile import LayerProfile, NodeProfile, profile_layers
from sky_flower.flower.exchange import Exchange
from sky_flower.sky.planning import planning
from sky_flower.sky.planning.benchmark import BenchmarkRound, LinkTiming, benchmark_table
from sky_flower.sky.rounds.federation import PipelineResult, predicted_setups, round_row
from sky_flower.sky.rounds.report import session_line
from sky_flower.sky.settings import BenchmarkSettings
from sky_flower.sky.transport.runner import RoundOutcome, SkyNodeError

QUICK_BENCH = BenchmarkSettings(
    warmup=0, repeats=1, echo_bytes=(1024, 1 << 16), echo_repeats=1, echo_jitter_s=0.0
)


def test_the_benchmark_round_measures_each_nodes_flower_setup_on_stream(server_identity):
    """On ``stream`` every node's profile carries its Flower set-up (> 0, finite: its
    stream probe's message, pushed until the node joined; logged under the benchmark
    table); on the relay none is measured (0)."""
    names = ["n0", "n1", "n2"]
    configs = {n: {"sky-node": n, "partition-id": k} for k, n in enumerate(names)}
    schedule = Schedule(batch_size=BATCH, microbatches=2, kind="gpipe", transport="stream")
    layers = profile_layers(stateful_net(), (8,), schedule.microbatch_size)
    grid = ThreadedGrid({n: _app() for n in names}, configs)
    ids: dict[int, str] = {}
    ex = Exchange(grid, 30.0, describe=ids.get, error_cls=SkyNodeError)
    bench = BenchmarkRound(
        ex, layers, schedule, (8,), "adam", 1e-2, QUICK_BENCH, ids, links=LinkTiming(stream={})
    )
    found = bench.run(grid.ids, names)
    grid.join()
    assert [n.name for n in found.nodes] == names
    for node in found.nodes:
        assert 0 < node.setup_s < 30 and math.isfinite(node.setup_s), node
        assert node.to_dict()["setup_s"] == node.setup_s  # benchmark.json
    table = benchmark_table(found.nodes).splitlines()
    head = table.index("Flower set-up (stream sessions: a message pushed until its stage joined):")
    assert [line.split()[0] for line in table[head + 1 :]] == names
    assert all(line.endswith((" s", " ms")) for line in table[head + 1 :])
    assert not _stream_threads()

    relay = BenchmarkRound(
        Exchange(grid, 30.0, describe=ids.get, error_cls=SkyNodeError),
        layers,
        Schedule(batch_size=BATCH, microbatches=2, kind="gpipe"),
        (8,),
        "adam",
        1e-2,
        dataclasses.replace(QUICK_BENCH, state_probe_mb=0.0),
        ids,
    ).run(grid.ids[:1], names)
    grid.join()
    assert [n.setup_s for n in relay.nodes] == [0.0]
    assert "Flower set-up" not in benchmark_table(relay.nodes)


# -- the prediction ------------------------------------------------------------------------
def _layers() -> list[LayerProfile]:
    """Four layers of 1, 2, 4 and 8 MB of weights (the third frozen: its bytes travel
    in the set-up too)."""
    sizes = [(1_000_000, 0), (2_000_000, 0), (0, 4_000_000), (8_000_000, 0)]
    return [
        LayerProfile(j, f"{j}:Linear", 1e6, 2e6, p, 2 * p, 100.0, 100.0, frozen_bytes=f)
        for j, (p, f) in enumerate(sizes)
    ]


def _nodes(setups: tuple[float, ...], bandwidths: tuple[float, ...]) -> list[NodeProfile]:
    return [
        NodeProfile(
            name=f"n{i}",
            layer_fwd_s=(0.01,) * 4,
            layer_bwd_s=(0.02,) * 4,
            memory_bytes=2**34,
            latency_s=0.001,
            bandwidth_bps=bw,
            holds_data=i == 0,
            node_id=101 + i,
            setup_s=s,
        )
        for i, (s, bw) in enumerate(zip(setups, bandwidths, strict=True))
    ]


@pytest.mark.parametrize("transport", ["stream", "relay"])
def test_a_pipelines_setup_is_its_slowest_stages_flower_round_trip_plus_its_weights(transport):
    """``Pipeline.setup_s = max_k (setup_i + W_k / bw_i)`` over the plan's stages on
    ``stream`` (``inf`` bandwidth: no byte term), 0 on the relay; plan.json's pipeline
    rows and the plan log carry it."""
    layers = _layers()
    nodes = _nodes((2.0, 3.0, 0.5), (10e6, 1e6, math.inf))
    sched = Schedule(batch_size=8, microbatches=2, kind="gpipe", transport=transport)
    fed = planning.make_federated_plan(
        layers, nodes, {"n0": 64}, sched, "even", steps_per_round=2, alternatives=False
    )
    (planned,) = fed.planned
    (run,) = planning.pipeline_runs(fed, nodes, {n.name: n.node_id for n in nodes})
    if transport == "relay":
        assert run.pipeline.setup_s == 0.0
        assert fed.to_dict()["pipelines"][0]["predicted_setup_s"] == 0
        assert planning.setup_lines(fed.fplan, fed.planned) == []
        return
    by_name = {n.name: n for n in nodes}
    expected = max(
        by_name[st.node].setup_s
        + sum(lp.weight_bytes for lp in layers[st.first_layer : st.last_layer + 1])
        / by_name[st.node].bandwidth_bps
        for st in planned.plan.stages
    )
    # even over 3 nodes: n0 [0-1] 2 + 3 MB / 10 MB/s, n1 [2] 3 + 4 MB / 1 MB/s, n2 [3] 0.5
    assert [(s.first_layer, s.last_layer) for s in planned.plan.stages] == [(0, 1), (2, 2), (3, 3)]
    assert expected == pytest.approx(7.0)
    assert run.pipeline.setup_s == pytest.approx(expected)
    assert fed.to_dict()["pipelines"][0]["predicted_setup_s"] == pytest.approx(expected)
    lines = planning.setup_lines(fed.fplan, fed.planned)
    assert lines[1].split() == ["n0", "7.000", "s"]
    # a node without a measured set-up: nothing predicted (not a partial figure)
    unmeasured = _nodes((2.0, 0.0, 0.5), (10e6, 1e6, math.inf))
    assert CostModel(layers, unmeasured, sched).session_setup_s([(0, 1), (2, 2), (3, 3)]) == 0.0
    with pytest.raises(ValueError, match="setup_s must be a finite"):
        CostModel(layers, _nodes((math.nan, 1.0, 1.0), (1e6,) * 3), sched)


# -- charged once per session --------------------------------------------------------------
def _result(run: planning.PipelineRun, predicted_setup_s: float) -> PipelineResult:
    out = RoundOutcome(
        arrays=ArrayRecord(),
        losses=[1.0],
        correct=1,
        seen=2,
        step_times=[0.1],
        stages=[],
        extra={"setup_s": 2.0 * (predicted_setup_s > 0), "predicted_setup_s": predicted_setup_s},
    )
    return PipelineResult(run=run, outcome=out, wall_s=1.0)


def test_a_rounds_predicted_time_carries_the_setup_only_where_a_session_opened():
    """Pipeline 1 waits for pipeline 0 (they share a node): a session set up by 0
    moves 1's predicted start and the round's end; a round without a set-up is the
    plan's round as it was."""

    def run(start: float, time_s: float, after: tuple[int, ...]) -> planning.PipelineRun:
        return planning.PipelineRun("o", 2, 1, None, after, start, time_s)  # type: ignore[arg-type]

    runs = [run(0.0, 4.0, ()), run(4.0, 3.0, (0,))]
    steady = [_result(runs[0], 0.0), _result(runs[1], 0.0)]
    assert predicted_setups(steady) == [(0.0, 0.0), (0.0, 0.0)]
    opened = [_result(runs[0], 5.0), _result(runs[1], 0.0)]
    assert predicted_setups(opened) == [(0.0, 5.0), (5.0, 0.0)]
    both = [_result(runs[0], 5.0), _result(runs[1], 2.0)]
    assert predicted_setups(both) == [(0.0, 5.0), (5.0, 2.0)]


def test_round_rows_and_their_session_line():
    """``round_row``'s ``predicted_round_time_s``: the plan's round plus the set-up in
    the round that opened a session, the plan's round alone after it; the session line
    sets measured against predicted set-up and round."""
    from types import SimpleNamespace

    def run(start: float, time_s: float, after: tuple[int, ...]) -> planning.PipelineRun:
        pipe = SimpleNamespace(
            plan=SimpleNamespace(stages=[SimpleNamespace(node="o")], predicted_step_time_s=0.1)
        )
        return planning.PipelineRun("o", 2, 1, pipe, after, start, time_s)  # type: ignore[arg-type]

    runs = [run(0.0, 4.0, ()), run(4.0, 3.0, (0,))]
    first = round_row(1, [_result(runs[0], 5.0), _result(runs[1], 0.0)], 13.0)
    assert first.predicted_round_time_s == pytest.approx(12.0)  # 4 + 3 + 5
    assert [p.predicted_start_s for p in first.pipelines] == [0.0, 9.0]
    assert [p.predicted_time_s for p in first.pipelines] == [9.0, 3.0]
    later = round_row(2, [_result(runs[0], 0.0), _result(runs[1], 0.0)], 7.5)
    assert later.predicted_round_time_s == pytest.approx(7.0)
    first.session_round, first.flower_messages = 1, 6
    later.session_round, later.flower_messages = 2, 0
    assert session_line(first) == (
        "session: round 1 of the session, 6 Flower messages; set-up measured 2.000 s "
        "(predicted 5.000 s); round measured 13.000 s (predicted 12.000 s)"
    )
    assert session_line(later) == (
        "session: round 2 of the session, 0 Flower messages; round measured 7.500 s "
        "(predicted 7.000 s)"
    )
    later.session_round = None
    assert session_line(later) is None  # no session: no line


# -- the whole strategy ------------------------------------------------------------------
def test_a_stream_run_measures_predicts_and_reports_its_session(server_identity, caplog):
    """The sky-app through Sky's strategy on ``stream`` (each node's messages on its own
    thread of this process): every node's set-up measured, the plan's pipeline
    predicting it, round 1 (the session's set-up) charged it, round 2 not, and both
    logged with the session line."""
    from reference import ConcurrentGrid, sky_app_on_grid

    run = {
        "fleet": "uniform3",
        "allocation": "even",  # a pipeline of 3 stages: 3 set-up messages
        "num-server-rounds": 2,
        "steps-per-round": 2,
        "transport": "stream",
        "schedule-kind": "gpipe",
        "microbatches": 2,
        "benchmark-repeats": 1,
        "echo-repeats": 1,
        "state-probe-mb": 0.0,
        "stream-timeout-s": 20.0,
    }
    grid_cls = functools.partial(ConcurrentGrid, processes=False)
    strategy, grid, start = sky_app_on_grid(grid_cls, run)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO)
    try:
        strategy.start(**start)
    finally:
        grid.close()
    st = strategy.state
    assert all(0 < n.setup_s < 60 for n in st.node_profiles), st.node_profiles
    (pipe_run,) = st.runs
    assert pipe_run.pipeline.num_stages == 3
    setup = pipe_run.pipeline.setup_s
    assert setup > 0
    first, second = st.rounds
    assert first.session_round == 1 and first.predicted_setup_s == pytest.approx(setup)
    assert first.setup_s > 0
    plain = pipe_run.start_s + pipe_run.time_s
    assert first.predicted_round_time_s == pytest.approx(plain + setup)
    assert second.session_round == 2 and second.predicted_setup_s == 0
    assert second.predicted_round_time_s == pytest.approx(plain)
    assert "Round 1: session: round 1 of the session, 3 Flower messages; set-up measured" in (
        caplog.text
    )
    assert "Round 2: session: round 2 of the session, 0 Flower messages; round measured" in (
        caplog.text
    )
    assert "predicted stage-session set-up (stream" in caplog.text
    assert not _stream_threads()
