"""Hermes and its baselines (BSP, ASP, SSP) as Flower strategies on one asynchronous driver.

Hermes: Basani, Vivek, Krishna, Paul, "When Less is More: Achieving Faster Convergence in
Distributed Edge Machine Learning" (HiPC 2024, arXiv 2410.20495). Its rules live in the
pure core :mod:`sky_flower.hermes.core`; this module is the Flower side.

The driver (:class:`AsyncStrategy`) talks to workers with ``Grid.push_messages`` /
``pull_messages`` only: each worker gets its next ``train.hermes_round`` as soon as its
last reply is in and the strategy's start rule allows, so a fast worker never waits for a
slow one unless the rule says so. Wall time is the server's clock (``time.monotonic``),
from just after the workers are connected, benchmark round included.

==========  =====================================================================
``hermes``  benchmark round, per-worker sizes by the dual binary search, re-searched for
            a worker that turns straggler; workers send only significant updates
            (``z <= threshold``); the server merges each with the loss-weighted rule,
            losses on its own validation split. A worker that sent gets the new global
            model in its next round; after a minor round it goes on from its own model.
``bsp``     synchronous FedAvg: every worker waits for the slowest, models averaged
            weighted by examples
``asp``     each update ``(g_i - base_i) / n`` applied on arrival, never waits
``ssp``     as ASP, but a worker more than ``staleness`` rounds ahead of the slowest waits
==========  =====================================================================

Usage (ServerApp side)::

    strategy = HermesStrategy(model=FlatModel(32), num_workers=8, pool_size=1037,
                              val_loss_fn=server_val_loss)
    strategy.start(grid=grid, initial_arrays=vector_record("x", x0), num_rounds=500,
                   evaluate_fn=central_evaluate)
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

from sky_flower.gossip.client import vector_record
from sky_flower.gossip.training import FlatModel
from sky_flower.hermes.core import (
    Sizes,
    StepTimeModel,
    apply_delta,
    fedavg,
    is_straggler,
    loss_weighted_merge,
    may_start,
    search_sizes,
    target_round_s,
    validate_settings,
)


class HermesNodeError(RuntimeError):
    """A worker failed, timed out, or replied with something malformed (named in the text)."""


class AsyncStrategy(Strategy):
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
        A worker silent for longer fails the run, by position.
    on_event : Callable[[str, dict], None], optional
        Called with ``("update", row)`` for every change of the global model.

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
    ) -> None:
        validate_settings(staleness=staleness, target_accuracy=target_accuracy)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 1 <= batch_size <= pool_size // num_workers:
            raise ValueError(
                f"batch_size={batch_size} must be in [1, {pool_size // num_workers}] "
                "(a worker's equal share)"
            )
        if not max_time_s > 0:
            raise ValueError(f"max_time_s must be > 0, got {max_time_s}")
        self.model, self.n, self.pool_size = model, int(num_workers), int(pool_size)
        self.lr, self.batch_size = float(lr), int(batch_size)
        self.target_accuracy, self.stop_at_target = float(target_accuracy), bool(stop_at_target)
        self.max_time_s, self.staleness = float(max_time_s), int(staleness)
        self.seed, self.message_timeout_s = int(seed), float(message_timeout_s)
        self.on_event = on_event or (lambda kind, payload: None)
        equal = self.pool_size // self.n
        self.data = [equal] * self.n  # per-worker share and batch, by position
        self.batch = [self.batch_size] * self.n
        self.ids: list[int] = []  # node id by position
        self.slowdowns: list[float] = []
        self.clock = [0] * self.n  # rounds completed
        self.updates_sent = [0] * self.n
        self.minor_rounds = [0] * self.n
        self.round_times: list[list[float]] = [[] for _ in range(self.n)]
        self.timeline: list[dict[str, Any]] = []
        self.time_to_target_s: float | None = None
        self.benchmark: dict[str, Any] | None = None
        self.global_vec: np.ndarray | None = None
        self._base: list[np.ndarray | None] = [None] * self.n
        self._t0 = 0.0
        self._evaluate: Callable[[int, ArrayRecord], MetricRecord | None] | None = None

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
    def _where(self, node_id: int) -> str:
        pos = self.ids.index(node_id) if node_id in self.ids else "?"
        return f"worker {pos} (node {node_id})"

    def _check(self, reply: Message) -> Message:
        if reply.has_error():
            raise HermesNodeError(
                f"{self._where(reply.metadata.src_node_id)}: {reply.error.reason}"
            )
        return reply

    def exchange(self, grid: Grid, messages: list[Message]) -> list[Message]:
        """Push ``messages``; return the replies in message order.

        Raises
        ------
        HermesNodeError
            Naming the worker(s) that timed out or replied with an error.
        """
        ids = list(grid.push_messages(messages))
        pending, got = set(ids), {}
        deadline = time.monotonic() + self.message_timeout_s
        while pending and time.monotonic() < deadline:
            for reply in grid.pull_messages(pending):
                got[reply.metadata.reply_to_message_id] = reply
                pending.discard(reply.metadata.reply_to_message_id)
            if pending:
                time.sleep(0.002)
        if pending:
            raise HermesNodeError(f"no reply within {self.message_timeout_s:g} s")
        return [self._check(got[m]) for m in ids]

    def connect(self, grid: Grid) -> None:
        """Wait for the workers and order them by reported position.

        Raises
        ------
        HermesNodeError
            Positions that are not exactly ``0 .. n - 1``.
        """
        node_ids, _ = sample_nodes(grid, self.n, self.n)
        hello = [
            Message(RecordDict(), dst_node_id=nid, message_type="query.hermes_hello")
            for nid in node_ids
        ]
        by_pos: dict[int, tuple[int, float]] = {}
        for reply in self.exchange(grid, hello):
            m = reply.content.metric_records["metrics"]
            pool = int(m["pool"])  # type: ignore[arg-type]
            if pool != self.pool_size:
                raise HermesNodeError(
                    f"{reply.metadata.src_node_id}: pool of {pool}, expected {self.pool_size}"
                )
            by_pos[int(m["position"])] = (reply.metadata.src_node_id, float(m["slowdown"]))  # type: ignore[arg-type]
        if sorted(by_pos) != list(range(self.n)):
            raise HermesNodeError(
                f"workers reported positions {sorted(by_pos)}, expected 0..{self.n - 1}"
            )
        self.ids = [by_pos[i][0] for i in range(self.n)]
        self.slowdowns = [by_pos[i][1] for i in range(self.n)]
        self.wait_until_ready(grid)

    def wait_until_ready(self, grid: Grid, hold_s: float = 1.0, limit_s: float = 120.0) -> float:
        """Readiness barrier before the clock starts: ask every worker to warm up and hold
        for ``hold_s`` at once, until all answer within ``1.6 x hold_s`` (so all ran in one
        wave, in parallel, already warm). Without it the first rounds would pay the
        simulation engine's start-up (8 fresh processes making their first torch calls
        on 2 cores: about 30 s here), charged to whichever worker and method came first.
        Returns the seconds spent."""
        t0 = time.monotonic()
        cfg = ConfigRecord({"hold_s": hold_s})
        while time.monotonic() - t0 < limit_s:
            msgs = [
                Message(
                    RecordDict({"cfg": cfg}), dst_node_id=nid, message_type="query.hermes_hello"
                )
                for nid in self.ids
            ]
            t = time.monotonic()
            self.exchange(grid, msgs)
            if time.monotonic() - t < 1.6 * hold_s:
                break
        self.ready_s = time.monotonic() - t0
        if time.monotonic() - t >= 1.6 * hold_s:
            log(WARN, "workers never all ran at once in %.0f s: the clock starts anyway", limit_s)
        else:
            log(INFO, "all %d workers ready after %.1f s", self.n, self.ready_s)
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
                    message_type="train.hermes_round",
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

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """None: the global model is evaluated on the server (``evaluate_fn``)."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """None (no federated evaluation)."""
        return None

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
        """Validate a round reply, count it; return the worker's position."""
        reply = self._check(reply)
        nid = reply.metadata.src_node_id
        if nid not in self.ids:
            raise HermesNodeError(f"reply from unknown node {nid}")
        w = self.ids.index(nid)
        m = reply.content.metric_records.get("metrics")
        if m is None or "sent" not in m or "train_time_s" not in m:
            raise HermesNodeError(f"{self._where(nid)}: malformed round reply (no metrics)")
        sent = bool(int(m["sent"]))  # type: ignore[arg-type]
        rec = reply.content.array_records.get("model")
        if sent and (rec is None or "x" not in rec or rec["x"].shape != (self.model.dim,)):
            raise HermesNodeError(f"{self._where(nid)}: malformed model in its round reply")
        if not sent and rec is not None:
            raise HermesNodeError(f"{self._where(nid)}: a minor round must carry no weights")
        self.clock[w] += 1
        self.round_times[w].append(float(m["train_time_s"]))  # type: ignore[arg-type]
        if sent:
            self.updates_sent[w] += 1
        else:
            self.minor_rounds[w] += 1
        return w

    @staticmethod
    def model_of(reply: Message) -> np.ndarray:
        """The worker model a reply carries."""
        return reply.content.array_records["model"]["x"].numpy().astype(np.float64)

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
    def start(  # noqa: PLR0913, PLR0912
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
        in_flight: dict[str, int] = {}
        busy = [False] * self.n
        step = 0

        def done() -> bool:
            if self.stop_at_target and self.time_to_target_s is not None:
                return True
            return time.monotonic() - self._t0 > self.max_time_s

        while not done():
            ready = [
                w
                for w in range(self.n)
                if not busy[w] and self.clock[w] < num_rounds and self.start_rule(w)
            ]
            if ready:
                g = vector_record("x", self.global_vec)
                msgs = list(self.configure_train(step, g, ConfigRecord({"workers": ready}), grid))
                for mid, w in zip(grid.push_messages(msgs), ready, strict=True):
                    in_flight[mid] = w
                    busy[w] = True
            if not in_flight:
                break  # every worker has done num_rounds rounds
            replies = list(grid.pull_messages(list(in_flight)))
            if not replies:
                time.sleep(0.002)
                continue
            step += 1
            for reply in replies:
                busy[in_flight.pop(reply.metadata.reply_to_message_id)] = False
            arrays, metrics = self.aggregate_train(step, replies)
            if metrics is not None:
                result.train_metrics_clientapp[step] = metrics
            if arrays is not None:
                result.arrays = arrays
                self._record(f"update from {self._where(replies[-1].metadata.src_node_id)}")
        wall = time.monotonic() - self._t0
        self._drain(grid, in_flight)
        log(
            INFO,
            "%s finished after %.1f s: %d updates sent, %d minor rounds, test accuracy %s",
            self.name,
            wall,
            sum(self.updates_sent),
            sum(self.minor_rounds),
            self.timeline[-1].get("test_accuracy"),
        )
        self.wall_time_s = wall
        return result

    def _drain(self, grid: Grid, in_flight: dict[str, int]) -> None:
        """Wait for the rounds still running (their updates are not applied)."""
        deadline = time.monotonic() + self.message_timeout_s
        while in_flight and time.monotonic() < deadline:
            for reply in grid.pull_messages(list(in_flight)):
                in_flight.pop(reply.metadata.reply_to_message_id, None)
            time.sleep(0.005)

    def worker_rows(self) -> list[dict[str, Any]]:
        """Per worker: slowdown, share, batch, rounds, updates sent, minor rounds, median
        round time."""
        return [
            {
                "worker": w,
                "slowdown": self.slowdowns[w] if self.slowdowns else None,
                "data": self.data[w],
                "batch": self.batch[w],
                "rounds": self.clock[w],
                "updates_sent": self.updates_sent[w],
                "minor_rounds": self.minor_rounds[w],
                "median_round_s": float(np.median(self.round_times[w]))
                if self.round_times[w]
                else None,
            }
            for w in range(self.n)
        ]


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


class HermesStrategy(AsyncStrategy):
    """Hermes (arXiv 2410.20495): speed-aware dataset and batch sizes, the
    significant-update gate on the workers, loss-weighted aggregation on the server.

    Extra parameters (the rest as :class:`AsyncStrategy`)
    ------------------------------------------------------
    val_loss_fn : Callable[[np.ndarray], float]
        Loss of a flat model on the server's validation split (never the test split).
    window, threshold, patience, relax : (default: 10, -1.3, 5, 0.1)
        The gate (:class:`sky_flower.hermes.core.SignificanceGate`; lambda, beta).
    profile_batches : tuple of int (default: (8, 32, 128))
        Batch sizes timed on every worker in the benchmark round.
    profile_repeats : int (default: 3)
        Timed steps per batch size.
    batch_range : (int, int) (default: (8, 128))
        Batches the search may choose.
    min_data : int (default: 8)
        Smallest share the search may choose (the largest is the whole pool).
    straggler_tolerance : float (default: 0.1)
        A straggler by the IQR fences is re-searched only if its round is also more than
        this fraction off the target (our addition: once rounds are balanced the fences
        are a few ms wide and would flag timer jitter).
    """

    name = "hermes"

    def __init__(  # noqa: PLR0913
        self,
        *args: Any,
        val_loss_fn: Callable[[np.ndarray], float],
        window: int = 10,
        threshold: float = -1.3,
        patience: int = 5,
        relax: float = 0.1,
        profile_batches: tuple[int, ...] = (8, 32, 128),
        profile_repeats: int = 3,
        batch_range: tuple[int, int] = (8, 128),
        min_data: int = 8,
        straggler_tolerance: float = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        validate_settings(window=window, threshold=threshold, patience=patience, relax=relax)
        if not 1 <= batch_range[0] <= self.batch_size <= batch_range[1]:
            raise ValueError(f"batch_size {self.batch_size} must lie in batch_range {batch_range}")
        if not 1 <= min_data <= self.pool_size:
            raise ValueError(f"min_data must be in [1, {self.pool_size}], got {min_data}")
        self.val_loss_fn = val_loss_fn
        self.gate = {"window": window, "threshold": threshold, "patience": patience, "relax": relax}
        self.profile_batches, self.profile_repeats = tuple(profile_batches), int(profile_repeats)
        self.batch_range, self.min_data = (int(batch_range[0]), int(batch_range[1])), int(min_data)
        self.step_models: list[StepTimeModel] = []
        self.sizes: list[Sizes] = []
        self.target_s = 0.0
        self.searches = [0] * self.n  # size searches per worker (the first included)
        self.straggler_events = [0] * self.n
        self.straggler_tolerance = float(straggler_tolerance)
        self._fresh = [True] * self.n  # next round carries the global model
        self._global_loss: float | None = None

    def prepare(self, grid: Grid) -> None:
        """The benchmark round: time steps at ``profile_batches`` on every worker, fit each
        worker's step time, set the target to the median worker's round at equal shares,
        and search every worker's sizes."""
        cfg = ConfigRecord({"batches": list(self.profile_batches), "repeats": self.profile_repeats})
        msgs = [
            Message(RecordDict({"cfg": cfg}), dst_node_id=nid, message_type="query.hermes_profile")
            for nid in self.ids
        ]
        measured = []
        for reply in self.exchange(grid, msgs):
            m = reply.content.metric_records["metrics"]
            measured.append((list(m["batches"]), list(m["seconds"])))  # type: ignore[arg-type]
        self.step_models = [StepTimeModel.fit(b, s) for b, s in measured]
        self.target_s = target_round_s(self.step_models, self.data, self.batch)
        for w in range(self.n):
            self._search(w)
        self.benchmark = {
            "target_round_s": self.target_s,
            "workers": [
                {
                    "worker": w,
                    "slowdown": self.slowdowns[w],
                    "batches": measured[w][0],
                    "step_seconds": measured[w][1],
                    "overhead_s": self.step_models[w].overhead_s,
                    "per_sample_s": self.step_models[w].per_sample_s,
                }
                for w in range(self.n)
            ],
        }
        log(INFO, "Hermes target round %.3f s; sizes (share, batch, predicted s):", self.target_s)
        for w, s in enumerate(self.sizes):
            log(
                INFO,
                "  worker %d (slowdown %g): %5d %4d %7.3f",
                w,
                self.slowdowns[w],
                s.data,
                s.batch,
                s.predicted_s,
            )

    def _search(self, w: int) -> None:
        sizes = search_sizes(
            self.step_models[w],
            self.target_s,
            self.batch_size,
            (self.min_data, self.pool_size),
            self.batch_range,
        )
        if len(self.sizes) <= w:
            self.sizes.append(sizes)
        else:
            self.sizes[w] = sizes
        self.data[w], self.batch[w] = sizes.data, sizes.batch
        self.searches[w] += 1

    def round_config(self, worker: int) -> dict[str, Any]:
        """The gate's settings."""
        return {"gate": True, **self.gate}

    def sends_global(self, worker: int) -> bool:
        """Only after the worker's update was merged (or on its first round)."""
        return self._fresh[worker]

    def apply(self, worker: int, reply: Message) -> bool:
        """Merge a significant update by the loss-weighted rule; after any round, redo the
        worker's sizes if its round time is an outlier of the others' latest."""
        m = reply.content.metric_records["metrics"]
        self._check_straggler(worker)
        if not int(m["sent"]):  # type: ignore[arg-type]
            self._fresh[worker] = False
            return False
        assert self.global_vec is not None
        update = self.model_of(reply)
        if self._global_loss is None:
            self._global_loss = self.val_loss_fn(self.global_vec)
        self.global_vec = loss_weighted_merge(
            self.global_vec, self._global_loss, update, self.val_loss_fn(update)
        )
        self._global_loss = self.val_loss_fn(self.global_vec)
        self._fresh[worker] = True
        return True

    def _check_straggler(self, worker: int) -> None:
        if any(not t for t in self.round_times):
            return  # not every worker has a round time yet
        latest = [t[-1] for t in self.round_times]
        if not is_straggler(latest, worker):
            return
        self.straggler_events[worker] += 1
        if abs(latest[worker] / self.target_s - 1) <= self.straggler_tolerance:
            return  # balanced rounds make the fences tight: ignore jitter near the target
        # the worker's measured step time against the fitted one: rescale, search again
        predicted = self.step_models[worker].round_s(self.data[worker], self.batch[worker])
        self.step_models[worker] = self.step_models[worker].scaled(latest[worker] / predicted)
        old = (self.data[worker], self.batch[worker])
        self._search(worker)
        log(
            INFO,
            "worker %d is a straggler (%.3f s vs target %.3f s): sizes %s -> %s",
            worker,
            latest[worker],
            self.target_s,
            old,
            (self.data[worker], self.batch[worker]),
        )


STRATEGIES: dict[str, type[AsyncStrategy]] = {
    cls.name: cls for cls in (HermesStrategy, BSPStrategy, ASPStrategy, SSPStrategy)
}
