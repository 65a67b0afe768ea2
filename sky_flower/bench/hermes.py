"""Benchmark: Hermes against BSP, ASP and SSP on one emulated fleet, several seeds.

Runs ``python -m sky_flower.run strategy=<method> seed=<s>`` once per method and seed (each
in its own process, so each gets a fresh Flower simulation engine), by default on 8
workers with SkyComputing's slowdowns 1-6 and slow emulated uplinks
(``fleet=slowlinks8``; also ``straggler8``: 10:1, ``slowlinks16``: 16 workers), a wider
MLP (64 -> 256 -> 10), SGD step 0.07 (:data:`FULL_LR`) and the digits data, every method
until the same target test accuracy (or its time cap), seed by seed, then writes into
``--out``:

- ``table.md`` / ``table.csv``: per method, mean and spread (sample standard deviation)
  over the seeds of the server's wall time to the target and to 0.9, updates and bytes
  sent, worker rounds, rounds per worker (and the fewest), the share of minor rounds, the
  share of merges that raised the test loss after 0.9; Hermes' speed-up over BSP and its
  communication saving over SSP, per seed and beside the paper's 13.22x and 62.1 %;
- ``accuracy_vs_time.png``: test accuracy of the global model against wall time (seed 0);
- ``<method>_s<seed>/``: each job's output files (``results.json`` and the rest).

Usage::

    python -m sky_flower.bench.hermes --lock /tmp/sky-ray.lock  # 0.95, lr 0.07, 3 seeds, 180 s cap
    python -m sky_flower.bench.hermes --quick --lock /tmp/sky-ray.lock  # 0.9, 1 seed, 45 s cap
    python -m sky_flower.bench.hermes --from-dir --out DIR  # no jobs: tables of DIR's whole seeds

Every job starts Ray: ``--lock FILE`` runs each job under ``flock FILE`` (the lock is held
for one job at a time, not for the whole benchmark).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.compare import write_csv

METHODS = ("hermes", "bsp", "asp", "ssp")
#: The full bench's SGD step: at 0.3 (conf/hermes.yaml) BSP reaches 0.95 in 24 rounds per
#: worker; at 0.1 in 44 (slowlinks8, seed 0); 0.07 makes it 50+ (issue 18's "long run").
FULL_LR = 0.07
PAPER = {
    "speedup_vs_bsp": 13.22,  # "up to 13.22x less training time than synchronous training"
    "comm_saving_vs_ssp": 0.621,  # "62.1% less communication than stale-synchronous"
}


def run_method(
    method: str, out: Path, overrides: list[str], seed: int = 0, lock: str | None = None
) -> dict[str, Any]:
    """Run one job (``seed``) in a child process, under ``flock lock`` if given; return its
    ``results.json`` (with ``error`` set if the job failed or wrote none)."""
    job_dir = out / f"{method}_s{seed}"
    cmd = [
        *(["flock", lock] if lock else []),
        sys.executable,
        "-m",
        "sky_flower.run",
        f"strategy={method}",
        f"hydra.run.dir={job_dir}",
        f"seed={seed}",
        *overrides,
    ]
    print(f"[{method}] {' '.join(cmd[cmd.index('-m') + 1 :])}", flush=True)
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


def load_result(out: Path, method: str, seed: int) -> dict[str, Any]:
    """The ``results.json`` of ``<out>/<method>_s<seed>``."""
    return json.loads((out / f"{method}_s{seed}" / "results.json").read_text())


def complete_seeds(out: Path, methods: list[str], seeds: list[int]) -> list[int]:
    """The seeds (of ``seeds``) whose job directory in ``out`` has a ``results.json`` for
    every one of ``methods`` (a bench cut short leaves whole seeds and a partial one)."""
    return [s for s in seeds if all((out / f"{m}_s{s}" / "results.json").exists() for m in methods)]


def _stats(values: list[float | None]) -> tuple[float | None, float | None, int]:
    """Mean and sample standard deviation of the non-``None`` values (``None`` when there
    are none; spread 0 for one), and how many there were."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None, 0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0), len(vals)


def _scored(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in r.get("timeline") or [] if t.get("test_accuracy") is not None]


def time_to(r: dict[str, Any], accuracy: float) -> float | None:
    """Seconds (server clock) to the first test accuracy ``>= accuracy`` in the job's
    timeline; ``None`` if never."""
    return next((t["time_s"] for t in _scored(r) if t["test_accuracy"] >= accuracy), None)


def loss_raised_share(r: dict[str, Any], accuracy: float) -> float | None:
    """From the first test accuracy ``>= accuracy`` on: the share of the timeline's
    changes of the global model (an update merged, or a BSP barrier) that raised the test
    loss; ``None`` with fewer than two points. Near 0.5 the late merges are noise-dominated
    (ours: a diagnostic of why a method slows down near its target)."""
    tl = [t for t in _scored(r) if t.get("test_loss") is not None]
    i0 = next((i for i, t in enumerate(tl) if t["test_accuracy"] >= accuracy), None)
    if i0 is None or len(tl) - i0 < 2:
        return None
    seg = tl[i0:]
    raised = sum(b["test_loss"] > a["test_loss"] for a, b in zip(seg, seg[1:], strict=False))
    return raised / (len(seg) - 1)


def run_row(r: dict[str, Any]) -> dict[str, Any]:
    """One job's figures: time to target (s), wall time, updates and bytes sent, worker
    rounds, share of minor rounds, final test accuracy, error."""
    workers = r.get("workers") or []
    per_worker = [w["rounds"] for w in workers]
    rounds = sum(per_worker) if workers else None
    minor = sum(r.get("minor_rounds") or [])
    return {
        "time_to_0.9_s": time_to(r, 0.9),
        "raised_after_0.9": loss_raised_share(r, 0.9),
        "time_to_target_s": r.get("time_to_target_s"),
        "wall_time_s": r.get("wall_time_s"),
        "updates_sent_total": r.get("updates_sent_total"),
        "bytes_sent": r.get("bytes_sent"),
        "worker_rounds": rounds,
        "minor_share": minor / rounds if rounds else None,
        "rounds_per_worker": rounds / len(workers) if rounds else None,
        "min_rounds_per_worker": min(per_worker) if per_worker else None,
        "final_test_accuracy": r.get("final_test_accuracy"),
        "error": r.get("error"),
    }


FIGURES = ("time_to_target_s", "time_to_0.9_s", "updates_sent_total", "bytes_sent", "worker_rounds")


def summarise(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per method: mean and spread over its seeds of each figure, the seeds that
    reached the target, the share of minor rounds, the errors."""
    rows = []
    for method, results in runs.items():
        per = [run_row(r) for r in results]
        row: dict[str, Any] = {"method": method, "seeds": len(per)}
        for key in (*FIGURES, "rounds_per_worker", "minor_share", "raised_after_0.9",
                    "final_test_accuracy"):  # fmt: skip
            row[key], row[key + "_sd"], _ = _stats([p[key] for p in per])
        row["min_rounds_per_worker"] = min(
            (p["min_rounds_per_worker"] for p in per if p["min_rounds_per_worker"] is not None),
            default=None,
        )
        row["reached"] = sum(p["time_to_target_s"] is not None for p in per)
        row["wall_time_s"] = _stats([p["wall_time_s"] for p in per])[0]
        row["error"] = "; ".join(str(p["error"])[:80] for p in per if p["error"]) or None
        rows.append(row)
    return rows


def comparison(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Hermes' speed-up over BSP (time to target) and its saving in updates sent against
    SSP, per seed where both reached the target; mean and spread over those seeds."""
    h, b, s = (runs.get(m, []) for m in ("hermes", "bsp", "ssp"))
    speed = [
        rb["time_to_target_s"] / rh["time_to_target_s"]
        for rh, rb in zip(h, b, strict=False)
        if rh.get("time_to_target_s") and rb.get("time_to_target_s")
    ]
    saving = [
        1 - rh["updates_sent_total"] / rs["updates_sent_total"]
        for rh, rs in zip(h, s, strict=False)
        if rh.get("updates_sent_total") and rs.get("updates_sent_total")
    ]
    (sp, sp_sd, n_sp), (sv, sv_sd, n_sv) = _stats(speed), _stats(saving)  # type: ignore[arg-type]
    return {"speedup_vs_bsp": sp, "speedup_sd": sp_sd, "speedup_n": n_sp,
            "comm_saving_vs_ssp": sv, "saving_sd": sv_sd, "saving_n": n_sv,
            "speedups": speed, "savings": saving}  # fmt: skip


def _f(v: Any, sd: Any = None, fmt: str = "{:.1f}") -> str:
    if v is None:
        return "-"
    text = fmt.format(v) if isinstance(v, float) else str(v)
    return text if sd is None else f"{text} ± {fmt.format(sd)}"


def markdown(rows: list[dict[str, Any]], cmp: dict[str, Any], note: str) -> str:
    """The table (mean ± sample sd over seeds) and the comparison with the paper."""

    def mb(v: float | None) -> float | None:
        return None if v is None else v / 1e6

    def pct(v: float | None) -> float | None:
        return None if v is None else 100 * v

    cells = []
    for r in rows:
        cells.append(
            [
                r["method"],
                f"{r['reached']}/{r['seeds']}",
                _f(r["time_to_target_s"], r["time_to_target_s_sd"]),
                _f(r["updates_sent_total"], r["updates_sent_total_sd"], "{:.0f}"),
                _f(mb(r["bytes_sent"]), mb(r["bytes_sent_sd"]), "{:.2f}"),
                _f(r["worker_rounds"], r["worker_rounds_sd"], "{:.0f}"),
                f"{_f(r['rounds_per_worker'], r['rounds_per_worker_sd'], '{:.1f}')}"
                f" ({_f(r['min_rounds_per_worker'])})",
                _f(pct(r["minor_share"]), None, "{:.1f}%"),
                _f(r["final_test_accuracy"], r["final_test_accuracy_sd"], "{:.3f}"),
                _f(r["time_to_0.9_s"], r["time_to_0.9_s_sd"]),
                _f(pct(r["raised_after_0.9"]), None, "{:.0f}%"),
            ]
            + ([f"error: {r['error'][:160]}"] if r["error"] else [])
        )
    head = ["method", "reached", "time to target (s)", "updates sent", "bytes sent (MB)"]
    head += ["worker rounds", "rounds per worker (fewest)", "minor rounds", "final test acc"]
    head += ["time to 0.9 (s)", "merges raising the test loss after 0.9"]
    lines = [note, "", tables.markdown(head, cells)]
    speedup = _f(cmp["speedup_vs_bsp"], cmp["speedup_sd"], "{:.2f}")
    saving = _f(pct(cmp["comm_saving_vs_ssp"]), pct(cmp["saving_sd"]))
    paper = [
        ["Hermes training time vs BSP", f"{speedup}x less ({cmp['speedup_n']} seeds)"]
        + [f"up to {PAPER['speedup_vs_bsp']}x less"],
        ["Hermes communication vs SSP", f"{saving}% less ({cmp['saving_n']} seeds)"]
        + [f"{100 * PAPER['comm_saving_vs_ssp']:.1f}% less"],
    ]
    head = ["figure", "ours (mean ± sd over seeds)", "paper (arXiv 2410.20495)"]
    lines += [
        "",
        tables.markdown(head, paper),
        "",
        "Per seed: speed-up vs BSP "
        + (", ".join(f"{x:.2f}x" for x in cmp["speedups"]) or "-")
        + "; fewer updates than SSP "
        + (", ".join(f"{100 * x:.1f}%" for x in cmp["savings"]) or "-")
        + ".",
    ]
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict[str, Any]]], target: float, title: str, path: Path) -> None:
    """Test accuracy against wall time, one line per method (its first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, results in runs.items():
        r = results[0]
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
    ax.set_title(title)
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


FULL = {"target": 0.95, "max_time": 180.0, "seeds": [0, 1, 2], "hidden": 256, "lr": FULL_LR}
QUICK = {"target": 0.9, "max_time": 45.0, "seeds": [0], "hidden": 64}  # lr: conf's


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = cli.parser("hermes", __doc__, quick="target 0.9, 45 s cap, 1 seed")
    ap.add_argument("--target", type=float, help="target test accuracy")
    ap.add_argument("--max-time", type=float, help="cap per job (s)")
    ap.add_argument("--seeds", type=int, nargs="+", help="default 0 1 2")
    ap.add_argument("--fleet", default="slowlinks8", help="slowlinks8|straggler8|slowlinks16|...")
    ap.add_argument("--hidden", type=int, help="MLP width (default 256; quick 64)")
    ap.add_argument("--lr", type=float, help=f"SGD step (default {FULL_LR}; quick: conf's 0.3)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--lock", default=None, help="run each job under `flock LOCK`")
    ap.add_argument(
        "--from-dir",
        action="store_true",
        help="run nothing: tables and plot from the whole seeds already in --out",
    )
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job")
    return cli.parse(ap, argv, FULL, QUICK)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return 1 if a job failed."""
    args = _args(argv)
    target, cap, seeds, hidden, lr = args.target, args.max_time, args.seeds, args.hidden, args.lr
    if args.from_dir and args.out is None:
        raise SystemExit("--from-dir reads the jobs in --out: give --out DIR")
    out = cli.out_dir(args.out, "hermes")
    overrides = [
        f"fleet={args.fleet}",
        f"strategy.target_accuracy={target}",
        f"strategy.max_time_s={cap}",
        f"strategy.hidden_width={hidden}",
        *([f"strategy.lr={lr}"] if lr is not None else []),
        *args.overrides,
    ]
    t0 = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    if args.from_dir:  # no jobs: the table of the whole seeds already in --out
        seeds = complete_seeds(out, args.methods, seeds)
        runs = {m: [load_result(out, m, seed) for seed in seeds] for m in args.methods}
    for seed in [] if args.from_dir else seeds:  # seed by seed: a cut bench keeps whole seeds
        for m in args.methods:
            runs[m].append(run_method(m, out, overrides, seed, args.lock))
    if not seeds:
        raise SystemExit(f"no seed with a results.json for every method in {out}")
    rows = summarise(runs)
    note = (
        f"{'QUICK MODE: ' if args.quick else ''}fleet {args.fleet}, MLP 64-{hidden}-10, "
        f"lr {lr if lr is not None else 'conf'}, digits, target test accuracy {target:g}, "
        f"cap {cap:g} s per job, seeds "
        f"{' '.join(map(str, seeds))}; mean ± sample sd over the seeds that reached the "
        "target (time) or over all seeds (the rest); wall time on the server's clock from "
        "the end of the readiness barrier (Hermes' sizing happens inside training). Updates "
        "/ bytes sent: worker models that reached the server (float32) up to the end of the "
        "run (it stops at the target); minor rounds: share of worker rounds that sent nothing."
    )
    text = markdown(rows, comparison(runs), note)
    (out / "table.md").write_text(text)
    write_csv(rows, out / "table.csv", list(rows[0]))
    plot(runs, target, f"{args.fleet}, MLP 64-{hidden}-10, digits", out / "accuracy_vs_time.png")
    print(text)
    print(f"benchmark finished in {time.monotonic() - t0:.0f} s; outputs in {out}")
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
