"""Hermes' rules as pure numpy functions (no Flower): sizes, stragglers, gate, aggregation.

Source: Basani, Vivek, Krishna, Paul, "When Less is More: Achieving Faster Convergence in
Distributed Edge Machine Learning" (HiPC 2024, arXiv 2410.20495). Hermes is a
data-parallel parameter-server framework for heterogeneous edge workers built on three
rules, each below with the section it comes from (the paper was not at hand while this was
written: sections are cited by their topic, and every detail that is our reading rather
than the paper's statement says so):

- :func:`search_sizes`: per-worker dataset share ``D_i`` and mini-batch size ``b_i`` from
  the worker's measured per-step time, so that every worker's round takes the target time
  (the median worker's): the paper's *dual binary search* (dynamic dataset allocation).
- :func:`straggler_bounds` / :func:`is_straggler`: a worker is a straggler when its round
  time lies outside ``[Q1 - 1.5 IQR, Q3 + 1.5 IQR]`` of the others' (Tukey's fences);
  then its sizes are searched again.
- :class:`SignificanceGate`: a worker sends its update only when the z-score of its local
  validation loss against a window of its recent losses is ``<= threshold``; after
  ``patience`` (lambda) consecutive minor rounds the threshold relaxes by ``(1 - relax)``
  (beta) per round towards 0.
- :func:`loss_weighted_merge`: the parameter server merges an update ``g_i`` into the
  global model ``G`` with weights ``1 / loss``.

The baselines' rules (synchronous FedAvg, asynchronous delta application, the SSP
staleness bound) are here too, so all four strategies share one tested core.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

# --------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------


def validate_settings(
    *,
    window: int = 10,
    threshold: float = -1.3,
    patience: int = 5,
    relax: float = 0.1,
    staleness: int = 3,
    target_accuracy: float = 0.9,
) -> None:
    """Refuse bad Hermes / baseline settings with a message saying what is wrong.

    Raises
    ------
    ValueError
        ``window < 2`` (a z-score needs at least two past losses), ``threshold > 0`` (the
        gate would send updates that made the loss worse), ``patience < 1``, ``relax``
        outside (0, 1), ``staleness < 0``, ``target_accuracy`` outside (0, 1].
    """
    if isinstance(window, bool) or int(window) != window or window < 2:
        raise ValueError(f"gate window must be an integer >= 2 (past losses), got {window}")
    if not threshold <= 0:
        raise ValueError(
            f"gate threshold must be <= 0 (a z-score below the window mean), got {threshold}"
        )
    if int(patience) != patience or patience < 1:
        raise ValueError(f"gate patience (lambda) must be an integer >= 1, got {patience}")
    if not 0 < relax < 1:
        raise ValueError(f"gate relax (beta) must be in (0, 1), got {relax}")
    if int(staleness) != staleness or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0, got {staleness}")
    if not 0 < target_accuracy <= 1:
        raise ValueError(f"target_accuracy must be in (0, 1], got {target_accuracy}")


# --------------------------------------------------------------------------------------
# per-step time model and the dual binary search
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds one training step of a worker takes at mini-batch size ``b``:
    ``overhead_s + per_sample_s * b``.

    The paper measures each worker's time per iteration; modelling it as affine in the
    batch size (a fixed cost per step plus a cost per sample) is our reading, and what
    :meth:`fit` recovers from steps timed at several batch sizes.
    """

    overhead_s: float
    per_sample_s: float

    def __post_init__(self) -> None:
        if self.overhead_s < 0 or self.per_sample_s < 0:
            raise ValueError(
                f"step time model needs non-negative terms, got overhead {self.overhead_s}, "
                f"per sample {self.per_sample_s}"
            )
        if self.overhead_s == 0 and self.per_sample_s == 0:
            raise ValueError("step time model is zero: measure at least one step")

    def step_s(self, batch: float) -> float:
        """Predicted seconds of one step of ``batch`` samples."""
        return self.overhead_s + self.per_sample_s * batch

    def round_s(self, data: int, batch: int) -> float:
        """Predicted seconds of one round: one pass over ``data`` samples in
        ``ceil(data / batch)`` steps, the last one partial. Sums to
        ``ceil(data / batch) * overhead_s + data * per_sample_s``: non-increasing in
        ``batch`` and increasing in ``data``, which is what lets both searches bisect."""
        steps = -(-int(data) // int(batch))
        return steps * self.overhead_s + int(data) * self.per_sample_s

    @classmethod
    def fit(cls, batches: Sequence[float], seconds: Sequence[float]) -> StepTimeModel:
        """Least-squares fit of ``seconds ~ overhead + per_sample * batch``.

        Falls back to a constant (``per_sample = 0``) or a proportional
        (``overhead = 0``) model when the free fit gives a negative term.

        Raises
        ------
        ValueError
            Fewer than one measurement, mismatched lengths or non-positive times.
        """
        b = np.asarray(batches, dtype=float)
        t = np.asarray(seconds, dtype=float)
        if b.shape != t.shape or b.size < 1:
            raise ValueError(f"need matching batch sizes and times, got {b.size} and {t.size}")
        if np.any(t <= 0) or np.any(b <= 0):
            raise ValueError("step times and batch sizes must be > 0")
        if np.unique(b).size >= 2:
            slope, intercept = np.polyfit(b, t, 1)
            if slope >= 0 and intercept >= 0:
                return cls(float(intercept), float(slope))
            if slope < 0:
                return cls(float(t.mean()), 0.0)
            return cls(0.0, float((b @ t) / (b @ b)))
        return cls(float(t.mean()), 0.0)

    def scaled(self, factor: float) -> StepTimeModel:
        """The same model ``factor`` times slower (a worker measured slower than predicted)."""
        return StepTimeModel(self.overhead_s * factor, self.per_sample_s * factor)


@dataclass(frozen=True)
class Sizes:
    """A worker's dataset share and mini-batch size, and the round time they predict."""

    data: int
    batch: int
    predicted_s: float
    target_s: float


def _largest_int(lo: int, hi: int, ok: object) -> int | None:
    """Largest ``x`` in ``[lo, hi]`` with ``ok(x)`` for a predicate true on a prefix; None
    if ``ok(lo)`` is false."""
    assert callable(ok)
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def search_batch(
    model: StepTimeModel, data: int, target_s: float, batch_range: tuple[int, int]
) -> int:
    """Inner search: the smallest batch in ``batch_range`` whose round over ``data``
    samples fits in ``target_s``; the largest batch if none does.

    A *smaller* batch means more steps and a *longer* round, so the bisection raises the
    batch while the round is too long. (The paper's stated intent; the authors' released
    code moves the other way and always ends at the smallest batch, 16.) The smallest
    batch that fits is the one whose round is closest to the target from below, and gives
    the most updates per round.
    """
    lo, hi = batch_range
    hi = max(lo, min(hi, int(data)))
    # round_s is non-increasing in the batch: fits(b) is true on a suffix [b*, hi].
    best = _largest_int(-hi, -lo, lambda nb: model.round_s(data, -nb) <= target_s)
    return hi if best is None else -best


def search_sizes(
    model: StepTimeModel,
    target_s: float,
    default_batch: int,
    data_range: tuple[int, int],
    batch_range: tuple[int, int] = (8, 128),
) -> Sizes:
    """Hermes' dual binary search for one worker's dataset share and batch size.

    Outer bisection over the dataset share ``D``; for each ``D`` the inner bisection
    (:func:`search_batch`) finds the smallest batch whose round fits in the target. The
    outer search keeps the largest ``D`` whose inner batch is no larger than
    ``default_batch``: the share absorbs most of the speed difference and the batch only
    fine-tunes, except where the share hits its bounds (a fast worker that already has
    the whole pool gets smaller batches, more steps; a slow worker at the smallest share
    gets larger batches). This nesting and the preference for the default batch are our
    reading of the paper's dual binary search (dynamic dataset allocation).

    Parameters
    ----------
    model : StepTimeModel
        The worker's measured per-step time.
    target_s : float
        The round time to reach (Hermes: the median worker's).
    default_batch : int
        The batch size every worker starts with.
    data_range : (int, int)
        Smallest and largest share (samples).
    batch_range : (int, int)
        Smallest and largest batch.

    Returns
    -------
    Sizes
        ``predicted_s <= target_s`` whenever some share and batch fit; otherwise the
        smallest share at the largest batch (its prediction is then above the target).

    Raises
    ------
    ValueError
        Empty ranges, a default batch outside ``batch_range`` or a non-positive target.
    """
    d_lo, d_hi = (int(v) for v in data_range)
    b_lo, b_hi = (int(v) for v in batch_range)
    if not 1 <= d_lo <= d_hi:
        raise ValueError(f"data_range must satisfy 1 <= low <= high, got {data_range}")
    if not 1 <= b_lo <= b_hi:
        raise ValueError(f"batch_range must satisfy 1 <= low <= high, got {batch_range}")
    if not b_lo <= default_batch <= b_hi:
        raise ValueError(f"default_batch {default_batch} is outside batch_range {batch_range}")
    if not target_s > 0:
        raise ValueError(f"target round time must be > 0, got {target_s}")
    b_range = (b_lo, b_hi)
    # "the inner search's batch is <= default_batch" is "the default batch fits": the
    # round grows with the share, so this holds on a prefix of [d_lo, d_hi].
    data = _largest_int(d_lo, d_hi, lambda d: model.round_s(d, min(default_batch, d)) <= target_s)
    if data is None:  # even the smallest share needs a batch above the default
        data = d_lo
    batch = search_batch(model, data, target_s, b_range)
    return Sizes(data, batch, model.round_s(data, batch), float(target_s))


def target_round_s(
    models: Sequence[StepTimeModel], data: Sequence[int], batch: Sequence[int]
) -> float:
    """Hermes' target: the median of the workers' predicted round times at their current
    sizes (the median worker's round)."""
    times = [m.round_s(d, b) for m, d, b in zip(models, data, batch, strict=True)]
    return float(np.median(times))


# --------------------------------------------------------------------------------------
# stragglers
# --------------------------------------------------------------------------------------


def straggler_bounds(times: Sequence[float]) -> tuple[float, float]:
    """Tukey's fences ``(Q1 - 1.5 IQR, Q3 + 1.5 IQR)`` of ``times`` (numpy's linear
    percentiles). Hermes flags a worker whose round time is an outlier of the others'
    this way (paper: straggler detection by the interquartile range).

    Raises
    ------
    ValueError
        If ``times`` is empty.
    """
    t = np.asarray(times, dtype=float)
    if t.size == 0:
        raise ValueError("no round times to compare with")
    q1, q3 = np.percentile(t, [25, 75])
    iqr = q3 - q1
    return float(q1 - 1.5 * iqr), float(q3 + 1.5 * iqr)


def is_straggler(times: Sequence[float], worker: int) -> bool:
    """Whether ``times[worker]`` lies outside the fences of the *other* workers' times
    (our reading: the worker itself is left out of the quartiles, so one extreme worker
    cannot widen its own fence). Needs at least two other workers; False otherwise."""
    others = [t for i, t in enumerate(times) if i != worker]
    if len(others) < 2:
        return False
    lo, hi = straggler_bounds(others)
    return not lo <= times[worker] <= hi


# --------------------------------------------------------------------------------------
# the significant-update gate
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateDecision:
    """Outcome of one round's test: ``send``, the loss's ``z``-score and the threshold
    it was compared with."""

    send: bool
    z: float
    threshold: float


@dataclass
class SignificanceGate:
    """Hermes' significant-update test, kept by each worker.

    After each round the worker measures ``L_t``, its model's loss on its local
    validation split, and computes ``z = (L_t - mean) / std`` over the window of its last
    ``window`` losses (``L_t`` itself excluded, population std). It sends the update only
    when ``z <= threshold``: the loss is markedly below its recent level. After
    ``patience`` (lambda) consecutive minor rounds, the threshold is multiplied by
    ``(1 - relax)`` (beta) after every further minor round, so it moves towards 0 and a
    stuck worker eventually sends; a sent update restores the initial threshold.

    Our readings of details the paper leaves open: the first round (an empty window)
    sends; with ``std = 0`` the z-score is ``0`` if ``L_t`` equals the mean and
    ``-inf`` / ``+inf`` if it is below / above it (no division by zero); the window
    holds ``L_t`` after the test whatever the decision.

    Parameters
    ----------
    window : int (default: 10)
    threshold : float (default: -1.3)
    patience : int (default: 5)
        Lambda.
    relax : float (default: 0.1)
        Beta.
    """

    window: int = 10
    threshold: float = -1.3
    patience: int = 5
    relax: float = 0.1
    losses: list[float] = field(default_factory=list)
    minor_streak: int = 0
    current_threshold: float | None = None

    def __post_init__(self) -> None:
        validate_settings(
            window=self.window,
            threshold=self.threshold,
            patience=self.patience,
            relax=self.relax,
        )
        if self.current_threshold is None:
            self.current_threshold = float(self.threshold)

    def zscore(self, loss: float) -> float:
        """``z`` of ``loss`` against the window (``-inf`` when the window is empty)."""
        if not self.losses:
            return -math.inf
        hist = np.asarray(self.losses[-self.window :], dtype=float)
        mean, std = float(hist.mean()), float(hist.std())
        if std == 0.0:
            return 0.0 if loss == mean else math.copysign(math.inf, loss - mean)
        return (loss - mean) / std

    def observe(self, loss: float) -> GateDecision:
        """Test this round's validation ``loss``, update the window and threshold.

        Raises
        ------
        ValueError
            If ``loss`` is not finite.
        """
        if not math.isfinite(loss):
            raise ValueError(f"validation loss must be finite, got {loss}")
        z = self.zscore(loss)
        threshold = float(self.current_threshold)  # type: ignore[arg-type]
        send = z <= threshold
        self.losses = [*self.losses, float(loss)][-self.window :]
        if send:
            self.minor_streak = 0
            self.current_threshold = float(self.threshold)
        else:
            self.minor_streak += 1
            if self.minor_streak >= self.patience:
                self.current_threshold = threshold * (1.0 - self.relax)
        return GateDecision(bool(send), float(z), threshold)

    def to_dict(self) -> dict:
        """Plain dict (kept in the worker's Flower ``context.state``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SignificanceGate:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**d, "losses": [float(v) for v in d.get("losses", [])]})


# --------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------


def loss_weighted_merge(
    global_model: np.ndarray, global_loss: float, update: np.ndarray, update_loss: float
) -> np.ndarray:
    """Hermes' loss-based aggregation at the parameter server:

    ``G <- (G / L_glob + g_i / L_i) / (1 / L_glob + 1 / L_i)``

    a weighted mean of the global model and the arriving worker model, each weighted by
    the inverse of its loss on the server's validation split (the lower the loss, the
    larger the weight).

    A loss of exactly 0 (a model that fits the validation split perfectly) makes its
    weight infinite; the rule then gives its limit as that loss goes to 0: the zero-loss
    model itself, and the plain mean ``(G + g_i) / 2`` when both losses are 0 (equal
    weights, the limit along ``L_glob = L_i``). Written as ``G + w (g_i - G)`` with
    ``w = L_glob / (L_glob + L_i)`` this is one formula for every case, with no division
    by zero: our reading, the paper (arXiv 2410.20495) only states the weighting.

    Parameters
    ----------
    global_model, update : np.ndarray
        Flat models of the same shape ``(d,)``.
    global_loss, update_loss : float
        Their validation losses (cross-entropy: ``>= 0``).

    Raises
    ------
    ValueError
        A loss that is negative or not finite, or shapes that differ. (Non-finite models
        and losses are refused by name before they get here: the callers check them with
        :func:`sky_flower.flower.finite.check_finite`.)
    """
    g, u = np.asarray(global_model, dtype=float), np.asarray(update, dtype=float)
    if g.shape != u.shape:
        raise ValueError(f"update shape {u.shape} differs from the global model's {g.shape}")
    for name, v in (("global", global_loss), ("update", update_loss)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} loss must be finite and >= 0, got {v}")
    total = global_loss + update_loss
    w = 0.5 if total == 0 else global_loss / total
    return g + w * (u - g)


def fedavg(models: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """BSP's aggregation: the mean of ``models`` weighted by ``weights`` (examples).

    Raises
    ------
    ValueError
        No models, mismatched lengths or a non-positive total weight.
    """
    if not models or len(models) != len(weights):
        raise ValueError(f"need as many weights as models, got {len(models)}, {len(weights)}")
    w = np.asarray(weights, dtype=float)
    if w.sum() <= 0 or np.any(w < 0):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(w)}")
    stack = np.stack([np.asarray(m, dtype=float) for m in models])
    return (w[:, None] * stack.reshape(len(models), -1)).sum(0).reshape(stack.shape[1:]) / w.sum()


def apply_delta(
    global_model: np.ndarray, update: np.ndarray, base: np.ndarray, num_workers: int
) -> np.ndarray:
    """ASP / SSP's aggregation: apply the worker's progress ``update - base`` (``base``: the
    global model the worker started its round from, possibly stale) scaled by
    ``1 / num_workers``, on arrival. With every worker in step this is FedAvg of equal
    shares."""
    g = np.asarray(global_model, dtype=float)
    return g + (np.asarray(update, dtype=float) - np.asarray(base, dtype=float)) / num_workers


def may_start(clock: int, clocks: Sequence[int], staleness: int | None) -> bool:
    """Whether a worker that has completed ``clock`` rounds may start its next one.

    SSP (bounded staleness ``s``): only if it is at most ``s`` rounds ahead of the slowest
    worker, ``clock - min(clocks) <= s``. ``s = 0`` is BSP's barrier; ``None`` is ASP
    (never waits).
    """
    if staleness is None:
        return True
    return clock - min(clocks) <= staleness
