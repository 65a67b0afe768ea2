"""The multirun summary reads every job's results and plan."""

import json

import pytest
from omegaconf import OmegaConf

from sky_flower.compare import SweepSummary, collect


def _job(root, name, allocation, predicted, measured, acc, error=None):
    d = root / name
    d.mkdir()
    rounds = [{"measured_step_time_s": m} for m in measured]
    (d / "results.json").write_text(
        json.dumps(
            {
                "allocation": allocation,
                "fleet": "edge4",
                "final_test_accuracy": acc,
                "rounds": rounds,
                "error": error,
            }
        )
    )
    (d / "plan.json").write_text(
        json.dumps({"predicted_step_time_s": predicted, "lower_bound_s": 0.5})
    )


def test_summary_rows_and_csv(tmp_path, capsys):
    _job(tmp_path, "0", "even", 2.0, [1.5, 1.4, 1.6], 0.97)
    _job(tmp_path, "1", "heuristic", 1.0, [1.2, 1.3, 1.1], 0.97)
    _job(tmp_path, "2", "optimal", 0.9, [], None, error="SkyNodeError: box")
    rows = collect(tmp_path)
    assert [r["allocation"] for r in rows] == ["even", "heuristic", "optimal"]
    assert rows[0]["measured_step_time_s"] == 1.5  # median of the rounds
    assert rows[2]["measured_step_time_s"] is None and rows[2]["error"]
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit, match="1 of 3 jobs failed: 2"):
        SweepSummary().on_multirun_end(cfg)
    out = capsys.readouterr().out
    assert "heuristic" in out and "error: SkyNodeError" in out
    lines = (tmp_path / "summary.csv").read_text().splitlines()
    assert lines[0].startswith("job,allocation") and len(lines) == 4
