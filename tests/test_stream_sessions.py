"""Stage sessions on ``stream`` (:mod:`sky_flower.sky.transport.session`): one Flower
message per stage for many rounds, every round driven over the session's stream.

Real parts: Sky's ClientApp handlers on their own threads (``test_stream``'s
``ThreadedGrid``: a stage session blocks its handler for the whole session, as a
SuperNode's ClientApp process does), a real gRPC endpoint and real TLS on 127.0.0.1.
The session must compute exactly what per-round set-up messages compute: the same ops
in the same order on the same weights, so the comparison is bit for bit
(``torch.equal``); against the unsplit reference (``reference_rounds``) it is
``test_exact_state``'s tolerance (the reference orders floating-point sums differently).
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from factories import runner_settings
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from reference import reference_rounds
from test_exact_state import (
    BATCH,
    BOUNDS,
    DATA,
    LR,
    SEED,
    STEPS,
    _assert_same,
    _owner_data,
    _weights,
    stateful_net,
    stateful_run_settings,
)
from test_stream import ThreadedGrid, _stream_threads

from sky_flower.core.partition.plan import Plan, StagePlan
from sky_flower.emulation.devices import Emulation
from sky_flower.sky import protocol as P
from sky_flower.sky.migration import OptimizerStore
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.transport.runner import Pipeline, RunSettings, SkyNodeError
from sky_flower.sky.transport.session import SessionKey, StreamSessions, same_bits
from sky_flower.sky.transport.stream import StreamRunner

ROUNDS = 3
BOUND_S = 15.0  # a broken stream must fail its round within this (silence bound: 3 s)


class Counted(ThreadedGrid):
    """A :class:`ThreadedGrid` that counts the Flower messages pushed and replies pulled."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.pushed = 0
        self.pulled = 0

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        messages = list(messages)
        self.pushed += len(messages)
        return super().push_messages(messages)

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        got = super().pull_messages(message_ids)
        self.pulled += len(got)
        return got


def _fleet(fault: dict | None = None) -> tuple[Counted, Pipeline]:
    names = [f"n{k}" for k in range(len(BOUNDS))]

    def emulation(context) -> Emulation:  # noqa: ANN001
        name = str(context.node_config["sky-node"])
        return Emulation(name=name, **(fault or {}) if name == "n1" else {})

    apps = {
        n: SkyClient(model_fn=stateful_net, load_data=_owner_data, emulation_fn=emulation).register(
            ClientApp()
        )
        for n in names
    }
    configs = {n: {"sky-node": n, "partition-id": k} for k, n in enumerate(names)}
    grid = Counted(apps, configs)
    stages = [
        StagePlan(name, k, a, b, 0.0, 0.0, 0.0, 0.0)
        for k, (name, (a, b)) in enumerate(zip(names, BOUNDS, strict=True))
    ]
    pred = tuple({"node": n, "messages": 0, "compute_s": 0.0, "busy_s": 0.0} for n in names)
    pipeline = Pipeline(
        Plan("even", stages, 0.0, 0.0, 0.0), tuple(grid.ids), 1, pred, (0.0,) * 3, ((0, 0),) * 3
    )
    return grid, pipeline


def _settings(grid: Counted, kind: str, microbatches: int, **kw) -> RunSettings:  # noqa: ANN003
    paths = {
        "failure.message_timeout_s": 30.0,
        "stream.timeout_s": kw.pop("stream_timeout_s", 20.0),
    }
    return stateful_run_settings(kind, microbatches, paths, describe=grid.names.get, **kw)


def _rounds(kind: str, microbatches: int, sessions: bool, keep: bool = False) -> tuple:
    """``ROUNDS`` rounds of one pipeline, each from the last one's model: the models,
    and the grid's message counts."""
    grid, pipeline = _fleet()
    pool = StreamSessions(max_age_s=3600.0, close_deadline_s=20.0) if sessions else None
    store = OptimizerStore() if keep else None
    s = _settings(grid, kind, microbatches, sessions=pool, optimizer_store=store)
    arrays, models = ArrayRecord(_weights()), []
    try:
        for rnd in range(1, ROUNDS + 1):
            out = StreamRunner(s).run_round(grid, pipeline, arrays, STEPS, rnd)
            arrays = out.arrays
            models.append(arrays.to_torch_state_dict())
            assert out.extra["flower_messages"] == ((3 if rnd == 1 else 0) if sessions else 6), (
                out.extra
            )
            if sessions:
                assert out.extra["session_round"] == rnd
    finally:
        if pool is not None:
            pool.close_all()
        grid.join()
    return models, grid.pushed, grid.pulled


def _assert_bits(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert same_bits(torch.as_tensor(got[key]), torch.as_tensor(value)), key


@pytest.mark.parametrize(
    ("kind", "microbatches", "keep"),
    [
        ("gpipe", 4, False),
        ("1f1b", 4, True),
        pytest.param("sequential", 2, False, marks=pytest.mark.slow),
    ],
)
def test_a_session_equals_per_round_set_ups_bit_for_bit(kind, microbatches, keep, server_identity):
    """Three rounds in one session: one set-up message per stage in all (and its reply
    at the end), the same weights, buffers (BatchNorm) and dropout masks as a set-up
    message per round, bit for bit; and unsplit training's within 1e-6."""
    per_round, pushed_r, pulled_r = _rounds(kind, microbatches, sessions=False, keep=keep)
    in_session, pushed, pulled = _rounds(kind, microbatches, sessions=True, keep=keep)
    assert (pushed_r, pulled_r) == (3 * ROUNDS, 3 * ROUNDS)
    assert (pushed, pulled) == (3, 3)  # one set-up per stage, its reply at the close
    for got, expected in zip(in_session, per_round, strict=True):
        _assert_bits(got, expected)
    reference = reference_rounds(
        stateful_net, DATA, ROUNDS, STEPS, LR, BATCH, microbatches, SEED,
        weights=_weights(), keep_optimizer=keep,
    )  # fmt: skip
    for got, (expected, _) in zip(in_session, reference, strict=True):
        _assert_same(got, expected)
    assert not _stream_threads()


def test_a_changed_plan_or_an_old_session_starts_a_fresh_one(server_identity):
    """A session older than its bound hands over at the next round's start (one more
    set-up per stage) without changing what is computed."""
    grid, pipeline = _fleet()
    pool = StreamSessions(max_age_s=1e-3, close_deadline_s=20.0)  # every round: a new one
    s = _settings(grid, "gpipe", 2, sessions=pool)
    arrays = ArrayRecord(_weights())
    try:
        for rnd in (1, 2):
            out = StreamRunner(s).run_round(grid, pipeline, arrays, STEPS, rnd)
            arrays = out.arrays
            assert out.extra["session_round"] == 1
        assert out.extra["flower_messages"] == 6  # the old one's 3 replies, 3 set-ups
    finally:
        pool.close_all()
        grid.join()
    assert pool.opened == 2 and (grid.pushed, grid.pulled) == (6, 6)
    expected = reference_rounds(
        stateful_net, DATA, 2, STEPS, LR, BATCH, 2, SEED, weights=_weights()
    )[-1][0]
    _assert_same(arrays.to_torch_state_dict(), expected)


@pytest.mark.parametrize(
    ("mode", "says"), [("crash", "its stream (broke|mid-round)"), ("stall", "sent nothing")]
)
def test_a_stage_that_crashes_mid_session_fails_its_round_by_name(mode, says, server_identity):
    """Round 1 trains in the session; in round 2 stage 1's node crashes (its stream
    breaks) or stalls (its stream goes silent) before step 1: the round fails naming it
    within the bound, the session ends (no port or thread left), and round 3 sets a
    fresh session up and trains."""
    fault = {"fail_on": P.STREAM, "fail_mode": mode, "fail_round": 2, "fail_step": 1}
    if mode == "stall":  # silent 4.5 s, past the 3 s silence bound
        fault["fail_delay_s"] = 4.5
    grid, pipeline = _fleet(fault)
    pool = StreamSessions(max_age_s=3600.0, close_deadline_s=20.0)
    s = _settings(grid, "gpipe", 2, sessions=pool, stream_timeout_s=3.0)
    arrays = ArrayRecord(_weights())
    try:
        arrays = StreamRunner(s).run_round(grid, pipeline, arrays, STEPS, 1).arrays
        t0 = time.perf_counter()
        with pytest.raises(SkyNodeError) as err:
            StreamRunner(s).run_round(grid, pipeline, arrays, STEPS, 2)
        assert time.perf_counter() - t0 < BOUND_S
        assert "stage 1 on n1" in str(err.value), err.value
        assert re.search(says, str(err.value)), err.value  # a crash: closed, or broke
        # a broken stream blames its node; so does silence when it alone owed a reply
        assert err.value.nodes == ["n1"], err.value.nodes
        assert len(pool) == 0  # the failed session is gone
        out = StreamRunner(s).run_round(grid, pipeline, arrays, STEPS, 3)
        assert out.extra["session_round"] == 1 and out.extra["flower_messages"] == 3
    finally:
        pool.close_all()
        grid.join()
    assert pool.opened == 2
    deadline = time.monotonic() + 5.0
    while _stream_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _stream_threads()
    assert not [t for t in threading.enumerate() if t.name.startswith("sky-pipeline")]


# -- several data owners, FedAvg across their pipelines, BatchNorm both ways -------------
def _owner_pipelines(grid: ThreadedGrid) -> list:
    """Two owners' pipelines, each its owner (layers 0-1: Linear, BatchNorm) then one
    shared helper (2-3); the second starts after the first (they share the helper), so
    the helper runs both pipelines' sessions at once, in two handlers."""
    from test_fedavg_state import OWNERS
    from test_fedavg_state import STEPS as OWNER_STEPS

    from sky_flower.sky.planning.planning import PipelineRun

    runs = []
    for i, owner in enumerate(OWNERS):
        stages = [
            StagePlan(owner, 0, 0, 1, 0.0, 0.0, 0.0, 0.0),
            StagePlan("helper", 1, 2, 3, 0.0, 0.0, 0.0, 0.0),
        ]
        pred = tuple(
            {"node": st.node, "messages": 0, "compute_s": 0.0, "busy_s": 0.0} for st in stages
        )
        ids = (grid.ids[i], grid.ids[2])
        pipeline = Pipeline(
            Plan("even", stages, 0.0, 0.0, 0.0), ids, 1, pred, (0.0,) * 2, ((0, 0),) * 2
        )
        runs.append(
            PipelineRun(owner, len(OWNERS[owner]), OWNER_STEPS, pipeline, after=(0,) if i else ())
        )
    return runs


def _federated(
    policy: str, sessions: bool, rounds: int = 3, per_node: int | None = None
) -> tuple[list[dict], int, int]:
    """``rounds`` federated rounds of :func:`_owner_pipelines` on ``stream`` (FedAvg
    across the owners; ``policy``: train.bn_policy): the global model after each, and
    the Flower messages pushed and pulled. ``per_node``: sessions one node runs at once
    (None: the simulation engine's, 1: a SuperNode's)."""
    from test_fedavg_state import LR as BN_LR
    from test_fedavg_state import SEED as BN_SEED
    from test_fedavg_state import B, _bn_net, _owner_of

    from sky_flower.sky.rounds.federation import LocalBatchNorm, batchnorm_keys, federated_round

    names = ["owner-a", "owner-b", "helper"]
    apps = {
        n: SkyClient(model_fn=_bn_net, load_data=_owner_of).register(ClientApp()) for n in names
    }
    grid = Counted(apps, {n: {"sky-node": n, "partition-id": k} for k, n in enumerate(names)})
    runs = _owner_pipelines(grid)
    pool = None
    if sessions:
        pool = StreamSessions(max_age_s=3600.0, close_deadline_s=20.0, per_node=per_node)
        pool.plan([r.pipeline.node_ids for r in runs])  # as the executor does each round
    s = RunSettings(
        model_fn=_bn_net,
        input_shape=(6,),
        num_layers=4,
        settings=runner_settings(
            {
                "schedule.batch_size": B,  # as _reference
                "schedule.microbatches": 1,
                "schedule.kind": "gpipe",
                "train.optimizer": "sgd",
                "train.lr": BN_LR,
                "seed": BN_SEED,
                "failure.message_timeout_s": 30.0,
                "stream.timeout_s": 20.0,
            }
        ),
        describe=grid.names.get,
        sessions=pool,
    )
    local = LocalBatchNorm(batchnorm_keys(_bn_net())) if policy == "local" else None
    arrays, models = ArrayRecord(_bn_net().state_dict()), []
    try:
        for rnd in range(1, rounds + 1):
            res = federated_round(grid, runs, lambda: StreamRunner(s), arrays, rnd, local_bn=local)
            row, new = res.record, res.arrays
            assert new is not None, res.failure
            per_round = not sessions or per_node == 1  # the helper is in both pipelines
            assert row.flower_messages == (8 if per_round else (4 if rnd == 1 else 0)), row
            arrays = new
            models.append(arrays.to_torch_state_dict())
    finally:
        if pool is not None:
            pool.close_all()
        grid.join()
    return models, grid.pushed, grid.pulled


@pytest.mark.parametrize("policy", ["average", "local"])
def test_owners_with_fedavg_in_sessions_equal_per_round_set_ups(policy, server_identity):
    """Two data owners, FedAvg across their pipelines, a helper in both (two sessions
    on one node at once), BatchNorm averaged or kept per owner (FedBN): three rounds in
    sessions (one set-up per stage in all) equal set-ups every round bit for bit, and
    (``average``) the owners training alone, FedAvg across them."""
    per_round, pushed_r, _ = _federated(policy, sessions=False)
    in_session, pushed, pulled = _federated(policy, sessions=True)
    assert pushed_r == 4 * 3 and (pushed, pulled) == (4, 4)
    for got, expected in zip(in_session, per_round, strict=True):
        _assert_bits(got, expected)
    if policy == "average":
        from test_fedavg_state import _close, _reference

        _close(in_session[-1], _reference("average", 3)[0])


def test_pipelines_sharing_a_node_set_up_every_round_where_a_node_runs_one_message(
    server_identity,
):
    """Deployed, a Flower 1.42 SuperNode handles one message at a time (its
    ``_push_messages`` waits for the reply before the next pull), so a node in two
    pipelines cannot hold a session for each: with ``per_node=1`` the two pipelines that
    share the helper set their stages up every round (8 messages a round, none left in
    a session) and train exactly as without sessions."""
    per_round, pushed_r, _ = _federated("average", sessions=False)
    one, pushed, _ = _federated("average", sessions=True, per_node=1)
    assert pushed == pushed_r == 4 * 3
    for got, expected in zip(one, per_round, strict=True):
        _assert_bits(got, expected)


def test_a_session_ends_when_its_pipeline_nodes_change_or_it_shares_a_node():
    """``retain`` with each planned owner's nodes closes the sessions whose nodes
    changed (before any new one is set up); ``usable_for`` refuses a pipeline with a
    node of another one when a node runs one session."""
    pool = StreamSessions(max_age_s=3600.0, close_deadline_s=1.0)
    closed: list[str] = []

    class _Session:
        def __init__(self, owner: str, nodes: tuple[int, ...]) -> None:
            self.owner, self.key = owner, SessionKey(nodes, ("rest",))

        def close(self, graceful: bool, deadline_s: float) -> int:
            closed.append(self.owner)
            return 0

    pool.put("a", _Session("a", (1, 2)))  # type: ignore[arg-type]
    pool.put("b", _Session("b", (3, 4)))  # type: ignore[arg-type]
    pool.retain({"a": (1, 2), "b": (3, 5)})
    assert closed == ["b"] and len(pool) == 1
    pool.plan([(1, 2), (3, 2)])
    assert pool.shared == {2}
    assert not pool.usable_for((1, 2)) and pool.usable_for((6,))
    pool.per_node = None
    assert pool.usable_for((1, 2))
    pool.close_all()
    assert closed == ["b", "a"] and len(pool) == 0


@pytest.mark.processes  # ConcurrentGrid: a fresh ClientApp process per message
def test_a_helper_crashing_mid_session_is_dropped_and_the_sessions_replanned(server_identity):
    """The sky-app through Sky's strategy on ``stream`` in sessions, three data owners,
    each message in a fresh process (``ConcurrentGrid``): helper-x crashes before step
    1 of round 2, mid-session. Round 2 averages the pipelines it is not in and names it;
    helper-x is dropped and the federation re-planned; round 3 trains every owner in
    fresh sessions, the re-planned pipelines set up anew; nothing is left behind."""
    from reference import sky_app_run_config
    from test_federation import BATCH as FED_BATCH
    from test_federation import QUICK, _run

    run = {**sky_app_run_config(), "fleet": "federated6", "num-server-rounds": 3}
    run |= {"batch-size": FED_BATCH, "steps-per-round": 2, "max-failed-rounds": 1, **QUICK}
    run |= {"transport": "stream", "schedule-kind": "gpipe", "microbatches": 2}
    run |= {"stream-timeout-s": 10.0}
    fault = {
        "sky-fail-on": P.STREAM,
        "sky-fail-mode": "crash",
        "sky-fail-round": 2,
        "sky-fail-step": 1,
    }
    strategy, _ = _run(run, 3, fault, on=3)  # node 3: helper-x
    first, second, third = strategy.rounds
    assert first.failed_pipelines == [] and first.session_round == 1
    assert first.flower_messages == sum(len(p.nodes) for p in first.pipelines)
    (failed,) = second.failed_pipelines
    assert failed.nodes == ["helper-x"] and "helper-x" in failed.error, failed
    assert second.samples_trained == 2 * 2 * FED_BATCH
    assert third.failed_pipelines == []
    assert third.samples_trained == 3 * 2 * FED_BATCH
    assert all("helper-x" not in p.nodes for p in third.pipelines)
    assert third.flower_messages > 0  # the re-planned pipelines' new sessions
    assert "helper-x" not in {n.name for n in strategy.node_profiles}
    assert not _stream_threads()


def test_a_pipeline_with_more_stages_than_the_engines_workers_is_refused():
    """In the simulation engine every stage of a ``stream`` pipeline runs at once: a
    plan with a pipeline of 3 stages on an engine of 2 workers is refused after
    planning, naming the setting (not run into 150 s join failures each round); 3
    workers run it."""
    from reference import sky_app_run_config, sky_app_task

    from sky_flower.app import sky_strategy

    run = {**sky_app_run_config(), "fleet": "edge3", "transport": "stream"}
    strategy = sky_strategy(run, model_fn=sky_app_task().Net, input_shape=[64])
    grid, pipeline = _fleet()
    grid.join()
    sessions = strategy.executor.sessions
    assert sessions is not None
    sessions.capacity = 2
    with pytest.raises(ValueError, match=r"pipeline of n0 has 3 stages.*runs only 2"):
        strategy.check_plan(pipeline)
    sessions.capacity = 3
    strategy.check_plan(pipeline)


def test_a_silence_bound_below_the_predicted_step_is_refused(server_identity):
    """``stream.timeout_s`` below the plan's predicted step would take a stage
    still computing for a silent one (and drop a healthy node): refused before any
    message, naming the setting and the step."""
    from dataclasses import replace

    grid, pipeline = _fleet()
    step = 0.5
    pipeline = replace(pipeline, plan=replace(pipeline.plan, predicted_step_time_s=step))
    try:
        with pytest.raises(ValueError, match=r"stream.timeout_s=.*predicted step"):
            StreamRunner(_settings(grid, "gpipe", 2, stream_timeout_s=step / 2)).check_plan(
                pipeline
            )
        StreamRunner(_settings(grid, "gpipe", 2, stream_timeout_s=step * 2)).check_plan(pipeline)
    finally:
        grid.join()


def test_the_runtime_workers_the_nodes_report_bound_the_sessions(monkeypatch, server_identity):
    """Under ``flwr run`` the ServerApp is not told how many ClientApps Flower's
    simulation runtime runs at once; its nodes report it in the benchmark round
    (``simulation_workers``: their Ray actor pool) and the fewest bounds the stage
    sessions, as ``concurrent_clientapps`` does for the Hydra job (a plan with more
    stages in all sets them up every round instead of waiting on stages that never get
    a worker). Outside Ray (a SuperNode, this process) nodes report 0: no bound."""
    from reference import ProcessPerMessageGrid, sky_app_on_grid
    from test_federation import QUICK

    import sky_flower.sky.node.client as client
    from sky_flower.flower.runtime import simulation_workers

    assert simulation_workers() == 0  # no Ray actor here
    # direct: its benchmark round is plain Flower messages (stream's times the link on
    # its data plane, which this synchronous grid cannot serve); sessions are the same
    run = {**QUICK, "fleet": "edge3", "transport": "direct", "schedule-kind": "gpipe"}
    strategy, grid, _ = sky_app_on_grid(ProcessPerMessageGrid, run)
    sessions = strategy.executor.sessions
    strategy.benchmark(grid, list(grid.get_node_ids()))
    assert sessions.capacity is None and sessions.per_node == 1  # a deployment's

    reported = iter([3, 2, 5])
    monkeypatch.setattr(client, "simulation_workers", lambda: next(reported, 4))
    strategy, grid, _ = sky_app_on_grid(ProcessPerMessageGrid, run)
    sessions = strategy.executor.sessions
    strategy.benchmark(grid, list(grid.get_node_ids()))
    assert sessions.capacity == 2 and sessions.per_node is None  # the engine's rules
    strategy.executor.bound_by_runtime(7)  # a bound already known is kept
    assert sessions.capacity == 2
