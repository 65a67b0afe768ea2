"""Hermes as a Flower strategy on the asynchronous driver of ``strategies/asynchronous.py``,
and the registry of Hermes and its baselines (BSP, ASP, SSP) by name.

Hermes: Basani, Vivek, Krishna, Paul, "When Less is More: Achieving Faster Convergence in
Distributed Edge Machine Learning" (HiPC 2024, arXiv 2410.20495). Its rules live in the
pure core :mod:`sky_flower.hermes.core`; this module is the Flower side.

Each worker gets its next ``train.hermes_round`` as soon as its last reply is in and the
strategy's start rule allows (:class:`AsyncStrategy`). The sizing and the merge are
Flower-free (:mod:`sky_flower.hermes.server`).

==========  =====================================================================
``hermes``  per-worker sizes by the dual binary search from step times fitted on the
            first training rounds (or a benchmark round), refitted every round,
            re-searched for a worker that turns straggler; workers send only significant updates
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
from collections.abc import Callable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid
from flwr.supercore import log
from sky_flower.strategies.asynchronous import AsyncStrategy, HermesNodeError
from sky_flower.strategies.baselines import ASPStrategy, BSPStrategy, SSPStrategy

from sky_flower.hermes import protocol
from sky_flower.hermes.core import Sizes, validate_settings
from sky_flower.hermes.server import HermesSizing, LossWeightedMerger

__all__ = [
    "STRATEGIES",
    "ASPStrategy",
    "AsyncStrategy",
    "BSPStrategy",
    "HermesNodeError",
    "HermesStrategy",
    "SSPStrategy",
]


class HermesStrategy(AsyncStrategy):
    """Hermes (arXiv 2410.20495): speed-aware dataset and batch sizes, the
    significant-update gate on the workers, loss-weighted aggregation on the server.

    Extra parameters (the rest as :class:`AsyncStrategy`)
    ------------------------------------------------------
    val_loss_fn : Callable[[np.ndarray], float]
        Loss of a flat model on the server's validation split (never the test split).
    window, threshold, patience, relax : (default: 10, -1.3, 5, 0.1)
        The gate (:class:`sky_flower.hermes.core.SignificanceGate`; lambda, beta).
    step_model : str (default: "training")
        Where the step-time model comes from: ``"training"``, the first training rounds'
        own steps (they cycle through ``profile_batches``; every worker trains at its
        equal share until all have timed two step sizes, then the sizes are searched;
        refitted from every round after), so no time is spent outside training;
        ``"benchmark"``, the separate benchmark round before training (the original).
    profile_batches : tuple of int (default: (8, 32, 128))
        Batch sizes timed on every worker (benchmark round, or the first rounds' cycle).
    profile_repeats : int (default: 3)
        Timed steps per batch size in the benchmark round.
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
        step_model: str = "training",
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
        if step_model not in ("training", "benchmark"):
            raise ValueError(f"step_model must be 'training' or 'benchmark', got {step_model!r}")
        self.val_loss_fn, self.step_model = val_loss_fn, step_model
        self.gate = {"window": window, "threshold": threshold, "patience": patience, "relax": relax}
        self.profile_batches, self.profile_repeats = tuple(profile_batches), int(profile_repeats)
        self.sizing = HermesSizing(
            self.book,
            self.batch_size,
            (int(min_data), self.pool_size),
            (int(batch_range[0]), int(batch_range[1])),
            float(straggler_tolerance),
        )
        self.merger = LossWeightedMerger(val_loss_fn)
        self._fresh = [True] * self.n  # next round carries the global model

    # the sizing's results, as the jobs read them
    @property
    def sizes(self) -> list[Sizes]:
        """Each worker's searched sizes (with the predicted round time)."""
        return self.sizing.sizes

    @property
    def target_s(self) -> float:
        """The target round time (s) of the benchmark round."""
        return self.sizing.target_s

    @property
    def searches(self) -> list[int]:
        """Size searches per worker (the first included)."""
        return self.sizing.searches

    @property
    def straggler_events(self) -> list[int]:
        """Times each worker was a straggler by the IQR fences."""
        return self.sizing.straggler_events

    def prepare(self, grid: Grid) -> None:
        """With ``step_model="training"`` nothing (the sizes come from the first rounds,
        :meth:`apply`). Else the benchmark round
        (:func:`sky_flower.hermes.protocol.profile`): time steps at ``profile_batches``
        on every worker, fit each worker's step time, set the target to the median
        worker's round at equal shares, and search every worker's sizes
        (:class:`sky_flower.hermes.server.HermesSizing`)."""
        assert self._exchange is not None and self._exchange.grid is grid
        if self.step_model == "training":
            log(INFO, "Hermes: step times fitted from the first training rounds")
            return
        measured = protocol.profile(
            self._exchange, self.ids, self.profile_batches, self.profile_repeats
        )
        self.sizing.plan(measured)
        self.benchmark = self.sizing.benchmark(self.slowdowns, measured)
        self._log_sizes()

    def _plan_from_training(self) -> None:
        """Search the sizes from the training rounds' step timings (all workers have two
        step sizes); the benchmark record says where the fit came from."""
        measured = [
            tuple(map(list, zip(*obs, strict=True))) if obs else ([], [])
            for obs in self.sizing.observed
        ]
        self.sizing.plan_from_training()
        self.benchmark = {
            "source": "training rounds",
            "at_s": time.monotonic() - self._t0,
            **self.sizing.benchmark(self.slowdowns, measured),  # type: ignore[arg-type]
        }
        self._log_sizes()

    def _log_sizes(self) -> None:
        log(INFO, "Hermes target round %.3f s; sizes (share, batch, predicted s):", self.target_s)
        for w, sz in enumerate(self.sizes):
            log(
                INFO,
                "  worker %d (slowdown %g): %5d %4d %7.3f",
                w,
                self.slowdowns[w],
                sz.data,
                sz.batch,
                sz.predicted_s,
            )

    def round_config(self, worker: int) -> dict[str, Any]:
        """The gate's settings; before the sizes are searched (``step_model="training"``)
        the step sizes to cycle through."""
        if self.step_model == "training" and not self.sizing.planned:
            return {"gate": True, **self.gate, "batch_cycle": list(self.profile_batches)}
        return {"gate": True, **self.gate}

    def sends_global(self, worker: int) -> bool:
        """Only after the worker's update was merged (or on its first round)."""
        return self._fresh[worker]

    def on_reject(self, worker: int) -> bool:
        """A discarded update: the worker's next round carries the global model (its own
        model is not finite, or its merge would not be)."""
        self._fresh[worker] = True
        return False

    def apply(self, worker: int, reply: Message) -> bool:
        """Merge a significant update by the loss-weighted rule (raises
        :class:`sky_flower.flower.finite.NonFiniteError` on a non-finite validation loss:
        the driver then discards the update); after any round, redo the
        worker's sizes if its round time is an outlier of the others' latest."""
        m = reply.content.metric_records["metrics"]
        if self.step_model == "training" and "step_batches" in m:
            self.sizing.observe(worker, m["step_batches"], m["step_seconds"])  # type: ignore[arg-type]
            if not self.sizing.planned and self.sizing.ready_to_plan(sorted(self.members.live)):
                self._plan_from_training()
        changed = self.sizing.check_straggler(worker) if self.sizing.planned else None
        if changed is not None:
            old, seconds = changed
            log(
                INFO,
                "worker %d is a straggler (%.3f s vs target %.3f s): sizes %s -> %s",
                worker,
                seconds,
                self.target_s,
                old,
                (self.data[worker], self.batch[worker]),
            )
        self._fresh[worker] = bool(int(m["sent"]))  # type: ignore[arg-type]
        if not self._fresh[worker]:
            return False
        assert self.global_vec is not None
        self.global_vec = self.merger.merge(self.global_vec, self.model_of(reply))
        return True


STRATEGIES: dict[str, type[AsyncStrategy]] = {
    cls.name: cls for cls in (HermesStrategy, BSPStrategy, ASPStrategy, SSPStrategy)
}
