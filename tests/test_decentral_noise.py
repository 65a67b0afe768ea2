"""The noise-dominated benchmark's bookkeeping (issue 18): bytes sent, statistics over
seeds, seeding of the fast path, and the grid's refusal of D2 (fast, no Flower)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sky_flower.bench.decentralized import simulate
from sky_flower.bench.decentralized_noise import (
    at_budget,
    bytes_per_round,
    markdown,
    parse_args,
    run_setting,
    seed_stats,
)
from sky_flower.gossip.matrices import gossip_matrix
from sky_flower.gossip.training import FlatModel, node_splits
from sky_flower.pipeline.data import load_split


def test_bytes_per_round_counts_directed_edges_and_vectors():
    ring = gossip_matrix("ring", 16)  # 16 edges, 32 directed
    assert bytes_per_round("dpsgd", ring, 10) == 32 * 1 * 10 * 4
    assert bytes_per_round("detag", ring, 10) == 32 * 2 * 10 * 4
    torus = gossip_matrix("torus", 16)  # degree 4: 64 directed edges
    assert bytes_per_round("dsgt", torus, 2410) == 64 * 2 * 2410 * 4


def test_seed_stats_mean_student_t_interval_and_range():
    s = seed_stats([1.0, 2.0, 3.0])
    # sd 1, sem 1/sqrt(3), t_{0.975, 2} = 4.3027
    assert s["mean"] == 2.0 and s["min"] == 1.0 and s["max"] == 3.0
    assert s["ci_hi"] - 2.0 == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)
    assert s["ci_lo"] == pytest.approx(4.0 - s["ci_hi"])
    assert seed_stats([0.5]) == {"mean": 0.5, "ci_lo": 0.5, "ci_hi": 0.5, "min": 0.5, "max": 0.5}
    assert not math.isfinite(seed_stats([1.0, math.inf])["mean"])
    with pytest.raises(ValueError, match="at least one value"):
        seed_stats([])


def test_at_budget_takes_the_last_row_within_the_bytes():
    rows = [{"round": r, "acc": r / 10} for r in (0, 4, 8, 12)]
    assert at_budget(rows, 100, 900, "acc") == 0.8  # round 8: 800 bytes <= 900 < 1200
    assert math.isnan(at_budget(rows[1:], 100, 300, "acc"))


def test_fast_path_is_seeded_and_seeds_differ():
    model = FlatModel(8)
    train, test = load_split("digits", 0.2, 0)
    g = gossip_matrix("ring", 4)

    def run(seed):
        splits = node_splits(train, 4, 25.0, seed)
        return simulate("detag", g, model, splits, test, 6, 0.2, 2, seed)

    a, b, c = run(0), run(0), run(1)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert not np.allclose([r["loss"] for r in a[1:]], [r["loss"] for r in c[1:]])


def test_quick_grid_setting_runs_d2_lazy_on_a_ring_and_aggregates_every_seed():
    argv = ["--quick", "--seeds", "3", "5", "--rounds", "4", "--out", "/tmp/x"]
    refusing = parse_args([*argv, "--no-lazy-d2"])
    row, raw = run_setting(4, "ring", 0.0, 1, refusing, FlatModel(4))
    assert row["cells"]["d2"]["refused"].startswith("D2 needs lambda_min(W) > -1/3")
    assert set(raw) == {"dpsgd", "dsgt", "detag"}
    args = parse_args([*argv, "--checkpoints", "2", "4"])
    row, raw = run_setting(4, "ring", 0.0, 1, args, FlatModel(4))
    lazy = "d2 (lazy, gap 0.333)"  # 4-ring: lambda_2 1/3 -> lazy 2/3
    assert set(raw) == {"dpsgd", lazy, "dsgt", "detag"} and "d2" not in row["cells"]
    assert row["cells"][lazy]["checkpoints"]["4"]["mean"] == pytest.approx(
        row["cells"][lazy]["loss"]["mean"]
    )
    assert "| 4 ring X0 b1 | d2 (lazy, gap 0.333) |" in markdown(
        [{**row, "nodes": 4, "topology": "ring", "homogeneity": 0.0, "batch": 1}], args
    )
    for name, r in raw.items():
        assert len(r["rows"]) == 2, name
        finals = [rows[-1]["loss"] for rows in r["rows"]]
        assert row["cells"][name]["loss"]["mean"] == pytest.approx(np.mean(finals))
    with pytest.raises(SystemExit):
        parse_args(["--seeds", "1", "1"])
