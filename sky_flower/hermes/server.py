"""The server's side of Hermes and its baselines without Flower: the per-worker book, the
Hermes sizing (benchmark fit, dual binary search, straggler re-search) and the
loss-weighted merge with its cached global loss. The rules themselves are in
:mod:`sky_flower.hermes.core`; the Flower strategies (``strategies/hermes.py``) hold one
of each and call them from their hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sky_flower.flower.finite import check_finite
from sky_flower.hermes.core import (
    Sizes,
    StepTimeModel,
    is_straggler,
    loss_weighted_merge,
    search_sizes,
    target_round_s,
)


def check_profile_settings(profile_batches: Any, profile_repeats: Any) -> None:  # noqa: ANN401
    """Refuse Hermes' step-time sampling settings before Flower starts.

    Raises
    ------
    ValueError
        ``profile_batches`` not a list of at least two different integers >= 1 (the affine
        step-time model is fitted from steps timed at them), ``profile_repeats`` not an
        integer >= 1.
    """
    batches = list(profile_batches) if isinstance(profile_batches, list | tuple) else None
    if (
        batches is None
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batches)
        or len(set(batches)) < 2
    ):
        raise ValueError(
            "strategy.profile_batches must be a list of at least two different batch sizes "
            f"(integers >= 1) to fit the step-time model from, e.g. [8, 32, 128]; got "
            f"{profile_batches!r}"
        )
    if isinstance(profile_repeats, bool) or not isinstance(profile_repeats, int):
        raise ValueError(
            f"strategy.profile_repeats must be an integer >= 1, got {profile_repeats!r}"
        )
    if profile_repeats < 1:
        raise ValueError(
            f"strategy.profile_repeats must be an integer >= 1, got {profile_repeats!r}"
        )


def check_driver_settings(  # noqa: PLR0913
    num_workers: int,
    pool_size: int,
    lr: float,
    batch_size: int,
    max_time_s: float,
    poll_interval_s: float,
) -> None:
    """Check the asynchronous driver's settings (the gate's and SSP's:
    :func:`sky_flower.hermes.core.validate_settings`).

    Raises
    ------
    ValueError
        Naming the first bad setting: ``num_workers < 1``, ``lr <= 0``, ``batch_size``
        outside ``[1, pool_size // num_workers]`` (a worker's equal share),
        ``max_time_s <= 0``, ``poll_interval_s < 0``.
    """
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
    if not poll_interval_s >= 0:
        raise ValueError(f"poll_interval_s must be >= 0, got {poll_interval_s}")


@dataclass
class WorkerBook:
    """Per-worker settings and counters, by position (lists of length ``n``).

    Attributes
    ----------
    data, batch : list[int]
        The share (samples per round) and mini-batch of each worker's next round.
    clock : list[int]
        Rounds completed.
    updates_sent, minor_rounds : list[int]
        Rounds whose model went back / that stayed local (Hermes' gate).
    rejected : list[int]
        Rounds whose reply was discarded as non-finite (not in ``updates_sent``).
    round_times : list[list[float]]
        Measured training seconds of each completed round.
    sized_at : list[int]
        Rounds each worker had completed when its current sizes were set (Hermes sizes
        from training rounds: the rounds before ran at the equal share).
    """

    data: list[int]
    batch: list[int]
    clock: list[int] = field(default_factory=list)
    updates_sent: list[int] = field(default_factory=list)
    minor_rounds: list[int] = field(default_factory=list)
    round_times: list[list[float]] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    sized_at: list[int] = field(default_factory=list)

    @classmethod
    def equal(cls, num_workers: int, pool_size: int, batch_size: int) -> WorkerBook:
        """Every worker at its equal share ``pool_size // num_workers`` and ``batch_size``."""
        n = num_workers
        return cls(
            data=[pool_size // n] * n,
            batch=[batch_size] * n,
            clock=[0] * n,
            updates_sent=[0] * n,
            minor_rounds=[0] * n,
            round_times=[[] for _ in range(n)],
            rejected=[0] * n,
            sized_at=[0] * n,
        )

    @property
    def n(self) -> int:
        """Number of workers."""
        return len(self.data)

    def count(self, worker: int, sent: bool, seconds: float) -> None:
        """Count one completed round of ``worker`` (``sent``: its model went back) that
        trained for ``seconds``."""
        self.clock[worker] += 1
        self.round_times[worker].append(float(seconds))
        if sent:
            self.updates_sent[worker] += 1
        else:
            self.minor_rounds[worker] += 1

    def reject(self, worker: int, counted: bool) -> None:
        """Count a discarded (non-finite) round of ``worker``; ``counted``: it was already
        counted as sent by :meth:`count` (its time stays, it leaves ``updates_sent``)."""
        if counted:
            self.updates_sent[worker] -= 1
        else:
            self.clock[worker] += 1
        self.rejected[worker] += 1

    def rows(self, slowdowns: Sequence[float]) -> list[dict[str, Any]]:
        """Per worker: slowdown (``None`` if unknown), share, batch, rounds, updates sent,
        minor rounds, rejected rounds, median round time (s, ``None`` before its first
        round; over the rounds at its current sizes when there are any).
        ``rounds = updates_sent + minor_rounds + rejected``."""
        return [
            {
                "worker": w,
                "slowdown": slowdowns[w] if slowdowns else None,
                "data": self.data[w],
                "batch": self.batch[w],
                "rounds": self.clock[w],
                "updates_sent": self.updates_sent[w],
                "minor_rounds": self.minor_rounds[w],
                "rejected": self.rejected[w],
                "median_round_s": float(
                    np.median(self.round_times[w][self.sized_at[w] :] or self.round_times[w])
                )
                if self.round_times[w]
                else None,
            }
            for w in range(self.n)
        ]


class HermesSizing:
    """Hermes' speed-aware sizes: fit each worker's step time from the benchmark round
    (:meth:`plan`) or from its first training rounds' own step timings
    (:meth:`observe`, :meth:`plan_from_training`; refitted after every round), set the
    target round to the median worker's at equal shares, search every worker's
    share and batch for it; re-search a worker that turns straggler. Writes the sizes
    into ``book.data`` / ``book.batch``.

    Parameters
    ----------
    book : WorkerBook
        The run's book (its equal shares are the benchmark's reference).
    batch_size : int
        Every worker's starting batch (the search's preferred batch).
    data_range : (int, int)
        Smallest and largest share the search may choose.
    batch_range : (int, int)
        Batches the search may choose.
    straggler_tolerance : float
        A straggler by the IQR fences is re-searched only if its round is also more than
        this fraction off the target.
    """

    OBSERVED_WINDOW = 12  # (batch, seconds) observations per worker the online refit uses

    def __init__(
        self,
        book: WorkerBook,
        batch_size: int,
        data_range: tuple[int, int],
        batch_range: tuple[int, int],
        straggler_tolerance: float,
    ) -> None:
        self.book, self.batch_size = book, int(batch_size)
        self.data_range, self.batch_range = data_range, batch_range
        self.straggler_tolerance = float(straggler_tolerance)
        self.step_models: list[StepTimeModel] = []
        self.sizes: list[Sizes] = []
        self.target_s = 0.0
        self.searches = [0] * book.n  # size searches per worker (the first included)
        self.straggler_events = [0] * book.n
        # (batch, seconds per step) seen in training rounds, per worker, latest last
        self.observed: list[list[tuple[float, float]]] = [[] for _ in range(book.n)]

    @property
    def planned(self) -> bool:
        """Whether the sizes have been searched (:meth:`plan` or :meth:`plan_from_training`)."""
        return bool(self.sizes)

    def observe(self, worker: int, batches: Sequence[float], seconds: Sequence[float]) -> None:
        """Take one training round's step timings of ``worker`` (per step size, the median
        seconds per step); once planned, refit its step-time model from its latest
        ``OBSERVED_WINDOW`` observations (the straggler rule then rescales the refit). A
        refit whose intercept comes out negative (noisy timings: the fit falls back to no
        per-step overhead, every batch then predicts the same round and the search picks
        the smallest batch) keeps the current model's shape at the observed level."""
        obs = self.observed[worker]
        obs.extend((float(b), float(s)) for b, s in zip(batches, seconds, strict=True) if s > 0)
        del obs[: -self.OBSERVED_WINDOW]
        if not (self.planned and obs):
            return
        old = self.step_models[worker]
        if len({b for b, _ in obs}) >= 2:
            fit = StepTimeModel.fit(*_medians(obs))
            if fit.overhead_s > 0 or old.overhead_s <= 0:
                self.step_models[worker] = fit
            else:  # noise pushed the free intercept below 0: keep the shape, match the level
                sizes, secs = _medians(obs)
                level = float(
                    np.median([t / old.step_s(b) for b, t in zip(sizes, secs, strict=True)])
                )
                self.step_models[worker] = old.scaled(level)
        else:  # one step size in the window: keep the model's shape, match its level
            b = obs[-1][0]
            measured = float(np.median([t for _, t in obs]))
            model = self.step_models[worker]
            self.step_models[worker] = model.scaled(measured / model.step_s(b))

    def ready_to_plan(self, workers: Sequence[int] | None = None) -> bool:
        """Every worker of ``workers`` (default all; the driver passes the live ones) has
        timed steps of at least two sizes in its training rounds."""
        ws = range(self.book.n) if workers is None else workers
        return all(len({b for b, _ in self.observed[w]}) >= 2 for w in ws)

    def plan_from_training(self) -> None:
        """:meth:`plan` from the training rounds' own timings (no benchmark round). A
        worker without two timed step sizes (removed before it had) gets the slowest
        fitted worker's timings."""
        fits = [_medians(obs) for obs in self.observed]
        timed = [f for f in fits if len(f[0]) >= 2]
        slowest = max(timed, key=lambda f: StepTimeModel.fit(*f).step_s(self.batch_size))
        self.plan([f if len(f[0]) >= 2 else slowest for f in fits])

    def plan(self, measured: Sequence[tuple[Sequence[float], Sequence[float]]]) -> None:
        """Fit the step-time models from ``measured`` (per worker: batch sizes, median
        seconds per step), set the target round (s), search every worker's sizes.

        Raises
        ------
        ValueError
            As :meth:`sky_flower.hermes.core.StepTimeModel.fit` and
            :func:`sky_flower.hermes.core.search_sizes`.
        """
        self.step_models = [StepTimeModel.fit(b, s) for b, s in measured]
        self.target_s = target_round_s(self.step_models, self.book.data, self.book.batch)
        self.sizes = []
        for w in range(self.book.n):
            self.search(w)

    def search(self, worker: int) -> None:
        """Search ``worker``'s sizes for the target round; write them into the book."""
        sizes = search_sizes(
            self.step_models[worker],
            self.target_s,
            self.batch_size,
            self.data_range,
            self.batch_range,
        )
        if len(self.sizes) <= worker:
            self.sizes.append(sizes)
        else:
            self.sizes[worker] = sizes
        self.book.data[worker], self.book.batch[worker] = sizes.data, sizes.batch
        self.book.sized_at[worker] = len(self.book.round_times[worker])
        self.searches[worker] += 1

    def check_straggler(self, worker: int) -> tuple[tuple[int, int], float] | None:
        """After a round of ``worker``: if its latest round time is an outlier of every
        worker's latest (and more than the tolerance off the target), rescale its step
        model by measured / predicted and search again.

        Returns
        -------
        ((data, batch), seconds) or None
            Its sizes before the new search and its latest round time; ``None`` if
            nothing changed.
        """
        times = self.book.round_times
        if any(not t for t in times):
            return None  # not every worker has a round time yet
        latest = [t[-1] for t in times]
        if not is_straggler(latest, worker):
            return None
        self.straggler_events[worker] += 1
        if abs(latest[worker] / self.target_s - 1) <= self.straggler_tolerance:
            return None  # balanced rounds make the fences tight: ignore jitter near the target
        data, batch = self.book.data[worker], self.book.batch[worker]
        predicted = self.step_models[worker].round_s(data, batch)
        self.step_models[worker] = self.step_models[worker].scaled(latest[worker] / predicted)
        self.search(worker)
        return (data, batch), latest[worker]

    def benchmark(
        self,
        slowdowns: Sequence[float],
        measured: Sequence[tuple[Sequence[float], Sequence[float]]],
    ) -> dict[str, Any]:
        """The benchmark round as data: target round (s) and, per worker, its slowdown,
        the timed batches, seconds per step, and the fitted model."""
        return {
            "target_round_s": self.target_s,
            "workers": [
                {
                    "worker": w,
                    "slowdown": slowdowns[w],
                    "batches": list(measured[w][0]),
                    "step_seconds": list(measured[w][1]),
                    "overhead_s": self.step_models[w].overhead_s,
                    "per_sample_s": self.step_models[w].per_sample_s,
                }
                for w in range(self.book.n)
            ],
        }


class LossWeightedMerger:
    """Hermes' server merge (:func:`sky_flower.hermes.core.loss_weighted_merge`) with the
    global model's validation loss kept between merges.

    Parameters
    ----------
    val_loss_fn : Callable[[np.ndarray], float]
        Loss of a flat model ``(d,)`` on the server's validation split.
    """

    def __init__(self, val_loss_fn: Callable[[np.ndarray], float]) -> None:
        self.val_loss_fn = val_loss_fn
        self.global_loss: float | None = None

    def merge(self, global_vec: np.ndarray, update: np.ndarray) -> np.ndarray:
        """The new global model ``(d,)`` after merging ``update`` ``(d,)``.

        Raises
        ------
        NonFiniteError
            ``update``'s validation loss is not finite (the global model and its cached
            loss are left as they were).
        ValueError
            As :func:`sky_flower.hermes.core.loss_weighted_merge` (shapes, negative losses).
        """
        if self.global_loss is None:
            self.global_loss = self.val_loss_fn(global_vec)
        update_loss = self.val_loss_fn(update)
        check_finite(update_loss, "the update's validation loss")
        merged = loss_weighted_merge(global_vec, self.global_loss, update, update_loss)
        self.global_loss = self.val_loss_fn(merged)
        return merged


def _medians(obs: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Per distinct batch size of ``obs`` ((batch, seconds) pairs), ascending, the median
    seconds (robust to one slow step, e.g. a cold process's first)."""
    sizes = sorted({b for b, _ in obs})
    return sizes, [float(np.median([t for b, t in obs if b == s])) for s in sizes]
