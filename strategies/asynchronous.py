"""The asynchronous driver of Hermes and its baselines as a Flower strategy (the
baselines BSP, ASP, SSP: ``strategies/baselines.py``; Hermes: ``strategies/hermes.py``).

The driver (:class:`AsyncStrategy`) talks to workers through one
:class:`sky_flower.flower.exchange.Exchange`: each live worker gets its next
``train.hermes_round`` as soon as its last reply is in and the strategy's start rule
allows, so a fast worker never waits for a slow one unless the rule says so. Wall time
is the server's clock (``time.monotonic``), from just after the workers are connected,
benchmark round included. The per-worker book, the member set and the rules are
Flower-free (:mod:`sky_flower.hermes.server`, :mod:`sky_flower.hermes.membership`,
:mod:`sky_flower.hermes.core`); the messages are in :mod:`sky_flower.hermes.protocol`.

Membership and bad replies (:mod:`sky_flower.hermes.membership`): each round goes to the
live workers only; a worker that fails or stays silent past ``message_timeout_s`` is
removed with a warning naming it (BSP's barrier closes over the others), and the run fails
once fewer than ``min_live_workers`` are live. An update or metric holding ``NaN``/``inf``
is discarded with a warning naming the worker (:func:`sky_flower.flower.finite.check_finite`),
and so is an update whose merge would make the global model non-finite: the global model
stays finite.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARN
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from flwr.supercore import log

from sky_flower.flower.exchange import Exchange, NodeError
from sky_flower.flower.finite import NonFiniteError, check_finite
from sky_flower.flower.strategy import ServerSideEvaluation
from sky_flower.flower.vectors import vector_of, vector_record
from sky_flower.gossip.training import FlatModel
from sky_flower.hermes import protocol
from sky_flower.hermes.core import validate_settings
from sky_flower.hermes.membership import MAX_REJECTED_IN_A_ROW, Membership, wait_any
from sky_flower.hermes.server import WorkerBook, check_driver_settings


class HermesNodeError(NodeError):
    """A worker failed, timed out, or replied with something malformed; ``node_ids`` and
    ``nodes`` (``"worker <position>"``) name it."""


class AsyncStrategy(ServerSideEvaluation, Strategy):
    """The shared asynchronous driver; subclasses set the start rule and the merge.

    Parameters
    ----------
    model : FlatModel
        The model as a flat vector (same on the server and every worker).
    num_workers : int
        Workers (SuperNodes); each reports its position with ``query.hermes_hello``.
    pool_size : int
        Samples in the workers' pool; a worker's equal share is ``pool_size //
        num_workers``.
    lr : float (default: 0.1)
        SGD step size on the workers.
    batch_size : int (default: 32)
        Mini-batch size (Hermes: every worker's starting batch).
    target_accuracy : float (default: 0.9)
        Test accuracy whose first crossing is reported (``time_to_target_s``).
    stop_at_target : bool (default: True)
        End the run when the target is reached.
    max_time_s : float (default: 300.0)
        End the run after this many seconds of wall time.
    staleness : int (default: 3)
        SSP's bound (only :class:`SSPStrategy` uses it).
    seed : int (default: 0)
        Seeds the workers' shuffles.
    message_timeout_s : float (default: 120.0)
        A worker silent for longer (from the push of its message) is removed from the
        run, named by position (see ``min_live_workers``).
    min_live_workers : int, optional
        The run fails (naming the worker removed last) once fewer workers are live;
        default: all of them, so any removal fails the run.
    staleness_policy : {"discard", "keep"} (default: "discard")
        What happens to a removed worker's reply that still arrives
        (:mod:`sky_flower.hermes.membership`).
    on_event : Callable[[str, dict], None], optional
        Called with ``("update", row)`` for every change of the global model.
    poll_interval_s : float (default: 0.002)
        Pause (s) between two polls for replies (:class:`sky_flower.flower.exchange.Exchange`);
        raise it against a real SuperLink, where every poll is an RPC.

    Raises
    ------
    ValueError
        On a bad setting, at construction, before any worker is contacted.
    """

    name: ClassVar[str] = ""
    ready_hold_s, ready_limit_s = 1.0, 120.0  # the readiness barrier's (wait_until_ready)

    def __init__(  # noqa: PLR0913
        self,
        model: FlatModel,
        num_workers: int,
        pool_size: int,
        lr: float = 0.1,
        batch_size: int = 32,
        target_accuracy: float = 0.9,
        stop_at_target: bool = True,
        max_time_s: float = 300.0,
        staleness: int = 3,
        seed: int = 0,
        message_timeout_s: float = 120.0,
        on_event: Callable[[str, dict], None] | None = None,
        poll_interval_s: float = 0.002,
        min_live_workers: int | None = None,
        staleness_policy: str = "discard",
    ) -> None:
        validate_settings(staleness=staleness, target_accuracy=target_accuracy)
        check_driver_settings(num_workers, pool_size, lr, batch_size, max_time_s, poll_interval_s)
        self.members = Membership.create(int(num_workers), min_live_workers, staleness_policy)
        self.model, self.n, self.pool_size = model, int(num_workers), int(pool_size)
        self.lr, self.batch_size = float(lr), int(batch_size)
        self.target_accuracy, self.stop_at_target = float(target_accuracy), bool(stop_at_target)
        self.max_time_s, self.staleness = float(max_time_s), int(staleness)
        self.seed, self.message_timeout_s = int(seed), float(message_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self.on_event = on_event or (lambda kind, payload: None)
        self.book = WorkerBook.equal(self.n, self.pool_size, self.batch_size)
        # the book's lists by position, under the names the jobs read (same objects)
        self.data, self.batch, self.clock = self.book.data, self.book.batch, self.book.clock
        self.updates_sent, self.minor_rounds = self.book.updates_sent, self.book.minor_rounds
        self.round_times = self.book.round_times
        self.ids: list[int] = []  # node id by position
        self.slowdowns: list[float] = []
        self.timeline: list[dict[str, Any]] = []
        self.time_to_target_s: float | None = None
        self.benchmark: dict[str, Any] | None = None
        self.global_vec: np.ndarray | None = None
        self._base: list[np.ndarray | None] = [None] * self.n
        self._t0 = 0.0
        self._evaluate: Callable[[int, ArrayRecord], MetricRecord | None] | None = None
        self._exchange: Exchange | None = None
        self._stale: dict[str, int] = {}  # removed workers' messages still wanted (keep)

    # --- rules the subclasses set ------------------------------------------------------
    def start_rule(self, worker: int) -> bool:
        """Whether an idle ``worker`` may start its next round now."""
        return True

    def apply(self, worker: int, reply: Message) -> bool:
        """Take ``worker``'s reply into the global model; True if it changed."""
        raise NotImplementedError

    def prepare(self, grid: Grid) -> None:
        """Work before the first round (Hermes: the benchmark round and the sizes)."""

    def round_config(self, worker: int) -> dict[str, Any]:
        """Extra settings of ``worker``'s next round."""
        return {"gate": False}

    def sends_global(self, worker: int) -> bool:
        """Whether ``worker``'s next round carries the global model."""
        return True

    def on_reject(self, worker: int) -> bool:
        """``worker``'s reply was discarded (non-finite); True if the global model changed."""
        return False

    def on_remove(self, worker: int) -> bool:
        """``worker`` left the member set; True if the global model changed."""
        return False

    def live_clocks(self) -> list[int]:
        """Rounds completed by each live worker (the start rules compare with these)."""
        return [self.clock[w] for w in sorted(self.members.live)] or [0]

    # --- messaging ---------------------------------------------------------------------
    def _describe(self, node_id: int) -> str | None:
        return f"worker {self.ids.index(node_id)}" if node_id in self.ids else None

    def connect(self, grid: Grid) -> None:
        """Wait for the workers, order them by reported position
        (:func:`sky_flower.hermes.protocol.hello`), then hold the readiness barrier
        (:meth:`wait_until_ready`).

        Raises
        ------
        HermesNodeError
            A worker failed, reported another pool, or positions that are not exactly
            ``0 .. n - 1``.
        """
        node_ids, _ = sample_nodes(grid, self.n, self.n)
        t, p = self.message_timeout_s, self.poll_interval_s
        self._exchange = Exchange(grid, t, p, describe=self._describe, error_cls=HermesNodeError)
        self.ids, self.slowdowns = protocol.hello(self._exchange, node_ids, self.pool_size)
        self.wait_until_ready(grid, self.ready_hold_s, self.ready_limit_s)

    def wait_until_ready(self, grid: Grid, hold_s: float = 1.0, limit_s: float = 120.0) -> float:
        """Readiness barrier before the clock starts
        (:func:`sky_flower.hermes.protocol.ready_barrier`). Without it the first rounds
        would pay the simulation engine's start-up (8 fresh processes making their first
        torch calls on 2 cores: about 30 s here), charged to whichever worker and method
        came first. Returns the seconds spent."""
        assert self._exchange is not None and self._exchange.grid is grid, "connect() first"
        self.ready_s, ok = protocol.ready_barrier(self._exchange, self.ids, hold_s, limit_s)
        if ok:
            log(INFO, "all %d workers ready after %.1f s", self.n, self.ready_s)
        else:
            log(WARN, "workers never all ran at once in %.0f s: the clock starts anyway", limit_s)
        return self.ready_s

    # --- Strategy interface ------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``train.hermes_round`` for each worker listed in ``config["workers"]``;
        ``arrays`` (the global model) goes to those the strategy sends it to."""
        messages = []
        for w in [int(v) for v in config["workers"]]:  # type: ignore[union-attr]
            cfg = ConfigRecord(
                {
                    "round": self.clock[w],
                    "data": self.data[w],
                    "batch": self.batch[w],
                    "lr": self.lr,
                    "seed": self.seed,
                    **self.round_config(w),
                }
            )
            content = RecordDict({"cfg": cfg})
            if self.sends_global(w):
                content["global"] = arrays
                self._base[w] = arrays["x"].numpy().astype(np.float64)
            messages.append(
                Message(
                    content,
                    dst_node_id=self.ids[w],
                    message_type=protocol.ROUND,
                    group_id=f"{w}.{self.clock[w]}",
                )
            )
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Apply the arrived replies by the strategy's rule; return the global model (None
        if unchanged) and the accepted replies' mean training loss. A failed reply removes
        its worker (:meth:`remove`); a non-finite one, or one whose merge would make the
        global model non-finite, is discarded (:meth:`reject`); a removed worker's reply
        is taken only under ``staleness_policy="keep"``.

        Raises
        ------
        HermesNodeError
            A reply from an unknown node, or fewer than ``min_live_workers`` live.
        """
        changed, losses = False, []
        for reply in replies:
            w = self._take(reply)
            if w is None:
                continue
            before = self.global_vec
            try:
                changed = self.apply(w, reply) or changed
                check_finite(self.global_vec, f"the global model after worker {w}'s update")
            except NonFiniteError as err:
                self.global_vec = before
                changed = self.reject(w, str(err), counted=True) or changed
                continue
            self.members.accepted(w)
            losses.append(float(reply.content.metric_records["metrics"]["train_loss"]))  # type: ignore[arg-type]
        metrics = MetricRecord({"train_loss": float(np.mean(losses))}) if losses else None
        assert self.global_vec is not None
        return (vector_record("x", self.global_vec) if changed else None), metrics

    def reject(self, worker: int, reason: str, counted: bool = False) -> bool:
        """Discard ``worker``'s latest reply (non-finite; ``counted``: its round was already
        counted as sent), a warning and a row (:meth:`Membership.reject`; several in a row
        remove it). Returns whether the global model changed (BSP may close its round)."""
        self.book.reject(worker, counted)
        rnd, now = self.clock[worker] - 1, time.monotonic() - self._t0
        if self.members.reject(worker, self._name(worker), rnd, reason, now):
            return self.remove(worker, f"{MAX_REJECTED_IN_A_ROW} rejected in a row: {reason}")
        return self.on_reject(worker)

    def remove(self, worker: int, reason: str) -> bool:
        """Take ``worker`` out of the member set (a warning naming it and a row); nothing if
        it was already out. Returns whether the global model changed.

        Raises
        ------
        HermesNodeError
            Naming the worker, if fewer than ``min_live_workers`` are now live.
        """
        now = time.monotonic() - self._t0
        if not self.members.remove(worker, self._name(worker), self.clock[worker], reason, now):
            return False
        failure = self.members.failure(reason)
        if failure is not None:
            assert self._exchange is not None
            raise self._exchange.fail(failure, [self.ids[worker]])
        return self.on_remove(worker)

    def _name(self, worker: int) -> str:
        assert self._exchange is not None
        return self._exchange.name(self.ids[worker])

    def summary(self) -> None:
        """Log the settings."""
        log(INFO, "\t├── Strategy: %s, %d workers, lr %g", self.name, self.n, self.lr)
        share = self.pool_size // self.n
        log(INFO, "\t├── Equal share %d samples, batch %d", share, self.batch_size)
        acc, limit = self.target_accuracy, self.max_time_s
        log(INFO, "\t└── Target test accuracy %.3f, at most %.0f s", acc, limit)

    # --- reply bookkeeping -------------------------------------------------------------
    def _take(self, reply: Message) -> int | None:
        """Validate a round reply and count it in the book; return the worker's position,
        or None when the reply is not applied: a removed worker's (policy ``discard``), a
        failed or malformed one (the worker is removed), a non-finite one (rejected).

        Raises
        ------
        HermesNodeError
            A reply from an unknown node, or as :meth:`remove`.
        """
        ex = self._exchange
        assert ex is not None
        nid = reply.metadata.src_node_id
        if nid not in self.ids:
            raise ex.fail(f"{ex.name(nid)}: reply from an unknown node", [nid])
        w = self.ids.index(nid)
        if not self.members.keeps(w):
            return None
        try:
            ex.raise_errors([reply])
        except NodeError as err:
            self.remove(w, str(err))
            return None
        problem = protocol.round_reply_problem(reply, self.model.dim)
        if problem:
            self.remove(w, f"{ex.name(nid)}: {problem}")
            return None
        m = reply.content.metric_records["metrics"]
        sent = bool(int(m["sent"]))  # type: ignore[arg-type]
        try:
            check_finite(m, f"{ex.name(nid)}'s round metrics")
            if sent:
                check_finite(reply.content.array_records["model"], f"{ex.name(nid)}'s update")
        except NonFiniteError as err:
            self.reject(w, str(err))
            return None
        self.book.count(w, sent, float(m["train_time_s"]))  # type: ignore[arg-type]
        return w

    @staticmethod
    def model_of(reply: Message) -> np.ndarray:
        """The worker model a reply carries, float64 ``(d,)``."""
        return vector_of(reply.content, "model")

    def _record(self, event: str) -> None:
        """Evaluate the global model; add a timeline row; note the first target crossing."""
        assert self.global_vec is not None
        row: dict[str, Any] = {
            "time_s": time.monotonic() - self._t0,
            "event": event,
            "updates_applied": int(sum(self.updates_sent)),
            "worker_rounds": int(sum(self.clock)),
        }
        if self._evaluate is not None:
            res = self._evaluate(len(self.timeline), vector_record("x", self.global_vec))
            if res is not None:
                row.update({f"test_{k}": float(v) for k, v in res.items()})  # type: ignore[arg-type]
        self.timeline.append(row)
        acc = row.get("test_accuracy")
        if self.time_to_target_s is None and acc is not None and acc >= self.target_accuracy:
            self.time_to_target_s = row["time_s"]
            log(INFO, "%s reached test accuracy %.4f at %.1f s", self.name, acc, row["time_s"])
        self.on_event("update", row)

    # --- the run -----------------------------------------------------------------------
    def start(  # noqa: PLR0913
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 1000,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run until the target test accuracy (with ``stop_at_target``), ``max_time_s``
        of wall time, or every worker has done ``num_rounds`` rounds.

        ``initial_arrays`` holds ``"x"``, the initial flat model. ``evaluate_fn(k,
        vector_record("x", G))`` evaluates the global model (test accuracy) after every
        change; ``self.timeline`` gets one row per change (``time_s``, ``event``,
        ``updates_applied``, ``worker_rounds``, ``test_*``).

        Raises
        ------
        HermesNodeError
            A worker failed; ``self.timeline`` keeps the rows done.
        """
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        self.summary()
        self._evaluate = evaluate_fn
        self.global_vec = initial_arrays["x"].numpy().astype(np.float64)
        self.connect(grid)
        self._t0 = time.monotonic()
        self.prepare(grid)
        self._record("start")
        result = Result(arrays=initial_arrays)
        assert self._exchange is not None
        self._rounds(grid, num_rounds, result)
        wall = time.monotonic() - self._t0
        self._settle()  # rounds still running: not applied; a silent worker is removed
        sent, minor = sum(self.updates_sent), sum(self.minor_rounds)
        text = "%s finished after %.1f s: %d updates sent, %d minor rounds, %s, test accuracy %s"
        acc = self.timeline[-1].get("test_accuracy")
        log(INFO, text, self.name, wall, sent, minor, self.members.summary(), acc)
        self.wall_time_s = wall  # set only once the run has ended (the jobs check it)
        return result

    def _done(self) -> bool:
        if self.stop_at_target and self.time_to_target_s is not None:
            return True
        return time.monotonic() - self._t0 > self.max_time_s

    def _rounds(self, grid: Grid, num_rounds: int, result: Result) -> None:
        """The asynchronous loop: every idle live worker the start rule lets go gets its
        next round at once; replies are applied as they arrive; a worker past its
        message's deadline is removed (:meth:`remove`)."""
        ex = self._exchange
        assert ex is not None and self.global_vec is not None
        in_flight: dict[str, int] = {}  # message id -> worker
        step = 0
        while not self._done():
            busy = set(in_flight.values())
            ready = [
                w
                for w in sorted(self.members.live)
                if w not in busy and self.clock[w] < num_rounds and self.start_rule(w)
            ]
            if ready:
                g = vector_record("x", self.global_vec)
                msgs = list(self.configure_train(step, g, ConfigRecord({"workers": ready}), grid))
                in_flight.update(zip(ex.push(msgs), ready, strict=True))
            if not in_flight:
                break  # every live worker has done num_rounds rounds
            replies, late = wait_any(ex, self._stale, self._t0 + self.max_time_s)
            changed, event = False, ""
            for mid in late:
                w = in_flight.pop(mid)
                if self._remove_late(mid):
                    changed, event = True, f"worker {w} removed"
            for reply in replies:
                in_flight.pop(reply.metadata.reply_to_message_id, None)
                self._stale.pop(reply.metadata.reply_to_message_id, None)
            if replies:
                step += 1
                arrays, metrics = self.aggregate_train(step, replies)
                if metrics is not None:
                    result.train_metrics_clientapp[step] = metrics
                if arrays is not None:
                    changed = True
                    event = f"update from {ex.name(replies[-1].metadata.src_node_id)}"
            if changed:
                result.arrays = vector_record("x", self.global_vec)
                self._record(event)

    def _remove_late(self, mid: str) -> bool:
        """Remove the worker of message ``mid`` (past its deadline); under ``keep`` its
        reply is still wanted. Returns whether the global model changed."""
        ex = self._exchange
        assert ex is not None
        w = self.ids.index(ex.dst[mid])
        if self.members.staleness_policy == "keep":
            self._stale[mid] = w
        return self.remove(w, f"no reply within {ex.budget[mid]:g} s from {ex.name(ex.dst[mid])}")

    def _settle(self) -> None:
        """After the last round: wait for the rounds still running (not applied); a worker
        past its deadline is removed, as in the loop (:meth:`remove` may raise)."""
        assert self._exchange is not None
        while self._exchange.pending:
            self._stale.clear()
            for mid in wait_any(self._exchange, {}, math.inf)[1]:
                self._remove_late(mid)
        self._stale.clear()

    def worker_rows(self) -> list[dict[str, Any]]:
        """Per worker: slowdown, share, batch, rounds, updates sent, minor rounds, median
        round time."""
        return self.book.rows(self.slowdowns)
