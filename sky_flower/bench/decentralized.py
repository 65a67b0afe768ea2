"""Benchmark of D-PSGD, D2, DSGT and DeTAG (the fast path: one process, no Flower).

Runs the same gossip core (:mod:`strategies.gossip`), model and mini-batch draws
(:mod:`sky_flower.decentral`) as the Flower strategies, but with all ``n`` nodes'
gradients computed at once (``torch.func.vmap``) in one process, so the whole grid of
settings fits in minutes on 2 cores. ``tests/test_decentralized_sim.py`` checks that this
path and the Flower path produce the same rows.

    python -m sky_flower.bench.decentralized            # the full grid (about 8 min on 2 cores)
    python -m sky_flower.bench.decentralized --quick    # a small grid (under a minute)
    python -m sky_flower.bench.decentralized --nodes 16 --homogeneity 0 100 --gaps 0.01

Grid: nodes x homogeneity X x spectral gap x algorithm, the gap set exactly on a
complete graph (``W = gap 11^T / n + (1 - gap) I``, the DeTAG paper's knob) unless
``--topology`` names a sparse one. Every algorithm runs each of the ``--lrs`` step sizes
and keeps the one that reaches the target loss first (else the lowest final loss), so
each is compared at its own tuned step. Writes into ``--out``: ``results.json`` (every
run's rows), ``table.md`` / ``table.csv`` (gossip rounds to reach ``--target-loss``,
training loss of the averaged model over all nodes' data), one PNG per setting (loss
and test accuracy against communication rounds).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sky_flower.data import Split, load_split
from sky_flower.decentral import FlatModel, minibatch_indices, node_splits
from strategies.gossip import ALGORITHMS, GossipMatrix, gossip_matrix, make_algorithm


@dataclass(frozen=True)
class Setting:
    """One cell of the grid."""

    nodes: int
    homogeneity: float
    spectral_gap: float | None
    topology: str = "complete"

    def label(self) -> str:
        """File-name-safe label, e.g. ``n8_X0_gap0.01``."""
        gap = "topo" if self.spectral_gap is None else f"{self.spectral_gap:g}"
        top = "" if self.topology == "complete" else f"_{self.topology}"
        return f"n{self.nodes}_X{self.homogeneity:g}_gap{gap}{top}"


def simulate(  # noqa: PLR0913
    algorithm: str,
    gossip: GossipMatrix,
    model: FlatModel,
    splits: list[Split],
    test: Split,
    rounds: int,
    lr: float,
    batch_size: int = 16,
    seed: int = 0,
    phase_rounds: int = 0,
) -> list[dict[str, Any]]:
    """Run ``algorithm`` for ``rounds`` gossip rounds; return the rows the Flower strategy
    would record (:meth:`strategies.decentralized.DecentralizedStrategy.start`): ``round``,
    ``loss`` (training loss of the averaged model over all nodes' data), ``node_loss``,
    ``test_accuracy``, ``test_loss``, ``consensus_distance``. Stops early (last row
    ``loss`` = inf) if the loss diverges.

    Raises
    ------
    ValueError
        As :func:`strategies.gossip.make_algorithm`; ``len(splits) != gossip.n``.
    """
    if len(splits) != gossip.n:
        raise ValueError(f"{len(splits)} data splits for {gossip.n} nodes")
    alg = make_algorithm(algorithm, gossip, lr, phase_rounds)
    alg.reset(model.initial(seed))
    all_train = Split(np.concatenate([s.x for s in splits]), np.concatenate([s.y for s in splits]))
    rows: list[dict[str, Any]] = []

    def record(step: int, node_loss: float | None) -> None:
        test_res = model.evaluate(alg.average, test)
        rows.append(
            {
                "round": step * alg.rounds_per_step,
                "loss": model.evaluate(alg.average, all_train)["loss"],
                "node_loss": node_loss,
                "consensus_distance": alg.consensus_distance(),
                "test_accuracy": test_res["accuracy"],
                "test_loss": test_res["loss"],
            }
        )

    record(0, None)
    for step in range(rounds // alg.rounds_per_step):
        grads, losses = np.zeros(alg.x.shape), np.zeros(gossip.n)
        for k in range(alg.batches_per_step):
            idx = [
                minibatch_indices(len(s), batch_size, seed, i, step, k)
                for i, s in enumerate(splits)
            ]
            xb = np.stack([s.x[j] for s, j in zip(splits, idx, strict=True)])
            yb = np.stack([s.y[j] for s, j in zip(splits, idx, strict=True)])
            loss, g = model.batched_loss_and_grad(alg.x, xb, yb)
            grads += g
            losses += loss
        alg.step(grads / alg.batches_per_step)
        record(step + 1, float(np.mean(losses) / alg.batches_per_step))
        if not math.isfinite(rows[-1]["loss"]) or rows[-1]["loss"] > 1e3:
            rows[-1]["loss"] = math.inf
            break
    return rows


def rounds_to(rows: list[dict[str, Any]], target: float) -> int | None:
    """First gossip round at which the loss is <= ``target`` (None: never)."""
    return next((r["round"] for r in rows if r["loss"] <= target), None)


def best_run(runs: dict[float, list[dict[str, Any]]], target: float) -> tuple[float, list]:
    """The step size whose run reaches ``target`` first, else the lowest final loss."""

    def key(lr: float) -> tuple[float, float]:
        hit = rounds_to(runs[lr], target)
        return (math.inf if hit is None else hit, runs[lr][-1]["loss"])

    lr = min(runs, key=key)
    return lr, runs[lr]


def plot(
    setting: Setting, curves: dict[str, tuple[float, list]], target: float, path: Path
) -> None:
    """Loss (log scale) and test accuracy against gossip rounds, one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, (lr, rows) in curves.items():
        r = [row["round"] for row in rows]
        ax_l.plot(r, [row["loss"] for row in rows], label=f"{name} (lr {lr:g})")
        ax_a.plot(r, [row["test_accuracy"] for row in rows], label=name)
    ax_l.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:g}")
    ax_l.set_yscale("log")
    ax_l.set_xlabel("communication rounds")
    ax_l.set_ylabel("training loss of the averaged model")
    ax_a.set_xlabel("communication rounds")
    ax_a.set_ylabel("test accuracy of the averaged model")
    ax_a.set_ylim(0, 1)
    ax_l.legend(fontsize=8)
    gap = "topology's" if setting.spectral_gap is None else f"{setting.spectral_gap:g}"
    fig.suptitle(
        f"{setting.nodes} nodes, {setting.topology}, spectral gap {gap}, "
        f"homogeneity X={setting.homogeneity:g}%"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m sky_flower.bench.decentralized")
    p.add_argument("--nodes", type=int, nargs="+", default=[8])
    p.add_argument("--homogeneity", type=float, nargs="+", default=[0, 25, 50, 100])
    p.add_argument("--gaps", type=float, nargs="+", default=[1.0, 0.1, 0.05, 0.01])
    p.add_argument("--topology", default="complete", help="graph the gap is set on")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--rounds", type=int, default=300, help="communication rounds per run")
    p.add_argument("--lrs", type=float, nargs="+", default=[0.1, 0.2, 0.4, 0.8, 1.6])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--hidden-width", type=int, default=32)
    p.add_argument("--target-loss", type=float, default=0.5)
    p.add_argument("--phase-rounds", type=int, default=0, help="DeTAG's R (0: 1/sqrt(gap))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="default: outputs/bench_<time>")
    p.add_argument("--quick", action="store_true", help="X 0, 100; gaps 1, 0.05; 150 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.homogeneity, args.gaps, args.rounds, args.lrs = [0, 100], [1.0, 0.05], 150, [0.4]
    for gap in args.gaps:
        if not 0 < gap <= 1:
            p.error(f"--gaps: spectral gap must be in (0, 1], got {gap}")
    if min(args.nodes) < 2:
        p.error("--nodes: at least 2 nodes")
    if args.out is None:
        args.out = Path("outputs") / time.strftime("bench_%Y-%m-%d_%H-%M-%S")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid; write results, table and plots; print the table; return its rows."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = FlatModel(args.hidden_width)
    train, test = load_split("digits", 0.2, args.seed)
    settings = [
        Setting(n, x, g, args.topology)
        for n, x, g in itertools.product(args.nodes, args.homogeneity, args.gaps)
    ]
    # validate every setting before any run
    networks = {
        s: gossip_matrix(s.topology, s.nodes, s.spectral_gap, seed=args.seed) for s in settings
    }
    for s in settings:
        node_splits(train, s.nodes, s.homogeneity, args.seed)
    t0, table, everything = time.time(), [], []
    for s in settings:
        splits = node_splits(train, s.nodes, s.homogeneity, args.seed)
        curves: dict[str, tuple[float, list]] = {}
        row: dict[str, Any] = {**asdict(s), "target_loss": args.target_loss}
        for name in args.algorithms:
            runs = {
                lr: simulate(
                    name,
                    networks[s],
                    model,
                    splits,
                    test,
                    args.rounds,
                    lr,
                    args.batch_size,
                    args.seed,
                    args.phase_rounds,
                )
                for lr in args.lrs
            }
            lr, rows = curves[name] = best_run(runs, args.target_loss)
            row[f"{name}_rounds"] = rounds_to(rows, args.target_loss)
            row[f"{name}_lr"] = lr
            row[f"{name}_final_loss"] = rows[-1]["loss"]
            row[f"{name}_final_acc"] = rows[-1]["test_accuracy"]
            everything.append({**asdict(s), "algorithm": name, "lr": lr, "rows": rows})
        plot(s, curves, args.target_loss, out / f"{s.label()}.png")
        table.append(row)
        print(format_row(row, args.algorithms, args.rounds), flush=True)
    (out / "results.json").write_text(
        json.dumps({"args": _jsonable(vars(args)), "runs": everything})
    )
    with open(out / "table.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    md = markdown_table(table, args.algorithms, args.rounds, args.target_loss)
    (out / "table.md").write_text(md + "\n")
    print("\n" + md)
    print(f"\n{len(everything)} runs in {time.time() - t0:.0f} s; outputs in {out}")
    return table


def _cell(rounds: int | None, limit: int) -> str:
    return f">{limit}" if rounds is None else str(rounds)


def format_row(row: dict[str, Any], algorithms: list[str], limit: int) -> str:
    """One progress line."""
    cells = "  ".join(f"{a} {_cell(row[f'{a}_rounds'], limit):>5}" for a in algorithms)
    gap = row["spectral_gap"]
    return f"n={row['nodes']:<3} X={row['homogeneity']:<5g} gap={gap if gap else '-':<5}  {cells}"


def markdown_table(
    table: list[dict[str, Any]], algorithms: list[str], limit: int, target: float
) -> str:
    """Rounds to the target loss (and final loss) per setting and algorithm."""
    head = "| nodes | X (%) | gap | " + " | ".join(algorithms) + " | fastest |"
    lines = [
        f"Communication rounds to reach training loss {target:g} (final loss after {limit} "
        "rounds in brackets; the best of the step sizes tried)",
        "",
        head,
        "|" + "---|" * (len(algorithms) + 4),
    ]
    for row in table:
        cells = [
            f"{_cell(row[f'{a}_rounds'], limit)} ({row[f'{a}_final_loss']:.3f})" for a in algorithms
        ]
        hits = {a: row[f"{a}_rounds"] for a in algorithms if row[f"{a}_rounds"] is not None}
        fastest = ", ".join(a for a in hits if hits[a] == min(hits.values())) if hits else "-"
        gap = row["spectral_gap"]
        lines.append(
            f"| {row['nodes']} | {row['homogeneity']:g} | {gap if gap else 'topology'} | "
            + " | ".join(cells)
            + f" | {fastest} |"
        )
    return "\n".join(lines)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


if __name__ == "__main__":
    main()
