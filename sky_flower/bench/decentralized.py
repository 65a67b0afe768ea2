"""Benchmark of D-PSGD, D2, DSGT and DeTAG (the fast path: one process, no Flower).

Runs the same gossip core (:mod:`sky_flower.gossip.algorithms`), model and mini-batch draws
(:mod:`sky_flower.gossip.training`) as the Flower strategies, but with all ``n`` nodes'
gradients computed at once (``torch.func.vmap``) in one process, so the whole grid of
settings fits in minutes on 2 cores. ``tests/test_decentralized_sim.py`` checks that this
path and the Flower path produce the same rows.

    python -m sky_flower.bench.decentralized            # the full grid (about 8 min on 2 cores)
    python -m sky_flower.bench.decentralized --quick    # a small grid (under a minute)
    python -m sky_flower.bench.decentralized --nodes 16 --homogeneity 0 100 --gaps 0.01
    python -m sky_flower.bench.decentralized --noise    # noise-dominated, seeds (issue 18)

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
import itertools
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.bench.decentralized_fast import simulate
from sky_flower.compare import write_csv
from sky_flower.gossip.algorithms import ALGORITHMS, make_algorithm
from sky_flower.gossip.matrices import TOPOLOGIES, gossip_matrix
from sky_flower.gossip.training import FlatModel, node_splits
from sky_flower.pipeline.data import load_split


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


FULL_DEFAULTS: dict[str, Any] = {
    "homogeneity": [0.0, 25.0, 50.0, 100.0],
    "gaps": [1.0, 0.1, 0.05, 0.01],
    "rounds": 300,
    "lrs": [0.1, 0.2, 0.4, 0.8, 1.6],
}
"""The grid without ``--quick`` (``--gaps`` on a sparse ``--topology``: its own gap)."""
QUICK_DEFAULTS: dict[str, Any] = {
    "homogeneity": [0.0, 100.0],
    "gaps": [1.0, 0.05],
    "rounds": 150,
    "lrs": [0.4],
}
"""The grid with ``--quick``; flags given explicitly win over it."""


def _g(values: list[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's argument parser; the grid flags default to None, filled in by
    :func:`parse_args` from :data:`FULL_DEFAULTS` or :data:`QUICK_DEFAULTS`."""
    full, quick = FULL_DEFAULTS, QUICK_DEFAULTS
    p = cli.parser(
        "decentralized",
        None,
        quick="the small grid for the flags not given: X 0, 100; gaps 1, 0.05; 150 rounds; lr 0.4",
    )
    p.add_argument("--nodes", type=int, nargs="+", default=[8], help=">= 2 each (default: 8)")
    p.add_argument(
        "--homogeneity",
        type=float,
        nargs="+",
        default=None,
        help=f"X in [0, 100], percent shuffled (default: {_g(full['homogeneity'])}; "
        f"--quick: {_g(quick['homogeneity'])})",
    )
    p.add_argument(
        "--gaps",
        type=float,
        nargs="+",
        default=None,
        help=f"spectral gaps in (0, 1] (default: {_g(full['gaps'])}, on a sparse --topology "
        f"its own gap; --quick: {_g(quick['gaps'])})",
    )
    p.add_argument(
        "--topology",
        default="complete",
        choices=list(TOPOLOGIES),
        help="graph the gap is set on (default: complete)",
    )
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"communication rounds per run, >= 1 (default: {full['rounds']}; "
        f"--quick: {quick['rounds']})",
    )
    p.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=None,
        help=f"step sizes > 0 (default: {_g(full['lrs'])}; --quick: {_g(quick['lrs'])})",
    )
    p.add_argument("--batch-size", type=int, default=16, help="per node, >= 1 (default: 16)")
    p.add_argument("--hidden-width", type=int, default=32, help="0: logistic (default: 32)")
    p.add_argument("--target-loss", type=float, default=0.5, help="> 0 (default: 0.5)")
    p.add_argument("--phase-rounds", type=int, default=0, help="DeTAG's R (0: 1/sqrt(gap))")
    p.add_argument("--seed", type=int, default=0, help=">= 0 (default: 0)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line (see the module docstring), every value checked before any run.

    A bad value exits with an argparse usage error (status 2), and so does a grid that the
    gossip core or the data split refuses (a gap out of the topology's reach, D2 on a
    matrix with ``lambda_min <= -1/3``, a batch larger than a node's data).
    """
    p = build_parser()
    args = cli.parse(p, argv)
    if args.gaps is None and args.topology != "complete":
        args.gaps = [None]  # the sparse topology's own gap
    cli.defaults(args, FULL_DEFAULTS, QUICK_DEFAULTS)
    _check_values(p, args)
    _check_grid(p, args)
    return args


def _check_values(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Ranges of the single flags (NaN fails every check)."""
    if min(args.nodes) < 2:
        p.error(f"--nodes: at least 2 nodes, got {min(args.nodes)}")
    for x in args.homogeneity:
        if not 0.0 <= x <= 100.0:
            p.error(f"--homogeneity: X must be in [0, 100] (percent shuffled), got {x:g}")
    for gap in args.gaps:
        if gap is not None and not 0.0 < gap <= 1.0:
            p.error(f"--gaps: spectral gap must be in (0, 1], got {gap:g}")
    for lr in args.lrs:
        if not (lr > 0.0 and math.isfinite(lr)):
            p.error(f"--lrs: step sizes must be > 0, got {lr:g}")
    if args.rounds < 1:
        p.error(f"--rounds: at least 1 communication round, got {args.rounds}")
    if args.batch_size < 1:
        p.error(f"--batch-size: at least 1 example per node, got {args.batch_size}")
    if args.hidden_width < 0:
        p.error(f"--hidden-width: must be >= 0 (0: logistic regression), got {args.hidden_width}")
    if not (args.target_loss > 0.0 and math.isfinite(args.target_loss)):
        p.error(f"--target-loss: must be > 0, got {args.target_loss:g}")
    if args.phase_rounds < 0:
        p.error(f"--phase-rounds: must be >= 0 (0: automatic), got {args.phase_rounds}")
    if args.seed < 0:
        p.error(f"--seed: must be >= 0, got {args.seed}")


def _check_grid(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Build every setting's data split, gossip matrix and algorithm once (cheap) and turn
    the library's ValueError into a usage error, in command-line terms."""
    train, _ = load_split("digits", 0.2, args.seed)
    try:
        for n, x in itertools.product(args.nodes, args.homogeneity):
            smallest = min(len(s) for s in node_splits(train, n, x, args.seed))
            if args.batch_size > smallest:
                p.error(
                    f"--batch-size: {args.batch_size} is more than the {smallest} training "
                    f"examples a node holds with --nodes {n}"
                )
        for n, gap in itertools.product(args.nodes, args.gaps):
            network = gossip_matrix(args.topology, n, gap, seed=args.seed)
            for name, lr in itertools.product(args.algorithms, args.lrs):
                make_algorithm(name, network, lr, args.phase_rounds)
    except ValueError as err:
        p.error(_cli_terms(str(err)))


def _cli_terms(message: str) -> str:
    """A library message with its Hydra-style ``key=value`` advice as flags."""
    return (
        message.replace("use topology=complete", "use --topology complete")
        .replace(
            "set strategy.lazy_mixing=true (lazy gossip",
            "set --gaps below the topology's own gap (lazy mixing to that gap; the lazy",
        )
        .replace("set spectral_gap", "set --gaps")
        .replace("spectral_gap=", "--gaps ")
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid; write results, table and plots; print the table; return its rows.
    ``--noise`` first: the noise-dominated grid of :mod:`sky_flower.bench.decentralized_noise`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--noise"]:
        from sky_flower.bench.decentralized_noise import main as noise_main

        return noise_main(argv[1:])
    args = parse_args(argv)
    torch.set_num_threads(1)
    out = args.out = cli.out_dir(args.out, "decentralized")  # the plots go there as it runs
    model = FlatModel(args.hidden_width)
    train, test = load_split("digits", 0.2, args.seed)
    settings = [
        Setting(n, x, g, args.topology)
        for n, x, g in itertools.product(args.nodes, args.homogeneity, args.gaps)
    ]
    networks = {  # parse_args built each of these once already: no ValueError here
        s: gossip_matrix(s.topology, s.nodes, s.spectral_gap, seed=args.seed) for s in settings
    }
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
    md = markdown_table(table, args.algorithms, args.rounds, args.target_loss)
    # strictly valid JSON: a diverged run's NaN losses as null, listed under "nonfinite"
    cli.write(out, md, {"args": cli.args_json(args), "runs": everything})
    write_csv(table, out / "table.csv", list(table[0]))
    print("\n" + md)
    print(f"\n{len(everything)} runs in {time.time() - t0:.0f} s; outputs in {out}")
    return table


def _cell(rounds: int | None, limit: int) -> str:
    return f">{limit}" if rounds is None else str(rounds)


def _loss(loss: float) -> str:
    """A final loss for the table; inf/nan (the run stopped on divergence): "diverged"."""
    return f"{loss:.3f}" if math.isfinite(loss) else "diverged"


def format_row(row: dict[str, Any], algorithms: list[str], limit: int) -> str:
    """One progress line."""
    cells = "  ".join(
        f"{a} {_cell(row[f'{a}_rounds'], limit):>5}"
        + ("" if math.isfinite(row[f"{a}_final_loss"]) else " (diverged)")
        for a in algorithms
    )
    gap = row["spectral_gap"]
    return f"n={row['nodes']:<3} X={row['homogeneity']:<5g} gap={gap if gap else '-':<5}  {cells}"


def markdown_table(
    table: list[dict[str, Any]], algorithms: list[str], limit: int, target: float
) -> str:
    """Rounds to the target loss (and final loss) per setting and algorithm."""
    rows = []
    for row in table:
        hits = {a: row[f"{a}_rounds"] for a in algorithms if row[f"{a}_rounds"] is not None}
        gap = row["spectral_gap"]
        rows.append(
            [row["nodes"], f"{row['homogeneity']:g}", gap if gap else "topology"]
            + [
                f"{_cell(row[f'{a}_rounds'], limit)} ({_loss(row[f'{a}_final_loss'])})"
                for a in algorithms
            ]
            + [", ".join(a for a in hits if hits[a] == min(hits.values())) if hits else "-"]
        )
    return (
        f"Communication rounds to reach training loss {target:g} (final loss after {limit} "
        "rounds in brackets; the best of the step sizes tried; diverged: the loss blew up "
        "(inf/nan) and the run stopped)\n\n"
        + tables.markdown(["nodes", "X (%)", "gap", *algorithms, "fastest"], rows)
    )


if __name__ == "__main__":
    main()
