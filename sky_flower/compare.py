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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from sky_flower import tables

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
    """Rows as a text table (a failed job's error after its row)."""

    def fmt(v: Any) -> str:  # noqa: ANN401 - a JSON value
        return tables.num(v, ".4f") if isinstance(v, float) else tables.num(v, "")

    head = ["job", "allocation", "fleet", "predicted s", "measured s", "bound s", "test acc"]
    cells = [
        [fmt(r[k]) for k in ("job", *COLUMNS[1:-1])]
        + ([f" error: {r['error'][:80]}"] if r["error"] else [])
        for r in rows
    ]
    return tables.text([*head, ""], cells, align="rll" + "r" * 4 + "l", rule=True)


def summarise(sweep_dir: Path) -> list[dict[str, Any]]:
    """Collect the jobs of ``sweep_dir``, write them to its ``summary.csv``, return them."""
    rows = collect(sweep_dir)
    write_csv(rows, sweep_dir / "summary.csv", COLUMNS)
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path, columns: list[str]) -> None:
    """Write ``rows`` (dicts with ``columns``) as CSV."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def finish_sweep(
    config: DictConfig,
    summarise: Callable[[Path], list[dict[str, Any]]],
    report: Callable[[list[dict[str, Any]], Path], str],
    failed: Callable[[dict[str, Any]], bool],
) -> None:
    """A sweep callback's end of a multirun: print the ``report`` of the ``summarise``d
    jobs of ``hydra.sweep.dir``; exit 1 naming the ``failed`` ones (the sweep went on
    past them; its exit status still says so)."""
    sweep_dir = Path(str(config.hydra.sweep.dir))
    if not sweep_dir.exists():
        return
    rows = summarise(sweep_dir)
    print(report(rows, sweep_dir))
    bad = [r["job"] for r in rows if failed(r)]
    if bad:
        raise SystemExit(f"{len(bad)} of {len(rows)} jobs failed: {', '.join(bad)}")


def sweep_cli(
    argv: list[str] | None,
    module: str,
    collect: Callable[[Path], list[dict[str, Any]]],
    job_file: str,
    show: Callable[[Path], str],
) -> int:
    """``python -m sky_flower.<module> <sweep directory>``: print ``show`` of it; 1
    (writing nothing) when it holds no jobs (no ``collect``ed ``job_file``)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m sky_flower.{module} <multirun sweep directory>", file=sys.stderr)
        return 1
    sweep_dir = Path(args[0])
    if not sweep_dir.is_dir() or not collect(sweep_dir):
        print(
            f"error: no sweep jobs found in {sweep_dir} (expected Hydra multirun job folders "
            f"with {job_file})",
            file=sys.stderr,
        )
        return 1
    print(show(sweep_dir))
    return 0


class SweepSummary(Callback):
    """Hydra callback: print and save the comparison when a multirun ends; exit 1 if
    any job failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Summarise ``hydra.sweep.dir``."""
        finish_sweep(
            config,
            summarise,
            lambda rows, d: f"\nsky-flower sweep summary ({d / 'summary.csv'}):\n{table(rows)}",
            lambda r: bool(r["error"]),
        )


def main(argv: list[str] | None = None) -> int:
    """Command line: print the table and write ``summary.csv``; 1 (writing nothing) when the
    directory holds no sweep jobs."""
    return sweep_cli(argv, "compare", collect, "results.json", lambda d: table(summarise(d)))


if __name__ == "__main__":
    sys.exit(main())
