"""The Sky protocol is idempotent (issue 17): every stage message carries its identity
(round, set-up session, step, micro-batch group, kind); a node applies a message once
and answers a repeat with the same reply, refuses one older than what it has applied,
and a step's micro-batch groups delivered in another order give the in-order weights.
Fast, no engine: the deployment engine's message semantics in this process
(``tests/reference.py``)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable
from functools import partial

import numpy as np
import pytest
from flwr.app import Message
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from reference import (
    ConcurrentGrid,
    ProcessPerMessageGrid,
    _wire,
    error_reply,
    reference_rounds,
    run_sky_app,
    sky_app_on_grid,
    sky_app_run_config,
)
from reference import sky_app_task as _task

from sky_flower.sky import protocol as P
from sky_flower.sky.protocol import starts_session

QUICK = {"benchmark-repeats": 1, "echo-repeats": 1, "state-probe-mb": 0.0, "allocation": "even"}
STAGE_MESSAGES = (P.SETUP, P.FORWARD, P.BACKWARD, P.COLLECT)


class RedeliveringGrid(ProcessPerMessageGrid):
    """:class:`ProcessPerMessageGrid` that delivers chosen messages a second time, with
    the same message id, as a retrying transport would: ``twice(msg)`` True delivers it
    again at once (the server gets the second reply, as after a lost first reply);
    ``later(msg)`` True keeps a copy and delivers it again after the node's next
    message (its reply is kept in ``late`` only: the server has moved on).
    ``pairs`` holds ``(first reply, second reply)`` of every immediate repeat."""

    def __init__(
        self,
        *args: object,
        twice: Callable[[Message], bool] = lambda m: False,
        later: Callable[[Message], bool] = lambda m: False,
    ) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.twice, self.later = twice, later
        self.pairs: list[tuple[Message, Message]] = []
        self.late: list[tuple[Message, Message]] = []  # (message, reply)
        self.held: dict[int, list[Message]] = {}
        self.peak: dict[int, int] = {}  # node id -> largest serialised context seen

    def deliver(self, node_id: int, message: Message) -> Message:
        """Handle ``message`` on node ``node_id`` (context restored from and saved to
        bytes); a raising handler gives an error reply, as a SuperNode's does."""
        nid, msg = node_id, message
        context = context_from_proto(ProtoContext.FromString(self.saved[nid]))
        try:
            reply = self.app_fn()(_wire(msg), context)
        except Exception as err:  # noqa: BLE001 - as a SuperNode: an error reply
            return _wire(error_reply(_wire(msg), err))
        self.saved[nid] = context_to_proto(context).SerializeToString()
        self.peak[nid] = max(self.peak.get(nid, 0), len(self.saved[nid]))
        self.handled.append((nid, msg.metadata.message_type))
        return _wire(reply)

    def send(self, msg: Message) -> Message:
        """Deliver ``msg`` to its destination node now (no message id, no retry)."""
        return self.deliver(msg.metadata.dst_node_id, msg)

    def handle(self, msg: Message) -> Message:
        nid = msg.metadata.dst_node_id
        reply = self.deliver(nid, msg)
        for old in self.held.pop(nid, []):  # stale copies, after a newer message
            self.late.append((old, self.deliver(nid, old)))
        if self.twice(msg):
            again = self.deliver(nid, msg)
            self.pairs.append((reply, again))
            reply = again
        if self.later(msg):
            self.held.setdefault(nid, []).append(msg)
        return reply


def _expected(run: dict) -> list:
    task = _task()
    run = {**sky_app_run_config(), **run}
    return reference_rounds(
        task.Net,
        task.load_data(0, 3),
        rounds=int(run["num-server-rounds"]),
        steps=int(run["steps-per-round"]),
        lr=float(run["lr"]),
        batch_size=int(run["batch-size"]),
        microbatches=int(run["microbatches"]),
        weights=task.initial_weights(),
    )


def _assert_weights(got: dict, expected: dict, atol: float = 1e-6) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key].numpy(), value.numpy(), rtol=1e-4, atol=atol)


def _same_reply(a: Message, b: Message) -> None:
    """Two replies with the same records, arrays and figures."""
    assert not a.has_error() and not b.has_error()
    assert set(a.content.keys()) == set(b.content.keys())
    for key, rec in a.content.array_records.items():
        for name, arr in rec.items():
            np.testing.assert_array_equal(arr.numpy(), b.content[key][name].numpy())
    for key, rec in a.content.metric_records.items():
        assert dict(rec) == dict(b.content[key])


def _run(run: dict, **grid_kw: Callable[[Message], bool]):  # noqa: ANN202
    strategy, grid, start = sky_app_on_grid(partial(RedeliveringGrid, **grid_kw), run)
    result = strategy.start(**start)
    return strategy, result, grid


def _last_forward(msg: Message) -> bool:
    """A forward to the last stage (node 103 of uniform3's three)."""
    return msg.metadata.message_type == P.FORWARD and msg.metadata.dst_node_id == 103


def _stage_message(msg: Message) -> bool:
    return msg.metadata.message_type in STAGE_MESSAGES


@pytest.mark.parametrize(
    ("kind", "per_message", "which"),
    [("sequential", 2, _last_forward), ("gpipe", 1, _last_forward), ("1f1b", 1, _stage_message)],
)
def test_stage_messages_delivered_twice_are_applied_once(kind, per_message, which, server_identity):
    """The last stage's forwards, or every set-up, forward, backward and collect, are
    delivered twice (the server gets the repeat's reply): each repeat answers exactly
    the first reply, and the weights after two rounds equal unsplit training's (before:
    a repeated last-stage forward stepped the optimizer again on the sequential relay,
    was counted twice and failed a step later on the pipelined one; a repeated backward
    failed for want of its stash)."""
    run = {**QUICK, "fleet": "uniform3", "num-server-rounds": 2, "steps-per-round": 2}
    run |= {"microbatches": 2, "schedule-kind": kind, "microbatches-per-message": per_message}
    strategy, result, grid = _run(run, twice=which)
    assert all(r.error is None for r in strategy.rounds), strategy.rounds
    assert len(grid.pairs) >= 4
    for first, again in grid.pairs:
        _same_reply(first, again)
    if which is _stage_message:
        _assert_state_estimate(strategy, grid)
    expected = _expected(run)
    for row, (_, losses) in zip(strategy.rounds, expected, strict=True):
        assert abs(row.train_loss - float(np.mean(losses))) < 1e-5, (row, losses)
    _assert_weights(result.arrays.to_torch_state_dict(), expected[-1][0])


def _assert_state_estimate(strategy, grid: RedeliveringGrid) -> None:  # noqa: ANN001
    """Each stage's largest serialised context (replies kept for repeats included) is
    what the planner's size check charges it (``relay_state_bytes``), to 10 %."""
    from sky_flower.sky.planning.planning import relay_state_bytes

    stages = strategy.plan.stages
    for k, (st, nid) in enumerate(zip(stages, strategy.pipeline.node_ids, strict=True)):
        est = relay_state_bytes(
            strategy.cost, st.first_layer, st.last_layer, k == 0, k == len(stages) - 1
        )
        assert 0.9 * est < grid.peak[nid] < 1.1 * est, (k, grid.peak[nid], est)


def test_a_stale_message_is_refused_and_not_applied(server_identity):
    """Every stage message is delivered once more after the node's next message (as a
    slow retry would): one of the same step answers its first reply, one of an older
    step or set-up (a backward after the next step's forward, a collect after the next
    round's set-up) is refused by name with a STAGE_ERROR reply; nothing is applied
    twice, so two rounds still equal unsplit training."""
    run = {**QUICK, "fleet": "uniform3", "num-server-rounds": 2, "steps-per-round": 2}
    run |= {"microbatches": 2, "schedule-kind": "sequential"}
    strategy, result, grid = _run(run, later=_stage_message)
    assert all(r.error is None for r in strategy.rounds), strategy.rounds
    refused = {}
    for msg, reply in grid.late:
        assert not reply.has_error(), reply.error.reason
        if P.STAGE_ERROR in reply.content.config_records:
            error = reply.content[P.STAGE_ERROR]["error"]
            assert (
                error.startswith("StaleMessageError: train.sky_")
                and "refused, not applied" in error
            )
            refused.setdefault(msg.metadata.message_type, error)
    assert set(refused) >= {P.FORWARD, P.BACKWARD, P.COLLECT}, refused
    assert "is older than what this node has applied" in refused[P.BACKWARD]
    assert len(refused) < len(grid.late)  # the same step's repeats were answered
    _assert_weights(result.arrays.to_torch_state_dict(), _expected(run)[-1][0])


# --- message by message: two stages, one step's micro-batches in any order ---------------
M, B, STEPS = 4, 64, 2


def _two_stage_grid() -> tuple[RedeliveringGrid, dict, list]:
    """Two nodes (101: data owner, layers 0-1; 102: layers 2-3) and the full model."""
    from flwr.clientapp import ClientApp

    from sky_flower.emulation.devices import Emulation
    from sky_flower.sky.node.client import SkyClient

    task = _task()
    data = task.load_data(0, 1)
    fleet = [Emulation("a", holds_data=True), Emulation("b")]

    def app() -> ClientApp:
        client = SkyClient(
            task.Net,
            lambda ctx: data if ctx.node_id == 101 else None,
            lambda ctx: fleet[ctx.node_id - 101],
        )
        return client.register(ClientApp())

    grid = RedeliveringGrid(app, [{}, {}], {})
    full = {k: v.detach().clone() for k, v in task.initial_weights().items()}
    return grid, full, data


def _msg(nid: int, mtype: str, content: dict) -> Message:
    from flwr.app import RecordDict

    msg = Message(RecordDict(content), dst_node_id=nid, message_type=mtype, group_id="1")
    msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    return msg


def _setup(grid: RedeliveringGrid, full: dict, session: int, optimizer: str = "adam") -> None:
    from flwr.app import ArrayRecord

    from sky_flower.pipeline.stage import slice_state

    for k, (first, last) in enumerate([(0, 1), (2, 3)]):
        st = P.StageConfig(
            k, first, last, k == 0, k == 1, M, B, optimizer, 0.01, 1, 0, session=session
        )
        content = {
            P.ARRAYS: ArrayRecord(slice_state(full, first, last)),
            P.CONFIG: st.to_config_record(),
        }
        assert not grid.send(_msg(101 + k, P.SETUP, content)).has_error()


def _one_step(grid, step: int, session: int, rng, repeat: bool) -> None:  # noqa: ANN001
    """Step ``step``, one micro-batch per message: stage 0's forwards, stage 1's
    forwards (loss and backward), stage 0's backwards, each in an order of ``rng``
    (None: in order); ``repeat``: each message delivered twice, answered the same."""
    order = (lambda: list(rng.permutation(M))) if rng is not None else (lambda: list(range(M)))

    def send(nid: int, mtype: str, content: dict) -> Message:
        msg = _msg(nid, mtype, content)
        reply = grid.send(msg)
        assert not reply.has_error() and P.STAGE_ERROR not in reply.content, reply
        if repeat:
            _same_reply(reply, grid.send(msg))
        return reply

    mb = {g: P.MicroBatchGroup(step, int(g), 1, 1, session).to_config_record() for g in range(M)}
    acts = {g: send(101, P.FORWARD, {P.MB: mb[g]}).content for g in order()}
    grads = {
        g: send(102, P.FORWARD, {P.MB: mb[g], P.ACT: acts[g][P.ACT], P.LABELS: acts[g][P.LABELS]})
        for g in order()
    }
    for g in order():
        send(101, P.BACKWARD, {P.MB: mb[g], P.GRAD: grads[g].content[P.GRAD]})


def _collect(grid: RedeliveringGrid, session: int) -> dict:
    cfg = {P.CONFIG: P.SessionId(1, session).to_config_record()}
    got = {}
    for nid in (101, 102):
        got.update(grid.send(_msg(nid, P.COLLECT, cfg)).content[P.ARRAYS].to_torch_state_dict())
    return got


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_a_steps_micro_batches_in_any_order_and_repeated_equal_in_order(seed, server_identity):
    """Each step's micro-batch messages reach each stage in a random order (``seed``;
    None: in order), every one of them twice: the weights after two steps equal unsplit
    training's (``reference_rounds``), as in order.

    Out of order only the order of the gradient sum over the ``M`` micro-batches
    changes, hence its rounding. With SGD that reaches a weight as ``lr`` times it: at
    most ``lr * STEPS * M * eps32 * sum_m |g_m|`` (``eps32`` = 1.19e-7), below 1e-7 for
    this model's gradients (each ``|g_m|`` is far below 10), so the in-order tolerance
    holds out of order too. (Adam divides by ``sqrt(v)``, which for a near-zero gradient
    entry magnifies the same rounding without bound: not a property of the protocol.)"""
    import numpy.random

    grid, full, data = _two_stage_grid()
    _setup(grid, full, session=7, optimizer="sgd")
    rng = None if seed is None else numpy.random.default_rng(seed)
    for step in range(STEPS):
        _one_step(grid, step, 7, rng, repeat=True)
    weights, _ = reference_rounds(
        _task().Net, data, 1, STEPS, 0.01, B, M, optimizer="sgd", weights=full
    )[0]
    _assert_weights(_collect(grid, 7), weights, atol=1e-6)


def test_missed_set_up_and_missing_stash_are_the_nodes_failure(server_identity):
    """A forward of a set-up the node never received, or a backward before its forward,
    is refused with an error reply (the node's state, not a stage error); a set-up older
    than the node's is refused as stale and leaves the stage as it was."""
    grid, full, _ = _two_stage_grid()
    _setup(grid, full, session=7)
    newer = P.MicroBatchGroup(0, 0, 1, 1, 8).to_config_record()
    reply = grid.send(_msg(101, P.FORWARD, {P.MB: newer}))
    assert reply.has_error() and "NodeStateError" in reply.error.reason
    assert (
        "round 1 (set-up 8)" in reply.error.reason
        and "holds the stage of round 1 (set-up 7)" in reply.error.reason
    )
    early = P.MicroBatchGroup(0, 1, 1, 1, 7).to_config_record()
    reply = grid.send(_msg(101, P.BACKWARD, {P.MB: early, P.GRAD: _zeros_grad()}))
    assert reply.has_error() and "no stashed input for micro-batch 1" in reply.error.reason
    before = _collect(grid, 7)
    _setup(grid, {k: v + 1.0 for k, v in full.items()}, session=7)  # a repeat: first reply
    old = P.StageConfig(0, 0, 1, True, False, M, B, "adam", 0.01, 1, 0, session=6)
    content = {P.ARRAYS: grid_weights(full, 0, 1), P.CONFIG: old.to_config_record()}
    reply = grid.send(_msg(101, P.SETUP, content))
    assert (
        "StaleMessageError: train.sky_setup of round 1 (set-up 6) is older"
        in reply.content[P.STAGE_ERROR]["error"]
    )
    after = _collect(grid, 7)
    assert all(np.array_equal(before[k].numpy(), after[k].numpy()) for k in before)


def _zeros_grad():  # noqa: ANN202
    import torch
    from flwr.app import ArrayRecord

    return ArrayRecord({P.GRAD: torch.zeros(B // M, 256)})


def grid_weights(full: dict, first: int, last: int):  # noqa: ANN201
    from flwr.app import ArrayRecord

    from sky_flower.pipeline.stage import slice_state

    return ArrayRecord(slice_state(full, first, last))


class _RepeatingDirectGrid(ConcurrentGrid):
    """:class:`ConcurrentGrid` that pushes every ``train.sky_direct`` a second time
    right after it (a copy under its own id, which the server never pulls): the node
    handles the copy once its round is done. A stage session's set-up runs beside the
    node's other messages: its copy comes 3 s later, once the original has joined (as a
    duplicate that a network delivers late)."""

    copies: list[str] = []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(super().push_messages(messages))
        copies = [_wire(m) for m in messages if m.metadata.message_type == P.DIRECT]
        if copies and any(starts_session(m.content) for m in messages):
            push = super().push_messages
            threading.Timer(3.0, lambda: setattr(self, "copies", list(push(copies)))).start()
        elif copies:
            self.copies = list(super().push_messages(copies))
        return ids


@pytest.mark.processes
@pytest.mark.parametrize("sessions", [False, True])
def test_a_repeated_direct_round_message_is_refused_not_run_twice(sessions, server_identity):
    """transport=direct: every stage's round message is delivered twice; the repeat is
    refused by name, joins no process group and trains nothing; the round's weights
    equal unsplit training's. A set-up per round: a STAGE_ERROR reply
    (StaleMessageError, from the node's record of what it ran). A stage session's set-up
    runs beside the node's other messages, and the node's context records it only when
    the session ends: a repeat that comes while the session lives is refused by its
    endpoint (a ticket admits one session; an error reply naming the ticket), one that
    comes later by the node (a STAGE_ERROR reply), before it joins any group either
    way."""
    run = {**QUICK, "fleet": "uniform3", "num-server-rounds": 1, "steps-per-round": 1}
    run |= {"transport": "direct", "schedule-kind": "gpipe", "microbatches": 2}
    run |= {"direct-timeout-s": 20.0, "direct-join-timeout-s": 30.0}
    run |= {"stream-sessions": sessions}
    strategy, result, grid = run_sky_app(_RepeatingDirectGrid, run)
    assert strategy.rounds[0].error is None, strategy.rounds
    repeats: list[Message] = []
    deadline = time.monotonic() + 30.0
    while len(repeats) < 3 and time.monotonic() < deadline:
        repeats += grid.pull_messages(grid.copies)
        time.sleep(0.05)
    assert len(repeats) == 3
    for reply in repeats:
        if sessions:  # the endpoint's refusal while the session lives, else the node's
            refused = (
                "ticket" in reply.error.reason
                if reply.has_error()
                else "already ran on this node" in reply.content[P.STAGE_ERROR]["error"]
            )
            assert refused, reply
            continue
        assert not reply.has_error(), reply.error.reason
        error = reply.content[P.STAGE_ERROR]["error"]
        assert (
            error.startswith("StaleMessageError: train.sky_direct of round 1")
            and "refused" in error
        )
    _assert_weights(result.arrays.to_torch_state_dict(), _expected(run)[-1][0])
