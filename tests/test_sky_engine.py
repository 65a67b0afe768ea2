"""The Sky engine's runners, in process (no Ray): the relay runner against
``ProcessPerMessageGrid`` (a fresh ClientApp per message, the deployment engine's
semantics), failures that name their node, the report formatter and the round rows."""

from __future__ import annotations

import dataclasses
import time
import uuid

import numpy as np
import pytest
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from reference import ProcessPerMessageGrid, error_reply, sky_app_run_config, sky_app_task
from sky_flower.strategies.sky import RUNNERS, SkyModel, SkyNodeError, SkyStrategy

from sky_flower.app import load_fleet, register_sky_client, sky_strategy
from sky_flower.deploy import node_config
from sky_flower.flower.exchange import NodeError
from sky_flower.sky import protocol as P
from sky_flower.sky.rounds.records import RoundRecord, StageRecord
from sky_flower.sky.rounds.report import stage_table
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.runner import RoundOutcome

RUN = {
    "fleet": "edge3",
    "allocation": "even",
    "steps-per-round": 2,
    "microbatches": 2,
    "benchmark-repeats": 1,
    "echo-repeats": 1,
    "state-probe-mb": 0.0,
}


@pytest.fixture
def server_identity(monkeypatch):
    for attr, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)  # as a ServerApp process has them


class ErrorReplyGrid(ProcessPerMessageGrid):
    """As the engines do: a handler's exception comes back as an error reply."""

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        ids = []
        for msg in messages:
            try:
                ids += super().push_messages([msg])
            except Exception as err:  # noqa: BLE001 - turned into the reply
                mid = str(uuid.uuid4())
                msg.metadata.__dict__["_message_id"] = mid
                self.replies[mid] = error_reply(msg, err)
                ids.append(mid)
        return ids


class SlowReplyGrid(ErrorReplyGrid):
    """Each reply can be pulled only ``delay_s`` after its push; counts the pulls."""

    delay_s, pulls = 0.0, 0

    def push_messages(self, messages):  # noqa: ANN001, ANN201
        ids = super().push_messages(messages)
        self.ready_at = {**getattr(self, "ready_at", {})}
        self.ready_at.update({m: time.monotonic() + self.delay_s for m in ids})
        return ids

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        self.pulls += 1
        now = time.monotonic()
        ready = [m for m in message_ids if m in self.replies and self.ready_at[m] <= now]
        return [self.replies.pop(m) for m in ready]


def _planned(overrides: dict, fleet=None) -> tuple[SkyStrategy, ProcessPerMessageGrid]:
    """A strategy benchmarked and planned on a fresh in-process grid of ``fleet``."""
    task = sky_app_task()
    run_config = {**sky_app_run_config(), **RUN, **overrides}
    fleet = fleet or load_fleet("edge3")
    configs = [parse_config_args([node_config(n, i, len(fleet))]) for i, n in enumerate(fleet)]

    def fresh_app() -> ClientApp:
        return register_sky_client(ClientApp(), model_fn=task.Net, load_data=task.load_data)

    grid = SlowReplyGrid(fresh_app, configs, run_config)
    strategy = sky_strategy(run_config, model_fn=task.Net, input_shape=[64])
    strategy.benchmark(grid, list(grid.get_node_ids()))
    strategy.make_plan()
    return strategy, grid


def _round(strategy: SkyStrategy, grid: ProcessPerMessageGrid) -> RoundOutcome:
    arrays = ArrayRecord(sky_app_task().initial_weights())
    return strategy.runner().run_round(grid, strategy.pipeline, arrays, 2, server_round=1)


def test_sequential_is_the_pipelined_relay_with_one_group(server_identity):
    seq, seq_grid = _planned({"schedule-kind": "sequential"})
    pipe, pipe_grid = _planned({"schedule-kind": "gpipe", "microbatches-per-message": 1})
    assert seq.pipeline.group_size == 2 and pipe.pipeline.group_size == 1
    a, b = _round(seq, seq_grid), _round(pipe, pipe_grid)
    got_a, got_b = a.arrays.to_torch_state_dict(), b.arrays.to_torch_state_dict()
    for key, value in got_a.items():
        np.testing.assert_allclose(value.numpy(), got_b[key].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-5)
    assert (a.correct, a.seen) == (b.correct, b.seen) == (a.correct, 2 * 64)
    # one path on the wire: sequential is one forward/backward group per step
    types = {t for _, t in seq_grid.handled} | {t for _, t in pipe_grid.handled}
    assert types <= set(P.MESSAGE_TYPES) and P.BACKWARD in types
    assert [st.messages for st in a.stages] == [2, 2, 1]
    assert [st.messages for st in b.stages] == [4, 4, 2]
    assert all(st.predicted_messages == st.messages for st in a.stages + b.stages)


@pytest.mark.realtime
@pytest.mark.parametrize("kind", ["sequential", "gpipe"])
def test_relay_polls_at_the_configured_period(kind, server_identity):
    overrides = {"schedule-kind": kind, "microbatches-per-message": 1, "poll-interval-s": 0.05}
    strategy, grid = _planned(overrides)
    grid.delay_s, grid.pulls, grid.ready_at = 0.1, 0, {}
    t0 = time.monotonic()
    _round(strategy, grid)
    wall, pushed = time.monotonic() - t0, len(grid.ready_at)
    # at most one pull per period, plus one per reply (a pull that got one goes on at once)
    assert grid.pulls <= wall / 0.05 + pushed, (grid.pulls, wall, pushed)


def test_failing_node_raises_a_node_error_carrying_its_id(server_identity):
    fleet = list(load_fleet("edge3"))
    fleet[2] = dataclasses.replace(fleet[2], fail_on=P.FORWARD, fail_mode="raise")
    strategy, grid = _planned({"schedule-kind": "gpipe", "microbatches-per-message": 1}, fleet)
    box = strategy.state.ids["box"]
    with pytest.raises(SkyNodeError) as info:
        _round(strategy, grid)
    err = info.value
    assert isinstance(err, NodeError) and err.node_ids == [box] and err.nodes == ["box"]
    assert "box" in str(err) and "replied with an error" in str(err)


def test_failed_round_drops_the_node_by_id_and_the_next_round_trains(server_identity):
    fleet = list(load_fleet("edge3"))
    fleet[2] = dataclasses.replace(fleet[2], fail_on=P.FORWARD, fail_mode="malformed")
    strategy, grid = _planned({"max-failed-rounds": 2}, fleet)
    initial = ArrayRecord(sky_app_task().initial_weights())
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=2)
    (failed,) = strategy.failed_rounds
    assert failed.round == 1 and failed.dropped_nodes == ["box"]
    assert "has shape" in failed.error
    bad, good = strategy.rounds
    assert "box" in bad.error and good.round == 2 and good.error is None
    assert {st.node for st in strategy.plan.stages} <= {"phone", "cloud"}
    assert result.arrays is strategy.global_arrays


def test_a_run_in_which_no_round_trained_ends_with_an_error(server_identity):
    """Fewer rounds than max_failed_rounds, all failed: not a run that returns the
    initial model as if it had trained (found by a new-user trial)."""
    fleet = list(load_fleet("edge3"))
    fleet[0] = dataclasses.replace(fleet[0], fail_on=P.FORWARD, fail_mode="raise")
    strategy, grid = _planned({"max-failed-rounds": 2}, fleet)
    initial = ArrayRecord(sky_app_task().initial_weights())
    with pytest.raises(SkyNodeError, match=r"none of the 1 round\(s\) trained .*phone"):
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=1)


def test_runner_picked_once_from_the_transport():
    assert set(RUNNERS) == {"relay", "direct", "stream"}
    task = sky_app_task()
    with pytest.raises(ValueError, match="kind=sequential, transport=direct"):
        SkySettings().replace({"schedule.transport": "direct"})
    settings = SkySettings().replace(
        {"messaging.poll_interval_s": 0.1, "messaging.node_wait_s": 1.0}
    )
    strategy = SkyStrategy(SkyModel(task.Net, [64]), settings)
    assert strategy.run_settings().settings.messaging.poll_interval_s == 0.1
    assert type(strategy.runner()) is RUNNERS["relay"]
    with pytest.raises(ValueError, match="cannot travel to the nodes"):
        SkyModel(task.Net, [64], loss_fn=lambda out, y: out.sum())
    with pytest.raises(TypeError, match="first argument is a SkyModel"):
        SkyStrategy(task.Net, settings)  # the old signature: a clear error


def test_round_row_keys_and_one_stage_table_for_both_transports():
    """A direct round's row holds its transport's figures (set-up, wall) and no relay
    ones; its stage table the columns its stages fill."""
    stages = [StageRecord(0, "a", 0.1, median_step_s=0.2)]
    row = RoundRecord(1, 3.0, train_loss=0.75, setup_s=1.0, wall_s=2.0, stages=stages).to_dict()
    assert {"setup_s", "wall_s", "stages"} <= set(row) and "microbatches_per_message" not in row
    table = stage_table(stages)
    assert "compute s" in table and "median step s" in table and "msgs" not in table


def test_direct_messages_carry_a_typed_config_per_stage(server_identity):
    from sky_flower.pipeline.direct import RoundHost
    from sky_flower.sky.transport.direct import DirectRunner

    strategy, _ = _planned({"transport": "direct", "schedule-kind": "gpipe"})
    runner, plan = strategy.runner(), strategy.pipeline
    assert isinstance(runner, DirectRunner)
    arrays = ArrayRecord(sky_app_task().Net().state_dict())
    with RoundHost(plan.num_stages, 5.0, "127.0.0.1", 5.0) as host:
        msgs = runner.configure(plan, arrays, 3, 1, host)
    for k, msg in enumerate(msgs):
        assert msg.metadata.message_type == P.DIRECT
        cfg = P.DirectConfig.from_config_record(msg.content.config_records[P.CONFIG])
        assert (cfg.stage.stage, cfg.rendezvous.rank, cfg.steps) == (k, k, 3)
        assert cfg.node_id == plan.node_ids[k] == msg.metadata.dst_node_id
        assert cfg.stage.loss == P.DEFAULT_LOSS and cfg.stage.metric == P.DEFAULT_METRIC
        assert set(msg.content.array_records[P.ARRAYS]) <= set(arrays)


@pytest.mark.parametrize("echo_bytes", [(1024, 1024), (4096, 1024), (1024,), (0, 1024)])
def test_bad_echo_sizes_are_refused_before_any_node_is_contacted(echo_bytes):
    with pytest.raises(ValueError, match=r"echo_bytes .* 0 < small < large"):
        SkySettings().replace({"benchmark.echo_bytes": echo_bytes})


def test_a_stopped_run_stops_the_benchmark_instead_of_blaming_the_nodes(server_identity):
    """Ctrl-C (``request_stop``) during the benchmark round ends it with the stop, not
    with every node left out of the plan as if it had failed."""
    task = sky_app_task()
    run_config = {**sky_app_run_config(), **RUN}
    fleet = load_fleet("edge3")
    configs = [parse_config_args([node_config(n, i, len(fleet))]) for i, n in enumerate(fleet)]
    grid = ErrorReplyGrid(
        lambda: register_sky_client(ClientApp(), model_fn=task.Net, load_data=task.load_data),
        configs,
        run_config,
    )
    strategy = sky_strategy(run_config, model_fn=task.Net, input_shape=[64])
    strategy.request_stop()
    with pytest.raises(SkyNodeError, match="run stopped by the caller"):
        strategy.benchmark(grid, list(grid.get_node_ids()))
    # the first node's profile message was pushed before the next poll saw the stop; the
    # other nodes were never asked (before, each was "left out" in turn)
    assert strategy.node_profiles == [] and len(grid.handled) <= 1
