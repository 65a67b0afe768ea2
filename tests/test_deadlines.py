"""Issue 17, per-phase deadlines and no message pushed to a busy node: the Exchange's
first-contact deadline and in-flight ledger against a real ClientApp in this process,
the phase formula, and a Sky run on the concurrent in-process grid (a node per thread,
a fresh process per message) whose data owner overruns one stage message."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from flwr.app import Message
from reference import ConcurrentGrid, sky_app_on_grid
from slow_nodes import stalling_client
from test_exchange import NEVER, HoldingGrid, echo_app, messages

from sky_flower.flower.exchange import Exchange, NodeError, NodeLedger
from sky_flower.sky.settings import DeadlineSettings, SkySettings
from sky_flower.sky.transport.deadlines import deadline, stage_message_s


@pytest.fixture(autouse=True)
def server_identity(monkeypatch):
    """Building a Message outside a running app needs a ServerApp's process identity."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


# --- the phase formula -----------------------------------------------------------------
def test_phase_deadlines_have_message_timeout_as_floor_and_scale_stages():
    d = DeadlineSettings(first_contact_s=300, benchmark_s=120, setup_s=60, stage_multiple=5)
    assert deadline(d, "benchmark", 3.0) == 120 and deadline(d, "setup", 3.0) == 60
    assert deadline(d, "collect", 600.0) == 600  # an old, longer message_timeout_s still holds
    assert deadline(d, "stage", 3.0, predicted_s=2.0) == 13.0
    assert deadline(d, "stage", 3.0, predicted_s=float("nan")) == 3.0
    assert stage_message_s({"busy_s": 0.8, "messages": 2}, latency_s=0.1) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown phase"):
        deadline(d, "train", 1.0)
    with pytest.raises(ValueError, match="stage_multiple must be >= 0"):
        SkySettings().replace({"deadlines.stage_multiple": -1})
    s = SkySettings.from_run_config({"message-timeout-s": 3.0, "stage-timeout-multiple": 2.0})
    assert s.failure.message_timeout_s == 3.0 and s.deadlines.stage_multiple == 2.0
    with pytest.raises(ValueError, match="first-contact-timeout-s must be > 0"):
        SkySettings.from_run_config({"first-contact-timeout-s": 0.0})


# --- the Exchange ------------------------------------------------------------------------
def test_first_contact_gets_its_own_deadline_later_messages_the_normal_one():
    grid = HoldingGrid(echo_app(), 1, hold={101: 8})  # each reply shows after 8 pulls
    ex = Exchange(grid, timeout_s=0.1, poll_interval_s=0.03, first_contact_s=30.0)
    (reply,) = ex.request(messages(grid))  # ~0.25 s: past 0.1 s, within first contact
    assert not reply.has_error()
    with pytest.raises(NodeError, match=r"no reply within 0.1 s from node 101"):
        ex.request(messages(grid))  # the node has answered once: the normal deadline


def test_no_message_is_pushed_to_a_node_with_a_timed_out_one_in_flight():
    grid = HoldingGrid(echo_app(), 2, hold={101: NEVER})
    ex = Exchange(grid, timeout_s=0.05, poll_interval_s=0.01, busy_wait_s=0.2)
    with pytest.raises(NodeError, match="no reply within"):
        ex.request(messages(grid))
    handled = len(grid.handled)
    with pytest.raises(NodeError, match="still running a message") as err:
        ex.push(messages(grid))
    assert err.value.node_ids == [101]
    assert len(grid.handled) == handled  # nothing pushed, to either node
    (reply,) = ex.request(messages(grid)[1:])  # the other node is not held up
    assert reply.metadata.src_node_id == 102


def test_a_stale_reply_that_comes_is_discarded_and_the_push_goes_ahead():
    grid = HoldingGrid(echo_app(), 1, hold={101: 6})
    ledger = NodeLedger()  # shared: a failed round's Exchange, then the next round's
    first = Exchange(grid, timeout_s=30.0, poll_interval_s=0.01, ledger=ledger)
    stale = first.push(messages(grid))
    first.abandon()
    assert not first.pending and set(ledger.unanswered) == set(stale)
    grid.hold = {}
    nxt = Exchange(grid, timeout_s=30.0, poll_interval_s=0.01, ledger=ledger, busy_wait_s=5.0)
    ids = nxt.push(messages(grid))
    assert not set(stale) & set(ledger.unanswered)  # waited for, pulled, discarded
    (reply,) = nxt.wait(ids)
    assert reply.metadata.reply_to_message_id == ids[0]


# --- a Sky run: the data owner overruns one stage message ---------------------------------
class BusyCheckingGrid(ConcurrentGrid):
    """:class:`ConcurrentGrid` that records every push to a node whose previous message
    has not been answered yet (``violations``: ``(node id, message type)``), and runs
    each message in its node's thread (context still carried as protobuf bytes; no
    process per message: faster, and this test is about timing, not processes)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, processes=False, **kwargs)
        self.unanswered: dict[int, int] = {nid: 0 for nid in self.ids}
        self.violations: list[tuple[int, str]] = []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        with self._lock:
            for msg in messages:
                nid = msg.metadata.dst_node_id
                if self.unanswered[nid]:
                    self.violations.append((nid, msg.metadata.message_type))
                self.unanswered[nid] += 1
        return super().push_messages(messages)

    def _record(self, nid: int, reply: Message) -> None:
        super()._record(nid, reply)
        self.unanswered[nid] -= 1


@pytest.mark.realtime
def test_a_slow_owner_is_waited_for_not_pushed_to():
    """With message_timeout_s=2 for every message, the benchmark's first messages (a
    node's start-up: its first ClientApp, imports, the model's first timing) timed out
    and the run failed with "no data owner answered"; and the round after a timed-out
    stage pushed its set-up to the owner still running that stage (after a drain of at
    most min(10 s, message_timeout_s)). Now the benchmark has its own deadlines, the
    owner's overrun of its stage deadline fails round 1 by name, and round 2's set-up
    waits for the stale reply (no push to a busy node) and trains."""
    run = {
        "fleet": "uniform3",
        "allocation": "even",
        "num-server-rounds": 2,
        "steps-per-round": 2,
        "message-timeout-s": 2.0,
        "max-failed-rounds": 2,
        "benchmark-repeats": 1,
        "echo-repeats": 1,
        "state-probe-mb": 0.0,
    }
    run |= {"stage-timeout-multiple": 0.0, "busy-wait-s": 30.0}
    strategy, grid, start = sky_app_on_grid(BusyCheckingGrid, run)
    grid.app_fn = stalling_client
    try:
        strategy.start(**start)
    finally:
        grid.close()
    assert len(strategy.node_profiles) == 3  # nobody dropped from the benchmark
    failed, trained = strategy.rounds
    assert "no reply within 2 s" in failed.error and "node0" in failed.error
    assert trained.error is None and trained.steps == 2
    assert grid.violations == []


def test_a_node_that_fails_the_benchmark_is_named_by_elimination():
    run = {"fleet": "uniform3", "benchmark-repeats": 1, "echo-repeats": 1, "state-probe-mb": 0.0}
    fault = {"sky-fail-on": "query.sky_profile", "sky-fail-mode": "raise"}
    strategy, grid, _ = sky_app_on_grid(BusyCheckingGrid, run, node_extra={1: fault})
    try:
        strategy.benchmark(grid, list(grid.ids))
    finally:
        grid.close()
    assert [n.name for n in strategy.node_profiles] == ["node0", "node2"]
    assert strategy.state.names[grid.ids[1]] == "node1"  # it never told its name: the fleet did
