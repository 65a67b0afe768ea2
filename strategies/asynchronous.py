"""The asynchronous driver of Hermes and its baselines, and the baselines BSP, ASP, SSP,
as Flower strategies (Hermes itself: ``strategies/hermes.py``).

The driver (:class:`AsyncStrategy`) talks to workers through one
:class:`sky_flower.flower.exchange.Exchange`: each worker gets its next
``train.hermes_round`` as soon as its last reply is in and the strategy's start rule
allows, so a fast worker never waits for a slow one unless the rule says so. Wall time
is the server's clock (``time.monotonic``), from just after the workers are connected,
benchmark round included. The per-worker book and the rules are Flower-free
(:mod:`sky_flower.hermes.server`, :mod:`sky_flower.hermes.core`); the messages are in
:mod:`sky_flower.hermes.protocol`.

=======  ===========================================================================
``bsp``  synchronous FedAvg: every worker waits for the slowest, models averaged
         weighted by examples
``asp``  each update ``(g_i - base_i) / n`` applied on arrival, never waits
``ssp``  as ASP, but a worker more than ``staleness`` rounds ahead of the slowest waits
=======  ===========================================================================
"""

from __future__ import annotations

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
from sky_flower.flower.strategy import ServerSideEvaluation
from sky_flower.flower.vectors import vector_of, vector_record
from sky_flower.gossip.training import FlatModel
from sky_flower.hermes import protocol
from sky_flower.hermes.core import apply_delta, fedavg, may_start, validate_settings
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
        A worker silent for longer (from the push of its message) fails the run, by
        position.
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
    ) -> None:
        validate_settings(staleness=staleness, target_accuracy=target_accuracy)
        check_driver_settings(num_workers, pool_size, lr, batch_size, max_time_s, poll_interval_s)
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
        self._exchange = Exchange(
            grid,
            self.message_timeout_s,
            self.poll_interval_s,
            describe=self._describe,
            error_cls=HermesNodeError,
        )
        self.ids, self.slowdowns = protocol.hello(self._exchange, node_ids, self.pool_size)
        self.wait_until_ready(grid)

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
        if unchanged) and the replies' mean training loss."""
        changed, losses = False, []
        for reply in replies:
            w = self._take(reply)
            losses.append(float(reply.content.metric_records["metrics"]["train_loss"]))  # type: ignore[arg-type]
            changed = self.apply(w, reply) or changed
        metrics = MetricRecord({"train_loss": float(np.mean(losses))}) if losses else None
        assert self.global_vec is not None
        return (vector_record("x", self.global_vec) if changed else None), metrics

    def summary(self) -> None:
        """Log the settings."""
        log(INFO, "\t├── Strategy: %s, %d workers, lr %g", self.name, self.n, self.lr)
        log(
            INFO,
            "\t├── Equal share %d samples, batch %d",
            self.pool_size // self.n,
            self.batch_size,
        )
        log(
            INFO,
            "\t└── Target test accuracy %.3f, at most %.0f s",
            self.target_accuracy,
            self.max_time_s,
        )

    # --- reply bookkeeping -------------------------------------------------------------
    def _take(self, reply: Message) -> int:
        """Validate a round reply, count it in the book; return the worker's position.

        Raises
        ------
        HermesNodeError
            An error reply, a reply from an unknown node, or a malformed one
            (:func:`sky_flower.hermes.protocol.round_reply_problem`).
        """
        assert self._exchange is not None
        self._exchange.raise_errors([reply])
        nid = reply.metadata.src_node_id
        problem = "reply from an unknown node" if nid not in self.ids else None
        problem = problem or protocol.round_reply_problem(reply, self.model.dim)
        if problem:
            raise self._exchange.fail(f"{self._exchange.name(nid)}: {problem}", [nid])
        m = reply.content.metric_records["metrics"]
        w = self.ids.index(nid)
        self.book.count(w, bool(int(m["sent"])), float(m["train_time_s"]))  # type: ignore[arg-type]
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
        self._exchange.drain(self.message_timeout_s)  # rounds still running: not applied
        log(
            INFO,
            "%s finished after %.1f s: %d updates sent, %d minor rounds, test accuracy %s",
            self.name,
            wall,
            sum(self.updates_sent),
            sum(self.minor_rounds),
            self.timeline[-1].get("test_accuracy"),
        )
        self.wall_time_s = wall  # set only once the run has ended (the jobs check it)
        return result

    def _done(self) -> bool:
        if self.stop_at_target and self.time_to_target_s is not None:
            return True
        return time.monotonic() - self._t0 > self.max_time_s

    def _rounds(self, grid: Grid, num_rounds: int, result: Result) -> None:
        """The asynchronous loop: every idle worker the start rule lets go gets its next
        round at once; replies are applied as they arrive."""
        assert self._exchange is not None and self.global_vec is not None
        in_flight: dict[str, int] = {}  # message id -> worker
        step = 0
        while not self._done():
            busy = set(in_flight.values())
            ready = [
                w
                for w in range(self.n)
                if w not in busy and self.clock[w] < num_rounds and self.start_rule(w)
            ]
            if ready:
                g = vector_record("x", self.global_vec)
                msgs = list(self.configure_train(step, g, ConfigRecord({"workers": ready}), grid))
                in_flight.update(zip(self._exchange.push(msgs), ready, strict=True))
            if not in_flight:
                break  # every worker has done num_rounds rounds
            replies = self._exchange.wait_any(until=self._t0 + self.max_time_s)
            if not replies:
                continue
            step += 1
            for reply in replies:
                del in_flight[reply.metadata.reply_to_message_id]
            arrays, metrics = self.aggregate_train(step, replies)
            if metrics is not None:
                result.train_metrics_clientapp[step] = metrics
            if arrays is not None:
                result.arrays = arrays
                self._record(f"update from {self._exchange.name(replies[-1].metadata.src_node_id)}")

    def worker_rows(self) -> list[dict[str, Any]]:
        """Per worker: slowdown, share, batch, rounds, updates sent, minor rounds, median
        round time."""
        return self.book.rows(self.slowdowns)


class BSPStrategy(AsyncStrategy):
    """Bulk-synchronous parallel: synchronous FedAvg (McMahan et al., AISTATS 2017) on the
    same fleet. Every worker waits for the slowest; the models are averaged, weighted by
    examples. See :class:`AsyncStrategy` for the parameters."""

    name = "bsp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[int, np.ndarray] = {}

    def start_rule(self, worker: int) -> bool:
        """The barrier: start only when no worker is behind (staleness 0)."""
        return may_start(self.clock[worker], self.clock, 0)

    def apply(self, worker: int, reply: Message) -> bool:
        """Hold the model until every worker has replied, then average."""
        self._pending[worker] = self.model_of(reply)
        if len(self._pending) < self.n:
            return False
        order = sorted(self._pending)
        self.global_vec = fedavg([self._pending[w] for w in order], [self.data[w] for w in order])
        self._pending.clear()
        return True


class ASPStrategy(AsyncStrategy):
    """Asynchronous parallel: each worker's progress ``(g_i - base_i) / n`` is applied on
    arrival (``base_i``: the global model it started from); nobody waits."""

    name = "asp"

    def apply(self, worker: int, reply: Message) -> bool:
        """Apply the delta (:func:`sky_flower.hermes.core.apply_delta`)."""
        base = self._base[worker]
        assert base is not None and self.global_vec is not None
        self.global_vec = apply_delta(self.global_vec, self.model_of(reply), base, self.n)
        return True


class SSPStrategy(ASPStrategy):
    """Stale-synchronous parallel (Ho et al., NeurIPS 2013): ASP's update on arrival, but a
    worker more than ``staleness`` rounds ahead of the slowest waits."""

    name = "ssp"

    def start_rule(self, worker: int) -> bool:
        """Bounded staleness (:func:`sky_flower.hermes.core.may_start`)."""
        return may_start(self.clock[worker], self.clock, self.staleness)
