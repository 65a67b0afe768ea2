"""Collect a planner sweep into one CSV and one figure.

Runs by itself at the end of ``python -m sky_flower.plan -m ...`` (a Hydra callback set
in ``conf/plan.yaml``), or by hand::

    python -m sky_flower.plan_sweep multirun/2026-11-29/16-00-00

reads every job's ``plan_row.json`` and writes into the sweep directory

* ``plan_sweep.csv``: one row per job (:data:`COLUMNS`);
* ``plan_sweep.png``: the objective (predicted step time, or the period for
  ``objective=throughput``) against the node count, one line per allocation (and per
  other swept setting), one panel per ``num_layers``, with the lower bound dashed.

Jobs whose status is ``infeasible`` (no split fits memory) or ``refused`` (the method
does not apply, e.g. ``even`` with more nodes than layers) are results of the study: they
are listed in the CSV and left out of the figure. A job with status ``error`` (a bad
config, a crash) makes the sweep exit 1.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from sky_flower.compare import finish_sweep, sweep_cli, write_csv
from sky_flower.jobs.plan import ROW_FILE

COLUMNS = [
    "job",
    "model",
    "fleet",
    "nodes",
    "num_layers",
    "entries",
    "allocation",
    "objective",
    "microbatches",
    "kind",
    "transport",
    "predicted_step_time_s",
    "period_s",
    "lower_bound_s",
    "ratio_to_lower_bound",
    "solve_time_s",
    "proven_optimal",
    "idle_nodes",
    "status",
    "error",
]
# Settings that may vary in a sweep besides nodes, num_layers and allocation: a line of
# the figure is one combination of them.
MARKERS = ("o", "s", "^", "D", "v", "<", ">")
DASHES = ("-", "--", ":", "-.")
LINE_KEYS = ("allocation", "objective", "microbatches", "kind", "transport", "model", "fleet")


def _job_key(path: Path) -> tuple[int, str]:
    name = path.parent.name
    return (int(name), name) if name.isdigit() else (sys.maxsize, name)


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory of ``sweep_dir`` that has a ``plan_row.json``."""
    rows = []
    for row_file in sorted(sweep_dir.glob(f"*/{ROW_FILE}"), key=_job_key):
        row = json.loads(row_file.read_text())
        rows.append({"job": row_file.parent.name, **{k: row.get(k) for k in COLUMNS[1:]}})
    return rows


def _value(row: dict[str, Any]) -> float | None:
    key = "period_s" if row.get("objective") == "throughput" else "predicted_step_time_s"
    v = row.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) and v > 0 else None


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Draw the sweep figure into ``path`` (PNG); False if no job has a plan to draw.

    Uses matplotlib's object API on the Agg canvas (no pyplot, no global state).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in rows if r.get("status") == "ok" and _value(r) is not None]
    if not ok:
        return False
    varying = [k for k in LINE_KEYS if len({str(r.get(k)) for r in ok}) > 1] or ["allocation"]
    panels: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in ok:
        panels[r.get("num_layers")].append(r)
    keys = sorted(panels, key=lambda k: (k is None, k if isinstance(k, int) else 0, str(k)))
    cols = min(len(keys), 3)
    nrows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4.6 * cols, 3.6 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    objectives = {r.get("objective") for r in ok}
    ylabel = (
        "period (s / micro-batch)"
        if objectives == {"throughput"}
        else "predicted step time (s)"
        if objectives == {"step"}
        else "objective (s)"
    )

    def _joined(key: str) -> str:
        return "/".join(sorted({str(r.get(key)) for r in ok}))

    fig.suptitle(
        f"{_joined('model')} on {_joined('fleet')}: objective {_joined('objective')}, "
        f"{_joined('kind')}, M = {_joined('microbatches')} micro-batch(es), "
        f"{_joined('transport')} transport",
        fontsize=10,
    )
    for p, key in enumerate(keys):
        ax = fig.add_subplot(nrows, cols, p + 1)
        prow = panels[key]
        lines: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
        bound: dict[int, float] = {}
        for r in prow:
            n = int(r["nodes"])
            lines[tuple(str(r.get(k)) for k in varying)].append((n, _value(r)))  # type: ignore[arg-type]
            lb = r.get("lower_bound_s")
            if isinstance(lb, int | float) and lb > 0:
                bound[n] = max(bound.get(n, 0.0), float(lb))
        for n_line, (label, pts) in enumerate(sorted(lines.items())):
            pts.sort()
            ax.plot(  # methods often coincide: marker and dash tell them apart
                [x for x, _ in pts],
                [y for _, y in pts],
                marker=MARKERS[n_line % len(MARKERS)],
                linestyle=DASHES[n_line % len(DASHES)],
                fillstyle="full" if n_line == 0 else "none",
                markersize=7 - n_line % 3,
                label=" ".join(label),
            )
        if bound:
            xs = sorted(bound)
            ax.plot(xs, [bound[x] for x in xs], "k--", lw=1, label="lower bound")
        xs_all = sorted({int(r["nodes"]) for r in prow})
        if len(xs_all) > 1 and xs_all[0] > 0:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs_all, [str(x) for x in xs_all])
        ys = [_value(r) for r in prow] + list(bound.values())
        ys = [y for y in ys if y]
        if ys and max(ys) / min(ys) > 10:
            ax.set_yscale("log")
        entries = sorted({r.get("entries") for r in prow if r.get("entries")})
        title = f"num_layers={key}" if key is not None else "model"
        if entries:
            title += f" ({', '.join(str(e) for e in entries)} entries)"
        failed = [
            r
            for r in rows
            if r.get("num_layers") == key and r.get("status") in ("infeasible", "refused")
        ]
        if failed:
            title += f"\n{len(failed)} infeasible/refused, not drawn"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("nodes")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)
    return True


def summarise(sweep_dir: Path) -> list[dict[str, Any]]:
    """Collect ``sweep_dir``'s jobs into ``plan_sweep.csv`` and ``plan_sweep.png``."""
    rows = collect(sweep_dir)
    write_csv(rows, sweep_dir / "plan_sweep.csv", COLUMNS)
    plot(rows, sweep_dir / "plan_sweep.png")
    return rows


def report(rows: list[dict[str, Any]], sweep_dir: Path) -> str:
    """Where the files went and how many jobs ended how."""
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[str(r.get("status"))] += 1
    png = sweep_dir / "plan_sweep.png"
    lines = [
        f"\nsky-flower plan sweep: {len(rows)} jobs ("
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + ")",
        f"  CSV: {sweep_dir / 'plan_sweep.csv'}",
        f"  PNG: {png if png.exists() else '(none: no job produced a plan)'}",
    ]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"  job {r['job']} {r.get('status')}: {str(r.get('error'))[:120]}")
    return "\n".join(lines)


class PlanSweepSummary(Callback):
    """Hydra callback: write the CSV and figure when a planner multirun ends; exit 1 if a
    job failed with an error (a bad config or a crash; ``infeasible`` and ``refused``
    jobs are results)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Summarise ``hydra.sweep.dir``."""
        finish_sweep(config, summarise, report, lambda r: r.get("status") == "error")


def main(argv: list[str] | None = None) -> int:
    """Command line: write the CSV and figure, print :func:`report`; 1 (writing nothing)
    when the directory holds no sweep jobs."""
    return sweep_cli(argv, "plan_sweep", collect, ROW_FILE, lambda d: report(summarise(d), d))


if __name__ == "__main__":
    sys.exit(main())
