"""One message exchange loop for every strategy: push, poll at a configured period,
per-message deadlines, a stop flag, and an error that names the nodes.

Flower's ``Grid.send_and_receive`` polls every 0.1 s and returns whatever arrived by its
timeout, silently. The strategies here need more: a poll period of their own (2 ms in
the simulation engine, where replies are in memory; longer against a real SuperLink,
where every poll is an RPC), several message groups in flight at once (the pipelined
relay pushes stage ``k + 1``'s message while stage ``k`` is busy), a deadline per
message, a stop flag set from another thread, and failures that say which node did it.

Example
-------
>>> ex = Exchange(grid, timeout_s=60.0, poll_interval_s=0.002, describe=names.get)
>>> replies = ex.request(messages)          # push, wait for all, raise on errors
>>> ids = ex.push(more)                     # or drive it yourself:
>>> while ex.pending:
...     for reply in ex.poll():             # raises NodeError past a deadline
...         handle(reply)
>>> for reply in ex.wait_any(until=end):    # asynchronous drivers: whatever arrived
...     ex.raise_errors([reply])

In flight
---------
A message is *in flight* from its push until its reply is pulled. One that timed out, or
that its Exchange gave up on (:meth:`Exchange.abandon`, a failed round), may still be
running on its node, and a node handles its messages one at a time on one
``context.state`` (Flower's simulation engine keeps the last write of concurrent ones).
So an Exchange never pushes a message to a node that has such a message in flight: it
first waits, at most ``busy_wait_s``, for that stale reply (pulled and discarded), and
if it does not come, fails the node by name (:class:`NodeError`) without pushing. A
:class:`NodeLedger` shared by the Exchanges of one run (the Sky strategy's benchmark and
every round's runners) carries this across them, and also which nodes have answered
once: a node's first message (its start-up: a Ray actor, a ClientApp process, imports)
gets at least ``first_contact_s``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from flwr.app import Message
from flwr.serverapp import Grid


class NodeError(RuntimeError):
    """A node failed to answer in time, or answered with an error.

    Attributes
    ----------
    node_ids : list[int] | None
        Flower node ids of the nodes that caused it, where known (``None``: unknown, e.g.
        the run was stopped by the caller).
    nodes : list[str] | None
        Their names as the strategy knows them (``describe``), same order, where known.
    """

    def __init__(
        self,
        message: str,
        nodes: Sequence[str] | None = None,
        node_ids: Sequence[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.nodes = None if nodes is None else list(nodes)
        self.node_ids = None if node_ids is None else list(node_ids)


def short_reason(reason: str, limit: int = 300) -> str:
    """The useful line of an error reply (Flower wraps the node's exception in layers of
    traceback): the text after the last ``Message:``, else the last non-empty line,
    colour codes removed, at most ``limit`` characters."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", reason)
    if "Message:" in text:
        text = text.rsplit("Message:", 1)[1]
    else:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        text = lines[-1] if lines else text
    return text.strip().strip("'\"<>").strip()[:limit]


class NodeLedger:
    """What the Exchanges of one run share about the nodes (thread-safe): every message
    pushed and not yet answered (message id -> node id, deadline, owning Exchange), and
    the nodes that have answered at least once (``contacted``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.unanswered: dict[str, tuple[int, float, int]] = {}  # id -> node, deadline, owner
        self.contacted: set[int] = set()
        # messages meant to run beside others on their node (a stage session: its own
        # ClientApp process, no context.state written while others run); never stale
        # while their Exchange keeps them (see Exchange.push's ``concurrent``)
        self.concurrent: set[str] = set()

    def pushed(self, mid: str, node_id: int, deadline: float, owner: int) -> None:
        """Record message ``mid`` to ``node_id`` (monotonic ``deadline``) of Exchange
        ``owner`` (its ``id()``)."""
        with self.lock:
            self.unanswered[mid] = (node_id, deadline, owner)

    def answered(self, replies: Iterable[Message]) -> None:
        """Forget the messages these replies answer; their senders have been contacted."""
        with self.lock:
            for reply in replies:
                self.unanswered.pop(reply.metadata.reply_to_message_id, None)
                self.concurrent.discard(reply.metadata.reply_to_message_id)
                self.contacted.add(reply.metadata.src_node_id)

    def stale(self, node_ids: Iterable[int], owner: int, live: set[str]) -> dict[str, int]:
        """Messages to ``node_ids`` still in flight that Exchange ``owner`` no longer
        waits for: another Exchange's, or ``owner``'s own past their deadline or not in
        ``live`` (its pending ids). Message id -> node id."""
        now, wanted = time.monotonic(), set(node_ids)
        with self.lock:
            return {
                mid: nid
                for mid, (nid, dl, own) in self.unanswered.items()
                if nid in wanted
                and mid not in self.concurrent
                and (own != owner or mid not in live or now > dl)
            }


class Exchange:
    """Messages in flight on one ``Grid``, with a deadline each.

    Parameters
    ----------
    grid : Grid
        The Flower grid (simulation, deployment, or an in-process test grid).
    timeout_s : float
        Default deadline (s) of a pushed message, from its push.
    poll_interval_s : float (default: 0.002)
        Pause between two ``Grid.pull_messages`` calls while replies are pending.
    stop : threading.Event, optional
        When set, the next poll raises :class:`NodeError` ("run stopped by the caller").
    describe : Callable[[int], str | None], optional
        Node id -> the node's name (for errors); ``None`` or missing: ``node <id>``.
    error_cls : type[NodeError] (default: NodeError)
        The class raised (a strategy's own subclass).
    ledger : NodeLedger, optional
        Shared with the other Exchanges of the run (default: this Exchange's own).
    first_contact_s : float (default: 0.0)
        A node that has not answered yet (in ``ledger``) gets at least this deadline
        (its start-up); 0: no minimum.
    busy_wait_s : float (default: 0.0)
        How long :meth:`push` waits for a stale message in flight on a destination node
        (see the module docstring) before failing that node.
    """

    def __init__(
        self,
        grid: Grid,
        timeout_s: float,
        poll_interval_s: float = 0.002,
        stop: threading.Event | None = None,
        describe: Callable[[int], str | None] | None = None,
        error_cls: type[NodeError] = NodeError,
        ledger: NodeLedger | None = None,
        first_contact_s: float = 0.0,
        busy_wait_s: float = 0.0,
    ) -> None:
        if not timeout_s > 0 or not poll_interval_s >= 0:
            raise ValueError(
                f"timeout_s must be > 0 (got {timeout_s}) and poll_interval_s >= 0 "
                f"(got {poll_interval_s})"
            )
        self.grid, self.timeout_s, self.poll_interval_s = grid, timeout_s, poll_interval_s
        self.stop = stop
        self.describe = describe or (lambda nid: None)
        self.error_cls = error_cls
        self.dst: dict[str, int] = {}  # message id -> destination node id
        self.deadline: dict[str, float] = {}  # pending message id -> monotonic deadline
        self.budget: dict[str, float] = {}  # message id -> its timeout (s), for errors
        self.ledger = NodeLedger() if ledger is None else ledger
        self.first_contact_s, self.busy_wait_s = first_contact_s, busy_wait_s

    # -- naming ------------------------------------------------------------------------
    def name(self, node_id: int) -> str:
        """``"<name> (node <id>)"``, or ``"node <id>"`` for a node without a name."""
        name = self.describe(node_id)
        return f"{name} (node {node_id})" if name else f"node {node_id}"

    def fail(self, text: str, node_ids: Iterable[int] | None = None) -> NodeError:
        """A :class:`NodeError` (of ``error_cls``) naming ``node_ids``."""
        ids = None if node_ids is None else list(dict.fromkeys(node_ids))
        names = None if ids is None else [self.describe(n) or f"node {n}" for n in ids]
        return self.error_cls(text, nodes=names, node_ids=ids)

    # -- the loop ----------------------------------------------------------------------
    @property
    def pending(self) -> set[str]:
        """Ids of pushed messages whose reply has not been returned by :meth:`poll`."""
        return set(self.deadline)

    def push(
        self,
        messages: Sequence[Message],
        timeout_s: float | Sequence[float] | None = None,
        concurrent: bool = False,
    ) -> list[str]:
        """Push ``messages``; each must be answered within ``timeout_s`` (one for all, or
        one per message; default: the exchange's) from now, at least ``first_contact_s``
        for a node that has not answered yet. Returns their message ids, in order.

        A destination node with a stale message in flight (timed out or abandoned, see
        the module docstring) is waited for first, at most ``busy_wait_s``.
        ``concurrent``: these messages run beside the node's others (a stage session,
        :mod:`sky_flower.sky.transport.session`); other pushes to their nodes do not wait
        for them until :meth:`abandon` gives them up.

        Raises
        ------
        NodeError
            If a destination node still runs a stale message after ``busy_wait_s``
            (naming it; nothing is pushed), or the grid accepted fewer messages than
            given.
        """
        if timeout_s is None or isinstance(timeout_s, int | float):
            budgets = [self.timeout_s if timeout_s is None else float(timeout_s)] * len(messages)
        else:
            budgets = [float(t) for t in timeout_s]
        self.settle([m.metadata.dst_node_id for m in messages])
        with self.ledger.lock:
            fresh = [m.metadata.dst_node_id not in self.ledger.contacted for m in messages]
        budgets = [
            max(b, self.first_contact_s) if new else b
            for b, new in zip(budgets, fresh, strict=True)
        ]
        ids = list(self.grid.push_messages(list(messages)))
        if len(ids) != len(messages):
            raise self.fail(
                f"only {len(ids)} of {len(messages)} messages could be sent",
                [m.metadata.dst_node_id for m in messages],
            )
        now = time.monotonic()
        for mid, msg, budget in zip(ids, messages, budgets, strict=True):
            self.dst[mid] = msg.metadata.dst_node_id
            self.deadline[mid] = now + budget
            self.budget[mid] = budget
            self.ledger.pushed(mid, self.dst[mid], now + budget, id(self))
        if concurrent:
            with self.ledger.lock:
                self.ledger.concurrent.update(ids)
        return ids

    def settle(self, node_ids: Iterable[int]) -> None:
        """Wait (at most ``busy_wait_s``) until no node of ``node_ids`` has a stale
        message in flight (see the module docstring); the stale replies that come are
        pulled and discarded.

        Raises
        ------
        NodeError
            Naming the nodes still running one after ``busy_wait_s``, or if the stop
            flag is set meanwhile.
        """
        node_ids = list(node_ids)
        end = time.monotonic() + self.busy_wait_s
        while stale := self.ledger.stale(node_ids, id(self), set(self.deadline)):
            got = list(self.grid.pull_messages(set(stale)))
            self.ledger.answered(got)
            for reply in got:  # one of ours that timed out: no longer pending either
                self.deadline.pop(reply.metadata.reply_to_message_id, None)
            if len(got) == len(stale):
                continue
            if self.stop is not None and self.stop.is_set():
                raise self.error_cls("run stopped by the caller")
            if time.monotonic() >= end:
                busy = [
                    nid
                    for mid, nid in stale.items()
                    if mid not in {r.metadata.reply_to_message_id for r in got}
                ]
                names = ", ".join(self.name(n) for n in dict.fromkeys(busy))
                raise self.fail(
                    f"{names}: still running a message that timed out or was abandoned "
                    f"(waited {self.busy_wait_s:g} s for it): no new message pushed to it",
                    busy,
                )
            time.sleep(max(self.poll_interval_s, 0.01))

    def abandon(self) -> None:
        """Stop waiting for every pending message, at once (a failed round, a run that
        gives up). They stay in flight in the ledger: a later push to their nodes waits
        for them first (:meth:`settle`), ``concurrent`` ones included."""
        with self.ledger.lock:
            self.ledger.concurrent.difference_update(self.deadline)
        self.deadline.clear()

    def shorten(self, limit_s: float) -> None:
        """Bring every pending deadline to at most ``limit_s`` from now (e.g. once one
        peer of a collective has failed, the others only need time to notice)."""
        cap = time.monotonic() + limit_s
        for mid, dl in self.deadline.items():
            if dl > cap:
                self.deadline[mid] = cap
                self.budget[mid] = limit_s

    def late(self, ids: Iterable[str] | None = None) -> list[str]:
        """Pending messages (of ``ids``, default all) past their deadline."""
        now = time.monotonic()
        wanted = self.pending if ids is None else set(ids) & self.pending
        return [m for m in wanted if now > self.deadline[m]]

    def poll(self, ids: Iterable[str] | None = None, raise_late: bool = True) -> list[Message]:
        """One ``Grid.pull_messages`` over the pending messages (or those of ``ids``):
        the replies that arrived, error replies included. ``raise_late=False``: return
        them even when another message is past its deadline (see :meth:`late`).

        Raises
        ------
        NodeError
            If the stop flag is set, or (``raise_late``) a pending message is past its
            deadline (naming its node).
        """
        if self.stop is not None and self.stop.is_set():
            raise self.error_cls("run stopped by the caller")
        wanted = self.pending if ids is None else set(ids) & self.pending
        got = list(self.grid.pull_messages(wanted)) if wanted else []
        self.ledger.answered(got)
        for reply in got:
            self.deadline.pop(reply.metadata.reply_to_message_id, None)
        late = self.late(wanted) if raise_late else []
        if late:
            budget = max(self.budget[m] for m in late)
            names = ", ".join(self.name(self.dst[m]) for m in late)
            raise self.fail(
                f"no reply within {budget:g} s from {names}", [self.dst[m] for m in late]
            )
        return got

    def wait(self, ids: Sequence[str], raise_errors: bool = True) -> list[Message]:
        """Poll until every message of ``ids`` is answered; the replies in ``ids`` order.

        Raises
        ------
        NodeError
            Past a deadline (as :meth:`poll`), or, with ``raise_errors``, if any reply is
            an error (naming every node that erred, with the reason).
        """
        got: dict[str, Message] = {}
        while len(got) < len(ids):
            for reply in self.poll([m for m in ids if m not in got]):
                got[reply.metadata.reply_to_message_id] = reply
            if len(got) < len(ids) and self.poll_interval_s > 0:
                time.sleep(self.poll_interval_s)
        replies = [got[m] for m in ids]
        if raise_errors:
            self.raise_errors(replies)
        return replies

    def wait_any(self, until: float | None = None) -> list[Message]:
        """Poll until at least one pending message is answered: the replies that arrived
        (error replies included, in arrival order). For drivers that hand out new work
        as soon as any reply is in (Hermes, ASP, SSP). Returns ``[]`` at once when nothing
        is pending, or once ``time.monotonic()`` passes ``until`` (e.g. the end of a
        wall-time budget) with no reply yet.

        Raises
        ------
        NodeError
            As :meth:`poll` (stop flag, a pending message past its deadline).
        """
        while self.deadline:
            got = self.poll()
            if got or (until is not None and time.monotonic() >= until):
                return got
            if self.poll_interval_s > 0:
                time.sleep(self.poll_interval_s)
        return []

    def raise_errors(self, replies: Sequence[Message]) -> None:
        """Raise one :class:`NodeError` naming every node whose reply is an error (the
        node the message was sent to: an error the SuperLink makes for an unavailable
        node comes from the SuperLink's own node id)."""
        bad = [r for r in replies if r.has_error()]
        if bad:
            nodes = [
                self.dst.get(r.metadata.reply_to_message_id, r.metadata.src_node_id) for r in bad
            ]
            raise self.fail(
                "; ".join(
                    f"{self.name(n)} replied with an error: {short_reason(r.error.reason)}"
                    for n, r in zip(nodes, bad, strict=True)
                ),
                nodes,
            )

    def request(self, messages: Sequence[Message], timeout_s: float | None = None) -> list[Message]:
        """Push ``messages`` and wait for all replies (in message order).

        Raises
        ------
        NodeError
            As :meth:`push`, :meth:`poll` and :meth:`wait`.
        """
        return self.wait(self.push(messages, timeout_s))
