"""The Hermes benchmark's figures (sky_flower/bench/hermes.py), from hand-made
``results.json`` dicts: rounds per worker, minor-round share, mean and spread over seeds,
Hermes against BSP and SSP per seed. No engine runs here."""

from __future__ import annotations

import pytest

from sky_flower.bench import hermes as bench


def _result(rounds: list[int], minor: list[int], t: float | None, updates: int) -> dict:
    return {
        "workers": [{"rounds": r} for r in rounds],
        "minor_rounds": minor,
        "time_to_target_s": t,
        "wall_time_s": t or 99.0,
        "updates_sent_total": updates,
        "bytes_sent": 4 * updates,
        "final_test_accuracy": 0.95,
        "error": None,
    }


def test_run_row_counts_rounds_per_worker_and_minor_share():
    row = bench.run_row(_result([50, 60, 70], [10, 0, 5], 12.0, 165))
    assert row["worker_rounds"] == 180
    assert row["rounds_per_worker"] == 60.0
    assert row["min_rounds_per_worker"] == 50
    assert row["minor_share"] == pytest.approx(15 / 180)


def test_summarise_gives_mean_sd_and_fewest_rounds_over_seeds():
    runs = {
        "bsp": [
            _result([50, 50], [0, 0], 10.0, 100),
            _result([54, 54], [0, 0], 14.0, 108),
            _result([52, 52], [0, 0], None, 104),
        ]
    }
    (row,) = bench.summarise(runs)
    assert row["reached"] == 2 and row["seeds"] == 3
    assert row["time_to_target_s"] == 12.0  # over the seeds that reached the target
    assert row["time_to_target_s_sd"] == pytest.approx(2**0.5 * 2)
    assert row["rounds_per_worker"] == 52.0 and row["min_rounds_per_worker"] == 50
    text = bench.markdown([row], bench.comparison(runs), "note")
    assert "| bsp | 2/3 | 12.0 ± 2.8 |" in text and "52.0 ± 2.0 (50)" in text


def test_comparison_is_per_seed_ratios():
    runs = {
        "hermes": [_result([1], [0], 5.0, 40), _result([1], [0], 10.0, 30)],
        "bsp": [_result([1], [0], 20.0, 80), _result([1], [0], 20.0, 80)],
        "ssp": [_result([1], [0], 4.0, 80), _result([1], [0], 4.0, 60)],
    }
    cmp = bench.comparison(runs)
    assert cmp["speedup_vs_bsp"] == 3.0 and cmp["speedup_n"] == 2  # 4x and 2x
    assert cmp["comm_saving_vs_ssp"] == 0.5 and cmp["saving_sd"] == 0.0


def test_time_to_and_loss_raised_share_read_the_timeline():
    r = {
        "timeline": [
            {"time_s": 0.0, "test_accuracy": 0.1, "test_loss": 2.0},
            {"time_s": 1.0, "test_accuracy": 0.91, "test_loss": 0.5},
            {"time_s": 2.0, "test_accuracy": 0.90, "test_loss": 0.6},  # raised
            {"time_s": 3.0, "test_accuracy": 0.93, "test_loss": 0.4},
            {"time_s": 4.0, "test_accuracy": 0.93, "test_loss": 0.4},  # equal: not raised
            {"time_s": 5.0, "event": "no evaluation"},
        ]
    }
    assert bench.time_to(r, 0.9) == 1.0 and bench.time_to(r, 0.93) == 3.0
    assert bench.time_to(r, 0.99) is None
    assert bench.loss_raised_share(r, 0.9) == pytest.approx(1 / 3)
    assert bench.loss_raised_share(r, 0.93) == 0.0
    assert bench.loss_raised_share(r, 0.99) is None


def test_from_dir_reads_only_whole_seeds(tmp_path, capsys):
    import json

    for name in ("hermes_s0", "bsp_s0", "ssp_s0", "hermes_s1"):  # seed 1 cut short
        (tmp_path / name).mkdir()
        t = {"hermes": 5.0, "bsp": 20.0, "ssp": 4.0}[name.split("_")[0]]
        (tmp_path / name / "results.json").write_text(json.dumps(_result([3, 3], [1, 0], t, 6)))
    methods = ["hermes", "bsp", "ssp"]
    assert bench.complete_seeds(tmp_path, methods, [0, 1, 2]) == [0]
    argv = ["--from-dir", "--out", str(tmp_path), "--methods", *methods, "--seeds", "0", "1"]
    assert bench.main(argv) == 0
    text = (tmp_path / "table.md").read_text()
    assert "seeds 0;" in text and "speed-up vs BSP 4.00x" in text
    assert (tmp_path / "accuracy_vs_time.png").exists() and (tmp_path / "table.csv").exists()
    with pytest.raises(SystemExit, match="give --out"):
        bench.main(["--from-dir"])
