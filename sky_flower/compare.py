"""Compare the jobs of a Hydra multirun side by side.

Runs by itself at the end of ``python -m sky_flower.run -m ...`` (a Hydra callback set in
``conf/config.yaml``), or by hand::

    python -m sky_flower.compare multirun/2026-11-29/16-00-00

prints one row per job (allocation, fleet, predicted and measured step time, lower
bound, final test accuracy) and writes ``summary.csv`` into the sweep directory.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = [
    "job",
    "allocation",
    "fleet",
    "predicted_step_time_s",
    "measured_step_time_s",
    "lower_bound_s",
    "final_test_accuracy",
    "error",
]


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory of ``sweep_dir`` that has a ``results.json``."""
    rows = []
    for results_file in sorted(sweep_dir.glob("*/results.json"), key=lambda p: p.parent.name):
        results = json.loads(results_file.read_text())
        plan_file = results_file.parent / "plan.json"
        plan = json.loads(plan_file.read_text()) if plan_file.exists() else {}
        measured = [r["measured_step_time_s"] for r in results.get("rounds", [])]
        rows.append(
            {
                "job": results_file.parent.name,
                "allocation": results.get("allocation"),
                "fleet": results.get("fleet"),
                "predicted_step_time_s": plan.get("predicted_step_time_s"),
                "measured_step_time_s": statistics.median(measured) if measured else None,
                "lower_bound_s": plan.get("lower_bound_s"),
                "final_test_accuracy": results.get("final_test_accuracy"),
                "error": results.get("error"),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Rows as a text table."""

    def fmt(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v))

    head = (
        f"{'job':>4}  {'allocation':<10} {'fleet':<9} {'predicted s':>11} "
        f"{'measured s':>10} {'bound s':>8} {'test acc':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['job']:>4}  {fmt(r['allocation']):<10} {fmt(r['fleet']):<9} "
            f"{fmt(r['predicted_step_time_s']):>11} {fmt(r['measured_step_time_s']):>10} "
            f"{fmt(r['lower_bound_s']):>8} {fmt(r['final_test_accuracy']):>8}"
            + (f"  error: {r['error'][:80]}" if r["error"] else "")
        )
    return "\n".join(lines)


def summarise(sweep_dir: Path) -> list[dict[str, Any]]:
    """Collect the jobs of ``sweep_dir``, write them to its ``summary.csv``, return them."""
    rows = collect(sweep_dir)
    with open(sweep_dir / "summary.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


class SweepSummary(Callback):
    """Hydra callback: print and save the comparison when a multirun ends; exit 1 if
    any job failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Summarise ``hydra.sweep.dir``."""
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.exists():
            return
        rows = summarise(sweep_dir)
        print(f"\nsky-flower sweep summary ({sweep_dir / 'summary.csv'}):")
        print(table(rows))
        failed = [r["job"] for r in rows if r["error"]]
        if failed:  # the sweep went on past them; its exit status still says so
            raise SystemExit(f"{len(failed)} of {len(rows)} jobs failed: {', '.join(failed)}")


def main(argv: list[str] | None = None) -> int:
    """Command line: print the table and write ``summary.csv``; 1 (writing nothing) when the
    directory holds no sweep jobs."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m sky_flower.compare <multirun sweep directory>", file=sys.stderr)
        return 1
    sweep_dir = Path(args[0])
    if not sweep_dir.is_dir() or not collect(sweep_dir):
        print(
            f"error: no sweep jobs found in {sweep_dir} (expected Hydra multirun job folders "
            "with results.json)",
            file=sys.stderr,
        )
        return 1
    print(table(summarise(sweep_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
