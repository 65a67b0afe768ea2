"""The noise-dominated regime of the decentralized benchmark (issue 18), several seeds.

    python -m sky_flower.bench.decentralized --noise            # the grid below
    python -m sky_flower.bench.decentralized --noise --quick    # about a minute

Grid: ``--nodes`` (16, 32) x ``--topologies`` (ring, torus; each its own Metropolis-Hastings
gap) x ``--homogeneity`` (0, 25 %: label-sorted data) x ``--batch-sizes`` (1, 4 per node)
x ``--algorithms`` (D-PSGD, D2, DSGT, DeTAG), each run for every ``--seeds`` seed (the seed
draws the data split, the initial model and the mini-batches). Where D2 refuses ``W``
(``lambda_min(W) <= -1/3``: even rings, these tori) it runs on the lazy matrix
``(I + W) / 2`` instead, labelled ``d2 (lazy, gap ...)`` with that matrix's gap
(``--no-lazy-d2``: the table says "refused"). ``--hidden-width`` sets the MLP's width,
``--checkpoints`` adds a table of the loss at those gossip rounds. The step size is the
best of ``--lrs`` on the first seed (lowest final training loss), then run on every seed.
Training loss (of the averaged model, over all nodes' data) and test accuracy are recorded
against gossip rounds and against bytes sent (:func:`bytes_per_round`); the table gives
mean, 95 % confidence interval (Student t over seeds) and min-max at the last round and at
equal bytes; one PNG per setting (mean line, min-max band). Uses the fast path of
:mod:`sky_flower.bench.decentralized`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.bench.decentralized_fast import simulate
from sky_flower.gossip.algorithms import ALGORITHMS, PHASE_RULES, DeTAG, make_algorithm
from sky_flower.gossip.matrices import GossipMatrix, gossip_matrix
from sky_flower.gossip.training import FlatModel, node_splits
from sky_flower.pipeline.data import load_split

VECTORS_SENT = {"dpsgd": 1, "d2": 1, "dsgt": 2, "detag": 2}
"""Vectors of ``d`` floats each node sends each neighbour per gossip round: the model
(D-PSGD, D2: D2 gossips ``2 x_t - x_{t-1} - ...``, one vector), model and tracker (DSGT,
DeTAG)."""


def bytes_per_round(algorithm: str, gossip: GossipMatrix, dim: int, item_bytes: int = 4) -> int:
    """Bytes the whole network sends in one gossip round: every node sends
    ``VECTORS_SENT[algorithm]`` vectors of ``dim`` float32 values to each neighbour
    (``2 |E|`` directed edges, the nonzero off-diagonal entries of ``W``).

    Raises
    ------
    KeyError
        Unknown algorithm.
    """
    w = gossip.W
    directed_edges = int(np.count_nonzero(np.abs(w - np.diag(np.diag(w))) > 1e-12))
    return directed_edges * VECTORS_SENT[algorithm] * dim * item_bytes


def seed_stats(values: list[float], confidence: float = 0.95) -> dict[str, float]:
    """Mean, Student-t confidence interval of the mean, min and max over seeds.

    ``values``: one number per seed (NaN/inf kept: the mean is then not finite). With one
    value the interval is that value. Returns ``{"mean", "ci_lo", "ci_hi", "min", "max"}``.

    Raises
    ------
    ValueError
        No values, or ``confidence`` outside (0, 1).
    """
    if not values:
        raise ValueError("seed_stats needs at least one value")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    a = np.asarray(values, dtype=float)
    mean = float(a.mean())
    half = 0.0
    if len(a) > 1:
        with np.errstate(invalid="ignore"):  # a diverged seed (inf): the interval is nan
            sem = float(a.std(ddof=1)) / math.sqrt(len(a))
        half = float(stats.t.ppf(0.5 + confidence / 2.0, len(a) - 1)) * sem
    return {
        "mean": mean,
        "ci_lo": mean - half,
        "ci_hi": mean + half,
        "min": float(a.min()),
        "max": float(a.max()),
    }


def at_budget(rows: list[dict[str, Any]], per_round: int, budget: float, key: str) -> float:
    """``key`` of the last row whose bytes sent (``round * per_round``) are <= ``budget``."""
    ok = [r for r in rows if r["round"] * per_round <= budget]
    return float(ok[-1][key]) if ok else math.nan


def at_round(rows: list[dict[str, Any]], rnd: int, key: str) -> float:
    """``key`` of the last row at or before gossip round ``rnd`` (inf if the run diverged
    before it; NaN if no row is that early)."""
    ok = [r for r in rows if r["round"] <= rnd]
    if not ok:
        return math.nan
    if rows[-1]["round"] < rnd and not math.isfinite(rows[-1][key] or math.inf):
        return math.inf
    value = ok[-1][key]
    return math.inf if value is None or not math.isfinite(value) else float(value)


def _final(rows: list[dict[str, Any]], key: str) -> float:
    value = rows[-1][key]
    return math.inf if value is None or not math.isfinite(value) else float(value)


def run_setting(  # noqa: PLR0913
    nodes: int,
    topology: str,
    homogeneity: float,
    batch: int,
    args: argparse.Namespace,
    model: FlatModel,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """All algorithms and seeds of one setting: ``(table cells, raw runs)``."""
    gossip = gossip_matrix(topology, nodes)
    train, test = load_split("digits", 0.2, 0)
    splits = {s: node_splits(train, nodes, homogeneity, s) for s in args.seeds}
    detag = {"phase_rounds": args.phase_rounds, "variant": args.variant}
    detag["phase_rule"], detag["eta"] = args.phase_rule, args.eta
    cells: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for name in args.algorithms:
        label, net = name, gossip
        try:
            alg = make_algorithm(name, gossip, args.lrs[0], **detag)
        except ValueError as err:
            if name != "d2" or not args.lazy_d2:
                cells[name] = {"refused": str(err).split(":")[0]}
                continue
            # D2 refused (lambda_min <= -1/3): run it on the lazy matrix (I + W) / 2
            net = gossip.lazy()
            label = f"d2 (lazy, gap {net.spectral_gap:.3f})"
            alg = make_algorithm(name, net, args.lrs[0], **detag)

        def run(lr: float, seed: int, name: str = name, net: GossipMatrix = net) -> list[dict]:
            return simulate(
                name, net, model, splits[seed], test, args.rounds, lr, batch, seed, **detag
            )

        first = {lr: run(lr, args.seeds[0]) for lr in args.lrs}
        lr = min(first, key=lambda v: _final(first[v], "loss"))
        runs = [first[lr]] + [run(lr, s) for s in args.seeds[1:]]
        per_round = bytes_per_round(name, net, model.dim)
        raw[label] = {"lr": lr, "rows": runs, "per_round": per_round}
        cells[label] = {
            "lr": lr,
            "R": alg.rounds_per_step if isinstance(alg, DeTAG) else 1,
            "loss": seed_stats([_final(r, "loss") for r in runs]),
            "acc": seed_stats([_final(r, "test_accuracy") for r in runs]),
            "tuning": {f"{v:g}": _final(first[v], "loss") for v in args.lrs},
            "checkpoints": {
                str(c): seed_stats([at_round(r, c, "loss") for r in runs]) for c in args.checkpoints
            },
        }
    # equal bytes: the budget D-PSGD (1 vector a round) spends in all its rounds
    budget = args.rounds * bytes_per_round("dpsgd", gossip, model.dim)
    for name, r in raw.items():
        cells[name]["acc_at_bytes"] = seed_stats(
            [at_budget(rows, r["per_round"], budget, "test_accuracy") for rows in r["rows"]]
        )
        cells[name]["loss_at_bytes"] = seed_stats(
            [at_budget(rows, r["per_round"], budget, "loss") for rows in r["rows"]]
        )
    info = {"gap": gossip.spectral_gap, "lambda_min": gossip.lambda_min, "budget_bytes": budget}
    return {**info, "cells": cells}, raw


def plot_setting(title: str, raw: dict[str, Any], path: Path) -> None:
    """Loss and test accuracy against gossip rounds and against MB sent: seed mean (line)
    and min-max (band), one colour per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for name, r in raw.items():
        rounds = np.array([row["round"] for row in r["rows"][0]])
        for col, scale in ((0, 1.0), (1, r["per_round"] / 2**20)):
            for row_ax, key in ((0, "loss"), (1, "test_accuracy")):
                n = min(len(rows) for rows in r["rows"])
                vals = np.array([[row[key] for row in rows[:n]] for rows in r["rows"]], float)
                x, ax = rounds[:n] * scale, axes[row_ax, col]
                ax.plot(x, vals.mean(0), label=f"{name} (lr {r['lr']:g})")
                ax.fill_between(x, vals.min(0), vals.max(0), alpha=0.2)
    for col, xlabel in ((0, "gossip rounds"), (1, "MB sent (whole network)")):
        axes[0, col].set_yscale("log")
        axes[0, col].set_ylabel("training loss (averaged model)")
        axes[1, col].set_ylabel("test accuracy (averaged model)")
        axes[1, col].set_ylim(0, 1)
        for row_ax in (0, 1):
            axes[row_ax, col].set_xlabel(xlabel)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def _ci(s: dict[str, float], digits: int = 3) -> str:
    half = (s["ci_hi"] - s["ci_lo"]) / 2.0
    if not math.isfinite(s["mean"]):
        return "diverged"
    d = digits
    return f"{s['mean']:.{d}f} ± {half:.{d}f} [{s['min']:.{d}f}, {s['max']:.{d}f}]"


def markdown(table: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One line per setting and algorithm: lr, R, final loss and accuracy, accuracy at
    D-PSGD's byte budget; each ``mean ± 95 % CI half-width [min, max]`` over seeds."""
    rows = []
    for t in table:
        setting = [t["nodes"], f"{t['topology']} ({t['gap']:.3f})", f"{t['homogeneity']:g}"]
        for name, c in t["cells"].items():
            if "refused" in c:
                rows.append(
                    [*setting, t["batch"], name, f"refused: {c['refused']}", "", "", "", ""]
                )
                continue
            cis = [_ci(c["loss"]), _ci(c["acc"]), _ci(c["acc_at_bytes"])]
            rows.append([*setting, t["batch"], name, f"{c['lr']:g}", c["R"], *cis])
    head = ["nodes", "topology (gap)", "X %", "batch", "algorithm", "lr", "R", "final loss"]
    text = (
        f"{len(args.seeds)} seeds, {args.rounds} gossip rounds; mean ± 95 % CI half-width "
        "[min, max] over seeds; equal bytes: at the bytes D-PSGD sends in all its rounds\n\n"
        + tables.markdown([*head, "final test acc", "test acc at equal bytes"], rows)
    )
    return text + (
        "\n\n" + checkpoint_markdown(table, args.checkpoints) if args.checkpoints else ""
    )


def checkpoint_markdown(table: list[dict[str, Any]], checkpoints: list[int]) -> str:
    """Training loss (averaged model) at each of ``checkpoints`` gossip rounds, one line
    per setting and algorithm, ``mean ± 95 % CI half-width`` over seeds; then the
    first-seed loss of every step size tried (the tuning)."""
    rows = []
    for t in table:
        setting = f"{t['nodes']} {t['topology']} X{t['homogeneity']:g} b{t['batch']}"
        for name, c in t["cells"].items():
            if "refused" in c:
                continue
            cps = []
            for cp in checkpoints:
                st = c["checkpoints"][str(cp)]
                half = (st["ci_hi"] - st["ci_lo"]) / 2.0
                cps.append(f"{st['mean']:.3f} ± {half:.3f}" if math.isfinite(st["mean"]) else "-")
            tune = ", ".join(f"{k}: {v:.3f}" for k, v in c["tuning"].items())
            rows.append([setting, name, f"{c['lr']:g}", *cps, tune])
    head = ["setting", "algorithm", "lr", *(f"loss @ {c}" for c in checkpoints)]
    return tables.markdown([*head, "tuning (seed 0 final loss by lr)"], rows)


FULL = {"rounds": 200, "nodes": [16, 32], "batch_sizes": [1, 4], "lrs": [0.1, 0.2, 0.4]}
QUICK = {"rounds": 60, "nodes": [16], "batch_sizes": [2], "lrs": [0.2]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (see the module docstring); grid flags not given come from
    :data:`FULL` or, with ``--quick``, :data:`QUICK`. Bad values exit with status 2."""
    p = cli.parser("decentralized --noise", None, quick="16 nodes, batch 2, 60 rounds")
    p.add_argument("--nodes", type=int, nargs="+", default=None)
    p.add_argument("--topologies", nargs="+", default=["ring", "torus"])
    p.add_argument("--homogeneity", type=float, nargs="+", default=[0.0, 25.0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="tuned on the first seed")
    p.add_argument("--phase-rounds", type=int, default=0, help="DeTAG's R (0: --phase-rule)")
    p.add_argument("--phase-rule", default="sqrt", choices=list(PHASE_RULES))
    p.add_argument("--variant", default="paper", choices=list(DeTAG.VARIANTS))
    p.add_argument("--eta", type=float, default=None, help="DeTAG's gossip momentum")
    p.add_argument("--hidden-width", type=int, default=32, help="MLP 64-w-10 (0: logistic)")
    p.add_argument("--checkpoints", type=int, nargs="*", default=[], help="print loss there")
    p.add_argument(
        "--no-lazy-d2",
        dest="lazy_d2",
        action="store_false",
        help="refuse D2 where lambda_min(W) <= -1/3 instead of running it on (I + W) / 2",
    )
    args = cli.parse(p, argv, FULL, QUICK)
    if args.rounds < 1 or min(args.batch_sizes) < 1 or min(args.nodes) < 2:
        p.error("--rounds and --batch-sizes must be >= 1, --nodes >= 2")
    if args.hidden_width < 0 or any(not 1 <= c <= args.rounds for c in args.checkpoints):
        p.error("--hidden-width must be >= 0 and --checkpoints in [1, --rounds]")
    if not all(lr > 0 and math.isfinite(lr) for lr in args.lrs) or args.phase_rounds < 0:
        p.error("--lrs must be > 0 and --phase-rounds >= 0")
    if args.eta is not None and not 0.0 <= args.eta < 1.0:
        p.error("--eta must be in [0, 1)")
    if min(args.seeds) < 0 or len(set(args.seeds)) != len(args.seeds):
        p.error("--seeds must be distinct and >= 0")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid; write ``results.json``, ``table.md`` and one PNG per setting into
    ``--out``; print the table; return its rows."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    args.out = cli.out_dir(args.out, "decentralized_noise")
    model, t0 = FlatModel(args.hidden_width), time.time()
    table, everything = [], []
    grid = itertools.product(args.nodes, args.topologies, args.homogeneity, args.batch_sizes)
    for nodes, topology, x, batch in grid:
        key = {"nodes": nodes, "topology": topology, "homogeneity": x, "batch": batch}
        row, raw = run_setting(nodes, topology, x, batch, args, model)
        table.append({**key, **row})
        everything.append({**key, "runs": raw})
        title = f"{nodes} nodes, {topology}, X={x:g}%, batch {batch}, {len(args.seeds)} seeds"
        plot_setting(title, raw, args.out / f"n{nodes}_{topology}_X{x:g}_b{batch}.png")
        print(markdown([table[-1]], args).splitlines()[-len(row["cells"]) :], flush=True)
    md = markdown(table, args)
    cli.write(args.out, md, {"args": cli.args_json(args), "table": table, "runs": everything})
    print("\n" + md + f"\n\n{time.time() - t0:.0f} s; outputs in {args.out}")
    return table


if __name__ == "__main__":
    main()
