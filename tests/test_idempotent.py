"""The Sky protocol is idempotent (issue 17): every stage message carries its identity
(round, set-up session, step, micro-batch group, kind); a node applies a message once
and answers a repeat with the same reply, refuses one older than what it has applied,
and a step's micro-batch groups delivered in another order give the in-order weights.
Fast, no engine: the deployment engine's message semantics in this process
(``tests/reference.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from functools import partial

import numpy as np
import pytest
from flwr.app import Message
from flwr.common.serde import context_from_proto, context_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from reference import (
    SKY_APP,
    ProcessPerMessageGrid,
    _wire,
    error_reply,
    reference_rounds,
    sky_app_on_grid,
)
from reference import sky_app_task as _task

from sky_flower.deploy import app_run_config
from sky_flower.sky import protocol as P

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

    def deliver(self, msg: Message) -> Message:
        """Handle ``msg`` on its node (context restored from and saved to bytes)."""
        nid = msg.metadata.dst_node_id
        context = context_from_proto(ProtoContext.FromString(self.saved[nid]))
        try:
            reply = self.app_fn()(_wire(msg), context)
        except Exception as err:  # noqa: BLE001 - as a SuperNode: an error reply
            return _wire(error_reply(_wire(msg), err))
        self.saved[nid] = context_to_proto(context).SerializeToString()
        self.handled.append((nid, msg.metadata.message_type))
        return _wire(reply)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            nid = msg.metadata.dst_node_id
            reply = self.deliver(msg)
            for old in self.held.pop(nid, []):  # stale copies, after a newer message
                self.late.append((old, self.deliver(old)))
            if self.twice(msg):
                again = self.deliver(msg)
                self.pairs.append((reply, again))
                reply = again
            if self.later(msg):
                self.held.setdefault(nid, []).append(msg)
            self.replies[mid] = reply
            ids.append(mid)
        return ids


def _expected(run: dict) -> list:
    task = _task()
    run = {**app_run_config(SKY_APP), **run}
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


def _assert_weights(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key].numpy(), value.numpy(), rtol=1e-4, atol=1e-6)


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
    assert all(r.get("error") is None for r in strategy.rounds), strategy.rounds
    assert len(grid.pairs) >= 4
    for first, again in grid.pairs:
        _same_reply(first, again)
    expected = _expected(run)
    for row, (_, losses) in zip(strategy.rounds, expected, strict=True):
        assert abs(row["train_loss"] - float(np.mean(losses))) < 1e-5, (row, losses)
    _assert_weights(result.arrays.to_torch_state_dict(), expected[-1][0])
