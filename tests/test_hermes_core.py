"""Hermes' pure core (sky_flower/hermes/core.py) on hand-made inputs with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sky_flower.core.fleets import skycomputing_slowdowns
from sky_flower.hermes.core import (
    SignificanceGate,
    StepTimeModel,
    apply_delta,
    fedavg,
    is_straggler,
    loss_weighted_merge,
    may_start,
    search_batch,
    search_sizes,
    straggler_bounds,
    target_round_s,
    validate_settings,
)
from sky_flower.hermes.server import HermesSizing, WorkerBook

# --- step time model ------------------------------------------------------------------


def test_round_time_is_steps_times_overhead_plus_samples():
    m = StepTimeModel(0.005, 0.001)
    assert m.round_s(129, 32) == pytest.approx(5 * 0.005 + 129 * 0.001)  # 4 full + 1 partial
    assert m.round_s(128, 32) == pytest.approx(4 * 0.005 + 0.128)


def test_fit_recovers_an_affine_step_time():
    b = [8, 16, 32, 64, 128]
    fit = StepTimeModel.fit(b, [0.02 + 0.003 * x for x in b])
    assert fit.overhead_s == pytest.approx(0.02) and fit.per_sample_s == pytest.approx(0.003)
    flat = StepTimeModel.fit([8, 32], [0.5, 0.4])  # slower at the smaller batch: constant
    assert flat.per_sample_s == 0 and flat.overhead_s == pytest.approx(0.45)


# --- the dual binary search -----------------------------------------------------------


@pytest.mark.parametrize(("target", "batch"), [(0.745, 64), (0.845, 32), (0.965, 20)])
def test_inner_search_raises_the_batch_when_the_round_is_too_long(target, batch):
    """640 samples at 0.01 s per step + 0.001 s per sample: round = ceil(640/b) * 0.01 +
    0.64. The smallest batch that fits: b >= 640 / 10, 640 / 20, 640 / 32 steps. (The
    authors' code moved the other way and returned its smallest batch for every target.)"""
    assert search_batch(StepTimeModel(0.01, 0.001), 640, target, (8, 128)) == batch


def test_outer_search_largest_share_at_the_default_batch():
    """0.01 + 0.001 b per step, target 0.9055 s: at batch 32 a share of d samples takes
    ceil(d/32) * 0.01 + 0.001 d; the largest d that fits is 685 (22 steps, 0.905 s), and
    no smaller batch fits with it (685 / 31 -> 23 steps, 0.915 s)."""
    sizes = search_sizes(StepTimeModel(0.01, 0.001), 0.9055, 32, (8, 10_000))
    assert (sizes.data, sizes.batch) == (685, 32)
    assert sizes.predicted_s == pytest.approx(0.905)


def test_fast_worker_at_the_whole_pool_gets_a_smaller_batch():
    """Capped at 300 samples the round at batch 32 (0.4 s) is far below 0.9055 s: the
    batch drops to the smallest allowed (8: 38 steps, 0.68 s) to use the time."""
    sizes = search_sizes(StepTimeModel(0.01, 0.001), 0.9055, 32, (8, 300))
    assert (sizes.data, sizes.batch) == (300, 8)
    assert sizes.predicted_s == pytest.approx(0.68)


def test_slow_worker_at_the_smallest_share_gets_the_largest_batch():
    """0.1 + 0.01 b per step: even 64 samples in one step (0.74 s) exceed 0.5 s, so the
    smallest share at the largest usable batch (the share itself) is returned, over target."""
    sizes = search_sizes(StepTimeModel(0.1, 0.01), 0.5, 32, (64, 1000))
    assert (sizes.data, sizes.batch) == (64, 64)
    assert sizes.predicted_s == pytest.approx(0.74) and sizes.predicted_s > sizes.target_s


def test_sizes_bring_every_skycomputing_worker_within_10_percent_of_the_target():
    """8 workers with SkyComputing's slowdowns 1-6 (x2..x7 a native 5 ms + 1 ms per sample
    step), equal shares of 129 samples at batch 32 to start; the target is the median
    worker's round. After the search every worker's round is within 10 % of it, faster
    workers hold more data, and the shares are not all equal (the search did something)."""
    slow = skycomputing_slowdowns(8)
    models = [StepTimeModel(0.005 * (1 + s), 0.001 * (1 + s)) for s in slow]
    before = [m.round_s(129, 32) for m in models]
    target = target_round_s(models, [129] * 8, [32] * 8)
    assert max(abs(t - target) / target for t in before) > 0.3  # unbalanced to start
    sizes = [search_sizes(m, target, 32, (8, 1037)) for m in models]
    for s in sizes:
        assert abs(s.predicted_s - s.target_s) / s.target_s < 0.10, s
    order = np.argsort(slow, kind="stable")
    data = [sizes[i].data for i in order]
    assert data == sorted(data, reverse=True) and data[0] > 2 * data[-1]


def test_search_refuses_bad_ranges():
    m = StepTimeModel(0.01, 0.001)
    with pytest.raises(ValueError, match="outside batch_range"):
        search_sizes(m, 1.0, 256, (8, 100))
    with pytest.raises(ValueError, match="target round time must be > 0"):
        search_sizes(m, 0.0, 32, (8, 100))


# --- stragglers -----------------------------------------------------------------------


def test_straggler_bounds_are_tukeys_fences():
    assert straggler_bounds([1, 2, 3, 4, 5]) == (pytest.approx(-1.0), pytest.approx(7.0))


def test_straggler_is_judged_against_the_others():
    """Others of worker 5: 0.9, 1.0, 1.05, 1.1, 1.2 -> Q1 1.0, Q3 1.1, fences [0.85, 1.25]:
    3.0 is out. Others of worker 0 include 3.0: Q1 1.05, Q3 1.2, fences [0.825, 1.425]."""
    times = [1.0, 1.2, 0.9, 1.1, 1.05, 3.0]
    assert is_straggler(times, 5)
    assert not any(is_straggler(times, i) for i in range(5))
    assert is_straggler([1.0, 1.2, 0.9, 1.1, 1.05, 0.3], 5)  # too fast is an outlier too
    assert not is_straggler([1.0, 9.0], 1)  # one other worker: no quartiles to judge by


# --- the significant-update gate ------------------------------------------------------


def test_gate_sends_only_markedly_lower_losses():
    gate = SignificanceGate(window=3, threshold=-1.0)
    first = gate.observe(1.0)
    assert first.send and first.z == -math.inf  # nothing to compare with yet
    assert gate.observe(0.5).z == -math.inf  # std 0, below the mean
    third = gate.observe(0.5)  # window [1.0, 0.5]: mean 0.75, std 0.25
    assert third.send and third.z == pytest.approx(-1.0)
    fourth = gate.observe(0.5)  # window [1.0, 0.5, 0.5]: mean 2/3, std 0.2357
    assert not fourth.send and fourth.z == pytest.approx(-(1 / 6) / (np.sqrt(2) / 6))
    assert gate.losses == [0.5, 0.5, 0.5]  # the window keeps the last 3


def test_gate_relaxes_after_lambda_minor_rounds_and_resets_on_send():
    """Constant losses: z = 0 every round after the first (std 0, equal to the mean).
    With lambda 2 and beta 0.5 the threshold is -1, -1, then -0.5, -0.25 ...; a loss
    below the window sends and restores -1."""
    gate = SignificanceGate(window=2, threshold=-1.0, patience=2, relax=0.5)
    decisions = [gate.observe(1.0) for _ in range(5)]
    assert [d.send for d in decisions] == [True, False, False, False, False]
    assert [d.z for d in decisions[1:]] == [0.0] * 4
    assert [d.threshold for d in decisions] == [-1.0, -1.0, -1.0, -0.5, -0.25]
    assert gate.current_threshold == pytest.approx(-0.125) and gate.minor_streak == 4
    drop = gate.observe(0.2)
    assert drop.send and drop.z == -math.inf and drop.threshold == pytest.approx(-0.125)
    assert gate.current_threshold == -1.0 and gate.minor_streak == 0


def test_gate_round_trips_through_a_dict():
    gate = SignificanceGate()
    for loss in (1.0, 0.8, 0.9):
        gate.observe(loss)
    again = SignificanceGate.from_dict(gate.to_dict())
    assert again == gate and again.observe(0.85) == gate.observe(0.85)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 0.5}, "threshold must be <= 0"),
        ({"window": 1}, "window must be an integer >= 2"),
        ({"relax": 1.0}, r"relax \(beta\) must be in \(0, 1\)"),
        ({"relax": 0.0}, r"relax \(beta\) must be in \(0, 1\)"),
        ({"patience": 0}, "patience"),
        ({"staleness": -1}, "staleness must be an integer >= 0"),
        ({"target_accuracy": 0.0}, r"target_accuracy must be in \(0, 1\]"),
        ({"target_accuracy": 1.5}, r"target_accuracy must be in \(0, 1\]"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate_settings(**kwargs)


# --- aggregation ----------------------------------------------------------------------


def test_loss_weighted_merge_known_answer():
    """L_glob 1, L_i 0.5: weights 1 and 2, so G = (1 * [1, 2] + 2 * [3, 6]) / 3."""
    merged = loss_weighted_merge(np.array([1.0, 2.0]), 1.0, np.array([3.0, 6.0]), 0.5)
    np.testing.assert_allclose(merged, [7 / 3, 14 / 3])
    equal = loss_weighted_merge(np.array([0.0]), 0.3, np.array([4.0]), 0.3)
    np.testing.assert_allclose(equal, [2.0])  # equal losses: the plain mean
    for bad in (-0.1, math.nan, math.inf):  # a loss 0.0 is no longer refused: see below
        with pytest.raises(ValueError, match="loss must be finite and >= 0"):
            loss_weighted_merge(np.zeros(2), bad, np.ones(2), 1.0)
    with pytest.raises(ValueError, match="shape"):
        loss_weighted_merge(np.zeros(2), 1.0, np.ones(3), 1.0)


def test_baseline_rules():
    np.testing.assert_allclose(fedavg([np.array([0.0]), np.array([3.0])], [1, 2]), [2.0])
    np.testing.assert_allclose(
        apply_delta(np.array([1.0]), np.array([3.0]), np.array([2.0]), 4), [1.25]
    )
    assert may_start(5, [2, 5, 4], None)  # ASP never waits
    assert may_start(5, [2, 5, 4], 3) and not may_start(6, [2, 6, 4], 3)  # SSP, s = 3
    assert may_start(2, [2, 3, 3], 0) and not may_start(3, [2, 3, 3], 0)  # BSP barrier


def test_loss_weighted_merge_at_zero_loss_is_the_limit_of_the_weights():
    """A loss of exactly 0 (once a ValueError) takes the limit of the inverse-loss
    weights: the zero-loss model wins outright; both zero: the plain mean. Continuous:
    a loss of 1e-12 gives (almost) the same model."""
    g, u = np.array([1.0, 2.0]), np.array([3.0, 6.0])
    np.testing.assert_array_equal(loss_weighted_merge(g, 0.0, u, 0.7), g)
    np.testing.assert_array_equal(loss_weighted_merge(g, 0.7, u, 0.0), u)
    np.testing.assert_array_equal(loss_weighted_merge(g, 0.0, u, 0.0), (g + u) / 2)
    np.testing.assert_allclose(loss_weighted_merge(g, 0.7, u, 1e-12), u, rtol=1e-10)


def test_a_refit_with_a_negative_intercept_keeps_the_step_overhead():
    """Issue 18 bench, straggler8 seed 1: noisy step timings whose free fit has a negative
    intercept fell back to overhead 0; every batch then predicted the same round and the
    search picked batch 8 ((128, 32) -> (149, 8) in the run's log). The online refit now
    keeps the planned model's shape at the observed level, and the search a larger batch."""
    noisy = ([8, 32, 8, 32], [0.006, 0.044, 0.007, 0.046])
    degenerate = StepTimeModel.fit(*noisy)
    assert degenerate.overhead_s == 0.0  # the proportional fallback, as in the run
    assert search_sizes(degenerate, 0.176, 32, (8, 1037), (8, 128)).batch == 8
    book = WorkerBook.equal(1, 1037, 32)
    sizing = HermesSizing(book, 32, (8, 1037), (8, 128), 0.1)
    sizing.observe(0, [8, 32, 128], [0.016, 0.040, 0.136])  # 8 ms + 1 ms / sample
    sizing.plan_from_training()
    for _ in range(3):
        sizing.observe(0, *noisy)
    model = sizing.step_models[0]
    assert model.overhead_s > 0
    assert 0.0065 < model.step_s(32) < 0.045  # scaled toward the observed level
    assert search_sizes(model, 0.176, 32, (8, 1037), (8, 128)).batch > 8
