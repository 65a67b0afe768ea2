"""Benchmark: Hermes against BSP, ASP and SSP on one emulated fleet.

Runs ``python -m sky_flower.run strategy=<method>`` once per method (each in its own
process, so each gets a fresh Flower simulation engine), on 8 workers with SkyComputing's
slowdowns 1-6 (``fleet=skycomputing8``) and the digits data, every method until the same
target test accuracy (or its time cap), then writes into ``--out``:

- ``table.md`` / ``table.csv``: per method the server's wall time to the target, updates
  sent (in all and per worker), rounds the workers ran, final test accuracy; Hermes'
  speed-up over BSP and its communication saving over SSP beside the paper's figures;
- ``accuracy_vs_time.png``: test accuracy of the global model against wall time;
- ``<method>/``: each job's output files (``results.json`` and the rest).

Usage::

    python -m sky_flower.bench.hermes            # target 0.9, 4 methods, ~6-10 min on 2 cores
    python -m sky_flower.bench.hermes --quick    # target 0.8, cap 60 s per method, ~3-4 min

Every job starts Ray: on a shared machine wrap it in ``flock /tmp/sky-ray.lock``.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

METHODS = ("hermes", "bsp", "asp", "ssp")
PAPER = {
    "speedup_vs_bsp": 13.22,  # "up to 13.22x less training time than synchronous training"
    "comm_saving_vs_ssp": 0.621,  # "62.1% less communication than stale-synchronous"
}


def run_method(method: str, out: Path, overrides: list[str]) -> dict[str, Any]:
    """Run one job in a child process; return its ``results.json`` (with ``error`` set if
    the job failed or wrote none)."""
    job_dir = out / method
    cmd = [
        sys.executable,
        "-m",
        "sky_flower.run",
        f"strategy={method}",
        f"hydra.run.dir={job_dir}",
        *overrides,
    ]
    print(f"[{method}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    results_file = job_dir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if proc.returncode != 0 and not results.get("error"):
        results["error"] = f"exit {proc.returncode}: {proc.stderr[-500:]}"
    results.setdefault("strategy", method)
    print(
        f"[{method}] done in {time.monotonic() - t0:.0f} s: time to target "
        f"{results.get('time_to_target_s')}, updates {results.get('updates_sent_total')}"
        + (f", error {results['error']}" if results.get("error") else ""),
        flush=True,
    )
    return results


def summarise(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method."""
    rows = []
    for method, r in runs.items():
        workers = r.get("workers") or []
        rows.append(
            {
                "method": method,
                "target_accuracy": r.get("target_accuracy"),
                "time_to_target_s": r.get("time_to_target_s"),
                "wall_time_s": r.get("wall_time_s"),
                "final_test_accuracy": r.get("final_test_accuracy"),
                "updates_sent_total": r.get("updates_sent_total"),
                "worker_rounds": sum(w["rounds"] for w in workers) if workers else None,
                "updates_sent": " ".join(str(u) for u in r.get("updates_sent") or []),
                "error": r.get("error"),
            }
        )
    return rows


def comparison(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Hermes' speed-up over BSP (time to target) and its saving in updates sent against
    SSP, both up to the target."""
    by = {r["method"]: r for r in rows}
    h, b, s = by.get("hermes", {}), by.get("bsp", {}), by.get("ssp", {})
    speedup = saving = None
    if h.get("time_to_target_s") and b.get("time_to_target_s"):
        speedup = b["time_to_target_s"] / h["time_to_target_s"]
    if h.get("updates_sent_total") and s.get("updates_sent_total"):
        saving = 1 - h["updates_sent_total"] / s["updates_sent_total"]
    return {"speedup_vs_bsp": speedup, "comm_saving_vs_ssp": saving}


def markdown(rows: list[dict[str, Any]], cmp: dict[str, float | None], note: str) -> str:
    """The table and the comparison with the paper, as markdown."""

    def f(v: Any, fmt: str = "{:.1f}") -> str:
        return "-" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))

    lines = [
        note,
        "",
        "| method | time to target (s) | updates sent | worker rounds | final test acc | "
        "updates per worker |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ttt = (
            f(r["time_to_target_s"])
            if r["time_to_target_s"] is not None
            else (f"not reached ({f(r['wall_time_s'])} s)")
        )
        lines.append(
            f"| {r['method']} | {ttt} | {f(r['updates_sent_total'])} | {f(r['worker_rounds'])} "
            f"| {f(r['final_test_accuracy'], '{:.3f}')} | {r['updates_sent']} |"
            + (f" error: {r['error'][:80]}" if r["error"] else "")
        )
    sp, sv = cmp["speedup_vs_bsp"], cmp["comm_saving_vs_ssp"]
    lines += [
        "",
        "| figure | ours | paper (arXiv 2410.20495) |",
        "|---|---|---|",
        f"| Hermes training time vs BSP | {f(sp, '{:.2f}x less')} | up to "
        f"{PAPER['speedup_vs_bsp']}x less |",
        f"| Hermes communication vs SSP | {f(None if sv is None else 100 * sv, '{:.1f}% less')} "
        f"| {100 * PAPER['comm_saving_vs_ssp']:.1f}% less |",
    ]
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[str, Any]], target: float, path: Path) -> None:
    """Test accuracy against wall time, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, r in runs.items():
        rows = [t for t in r.get("timeline") or [] if t.get("test_accuracy") is not None]
        if rows:
            ax.step(
                [t["time_s"] for t in rows],
                [t["test_accuracy"] for t in rows],
                where="post",
                label=f"{method} ({r.get('updates_sent_total')} updates)",
            )
    ax.axhline(target, color="grey", ls="--", lw=0.8, label=f"target {target:g}")
    ax.set_xlabel("wall time on the server (s)")
    ax.set_ylabel("test accuracy of the global model")
    ax.set_title("8 workers, SkyComputing slowdowns 1-6, digits")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 1 if a job failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="target 0.8, 60 s cap per method")
    ap.add_argument("--target", type=float, default=None, help="target test accuracy")
    ap.add_argument("--max-time", type=float, default=None, help="cap per method (s)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job")
    args = ap.parse_args(argv)
    target = args.target if args.target is not None else (0.8 if args.quick else 0.9)
    cap = args.max_time if args.max_time is not None else (60.0 if args.quick else 150.0)
    out = args.out or Path("outputs") / time.strftime("bench_hermes_%Y%m%d_%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"strategy.target_accuracy={target}",
        f"strategy.max_time_s={cap}",
        *args.overrides,
    ]
    t0 = time.monotonic()
    runs = {m: run_method(m, out, overrides) for m in args.methods}
    rows = summarise(runs)
    cmp = comparison(rows)
    note = (
        f"Target test accuracy {target:g}, cap {cap:g} s per method, 8 workers "
        "(SkyComputing slowdowns 1-6), digits; wall time on the server's clock, Hermes' "
        "benchmark round included. Updates sent: worker models that reached the server "
        "up to the end of the run (the run stops at the target)."
    )
    text = markdown(rows, cmp, note)
    (out / "table.md").write_text(text)
    with open(out / "table.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(runs, target, out / "accuracy_vs_time.png")
    print(text)
    print(f"benchmark finished in {time.monotonic() - t0:.0f} s; outputs in {out}")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
