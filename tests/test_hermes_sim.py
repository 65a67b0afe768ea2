"""Hermes end to end in Flower's simulation engine (8 emulated workers,
SkyComputing slowdowns 1-6, digits); bad settings refused before Flower starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from simhelpers import make_cfg

from sky_flower.run import run_job

FAST = [
    "strategy.target_accuracy=0.8",
    "strategy.max_time_s=60",
    "strategy.profile_repeats=2",
]


@pytest.mark.simulation
@pytest.mark.slow  # Hermes through Flower's messages in make test: tests/test_exchange.py
def test_hermes_reaches_the_target_with_balanced_rounds(tmp_path, no_leftover_processes):
    results = run_job(make_cfg(["strategy=hermes", *FAST]), tmp_path)
    assert results["error"] is None
    assert results["time_to_target_s"] is not None  # reached 0.8 within the cap
    assert results["final_test_accuracy"] >= 0.8
    saved = json.loads((tmp_path / "results.json").read_text())
    workers = saved["workers"]
    assert len(saved["updates_sent"]) == 8 and saved["updates_sent_total"] >= 8
    for w in workers:  # every round is either sent or counted as minor
        assert w["rounds"] == w["updates_sent"] + w["minor_rounds"]
    # the benchmark round saw the emulated slowdowns and the search gave the faster workers
    # more data: a x2 worker's share is more than twice a x7 worker's
    plan = json.loads((tmp_path / "plan.json").read_text())
    slow = np.array(saved["slowdowns"])
    data = np.array([p["data"] for p in plan["workers"]])
    assert data[slow == slow.min()].min() > 2 * data[slow == slow.max()].max()
    # measured round times: balanced to within 35 % of the target (slowdowns span 3.5x)
    medians = np.array([w["median_round_s"] for w in workers])
    assert np.all(np.abs(medians / plan["target_round_s"] - 1) < 0.35), medians
    times = [r["time_s"] for r in saved["timeline"]]
    assert times == sorted(times)
    assert (tmp_path / "model.pt").exists() and (tmp_path / "benchmark.json").exists()


# BSP (the baselines share the Hermes job and its engine path, run above): in lockstep and
# sending every round through Flower's real ClientApps in process, tests/test_exchange.py's
# test_the_asynchronous_driver_runs_through_the_exchange[bsp]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=hermes", "strategy.threshold=0.5"], "threshold must be <= 0"),
        (["strategy=hermes", "strategy.window=1"], "window must be an integer >= 2"),
        (["strategy=hermes", "strategy.relax=1.5"], r"relax \(beta\) must be in \(0, 1\)"),
        (["strategy=ssp", "strategy.staleness=-1"], "staleness must be an integer >= 0"),
        (["strategy=asp", "strategy.target_accuracy=0"], r"target_accuracy must be in \(0, 1\]"),
        (["strategy=bsp", "strategy.batch_size=500"], "batch_size=500 must be in"),
        (["strategy=hermes", "strategy.batch_range=[64,128]"], "must lie in batch_range"),
        (["strategy=bsp", "strategy.min_live_workers=9"], r"min_live_workers must be .* \[1, 8\]"),
        (["strategy=asp", "strategy.staleness_policy=forever"], "staleness_policy must be one of"),
        (["strategy=hermes", "strategy.profile_batches=[]"], "profile_batches must be a list"),
        (["strategy=hermes", "strategy.profile_batches=[0,8]"], "profile_batches must be a list"),
        (["strategy=hermes", "strategy.profile_batches=abc"], "profile_batches must be a list"),
        (["strategy=hermes", "strategy.profile_batches=[8,8]"], "at least two different"),
        (["strategy=hermes", "strategy.profile_repeats=0"], "profile_repeats must be an integer"),
    ],
)
def test_bad_settings_refused_before_flower_starts(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        run_job(make_cfg(overrides), tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_hermes_defaults():
    cfg = make_cfg(["strategy=hermes"])
    assert cfg.fleet.name == "skycomputing8" and cfg.fleet.nodes == 8
    s = cfg.strategy
    assert (s.window, s.threshold, s.patience, s.relax, s.staleness) == (10, -1.3, 5, 0.1, 3)
    assert make_cfg([]).strategy.name == "sky" and make_cfg([]).fleet.name == "edge4"
