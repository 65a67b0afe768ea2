"""Federated split training against FedAvg: ``python -m sky_flower.bench.federated``.

Benchmarks 1 and 2 of issue 13, printed side by side:

1. **Owners too small for the model.** Six phones hold the data (two of them large
   enough to train the whole model), two edge boxes and a cloud node help. FedAvg can
   train only on the owners that fit; Sky (``even`` / ``heuristic`` / ``optimal``)
   trains every owner's data in its own pipeline. Per method: predicted time per
   round, share of the federation's data used, rounds and time to a target test
   accuracy.
2. **Every owner fits.** Four laptops hold the data, two helpers: Sky's predicted
   round time against FedAvg's (the planner picks all-alone when FedAvg is faster, so
   the ratio is at most 1.05).

How the figures are made (stated in the output): the model's per-layer FLOPs and
memory come from :func:`sky_flower.sky.planning.planning.profile_model`; a device takes
``FLOPs / rate x (1 + slowdown)`` per layer
(:func:`sky_flower.core.fleets.synthetic_node_profiles`), with its memory cap and a
10 ms / 100 MB/s link; round times are the
joint planner's predictions (:func:`sky_flower.core.federated.plan_federation`; the
cost model's measured-vs-predicted agreement is in docs/benchmarks/). Accuracy per round is
computed by the reference loop (each owner trains the whole model alone on its stage
0's batches, FedAvg weighted by samples trained): Sky's split execution equals it to
1e-5 (``tests/test_federation.py``), so no pipeline needs to run here. Rounds to
target: the first round from which the accuracy stays at or above it; time to target
= rounds to target x predicted round time.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.federated import plan_federation
from sky_flower.core.fleets import synthetic_node_profiles
from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.pipeline.data import Split, load_split, owner_partition
from sky_flower.pipeline.models import build_mlp
from sky_flower.pipeline.stage import step_batch
from sky_flower.sky.planning.planning import profile_model
from sky_flower.tables import num

METHODS = ("even", "heuristic", "optimal")
# (name, holds data, slowdown, memory as a multiple of the whole model's training memory)
SMALL_OWNERS = (
    *[(f"phone{i}", True, 4.0, 0.45) for i in range(4)],
    ("bigphone0", True, 3.0, 1.3),
    ("bigphone1", True, 3.0, 1.3),
    ("edge0", False, 1.0, 0.8),
    ("edge1", False, 1.0, 0.8),
    ("cloud", False, 0.0, 4.0),
)
ALL_FIT = (
    *[(f"laptop{i}", True, 1.0, 1.5) for i in range(4)],
    ("edge0", False, 1.0, 1.5),
    ("cloud", False, 0.0, 4.0),
)


def fleet_profiles(
    layers: Sequence[LayerProfile], schedule: Schedule, spec: Sequence[tuple], flops_per_s: float
) -> list[NodeProfile]:
    """Node profiles of fleet ``spec`` (name, holds data, slowdown, memory as a multiple
    of the whole model's training memory), 10 ms / 100 MB/s links."""
    one = synthetic_node_profiles(layers, [0.0], schedule.microbatch_size, flops_per_s, 2**50)
    whole = CostModel(list(layers), one, schedule).stage_memory(0, len(layers) - 1)
    nodes = synthetic_node_profiles(
        layers,
        [s for _, _, s, _ in spec],
        schedule.microbatch_size,
        flops_per_s,
        [int(m * whole) for _, _, _, m in spec],
        latency_s=0.01,
        bandwidth_bps=100e6,
        names=[n for n, *_ in spec],
    )
    return [dataclasses.replace(n, holds_data=s[1]) for n, s in zip(nodes, spec, strict=True)]


def fedavg_accuracy(
    model_fn: Any,  # noqa: ANN401 - () -> nn.Module
    parts: Sequence[Split],
    steps: Sequence[int],
    test: Split,
    rounds: int,
    lr: float,
    batch_size: int,
) -> list[float]:
    """Test accuracy after each of ``rounds`` FedAvg rounds over the owners ``parts``
    (owner ``k`` trains ``steps[k]`` Adam steps alone from the global model on its
    stage 0's batches, a fresh optimizer per round; the average is weighted by samples
    trained: McMahan et al. 2017, Alg. 1) - what Sky's pipelines compute."""
    torch.manual_seed(0)
    model = model_fn()
    x_test, y_test = torch.from_numpy(test.x), torch.from_numpy(test.y)
    accs = []
    for rnd in range(1, rounds + 1):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        total = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in start.items()}
        for data, k_steps in zip(parts, steps, strict=True):
            model.load_state_dict(start)
            opt = torch.optim.Adam(model.parameters(), lr=lr)
            for step in range(k_steps):
                x, y = step_batch(data, batch_size, rnd, 0, step)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            for key, value in model.state_dict().items():
                total[key] += value * (k_steps / sum(steps))
        model.load_state_dict(total)
        with torch.no_grad():
            accs.append(float((model(x_test).argmax(1) == y_test).float().mean()))
    return accs


def compare(
    spec: Sequence[tuple], args: argparse.Namespace, time_limit_s: float
) -> list[dict[str, Any]]:
    """FedAvg (owners that fit) and Sky's three methods on fleet ``spec``: one row each."""
    torch.set_num_threads(1)
    schedule = Schedule(batch_size=args.batch_size, microbatches=1)

    def model_fn() -> torch.nn.Module:
        return build_mlp(64, args.width, args.layers, 10)

    layers = profile_model(model_fn, [64], schedule, "adam", args.lr)
    nodes = fleet_profiles(layers, schedule, spec, args.flops)
    owners = [n for n in nodes if n.holds_data]
    train, test = load_split("digits", 0.2, 0)
    parts = {n.name: owner_partition(train, i, len(owners), 0) for i, n in enumerate(owners)}
    samples = {name: len(p) for name, p in parts.items()}
    rows = []
    for method in METHODS:
        try:
            fp = plan_federation(
                layers, nodes, samples, schedule, method, time_limit_s=time_limit_s
            )
        except ValueError as err:
            rows.append({"method": f"sky {method}", "note": f"infeasible: {err}"[:60]})
            continue
        rows.append(
            {
                "method": f"sky {method}",
                "round_s": fp.round_time_s,
                "owners": [p.owner for p in fp.pipelines],
                "steps": [p.steps for p in fp.pipelines],
                "bound_s": fp.lower_bound_s,
                "solve_s": fp.solve_time_s,
                "fedavg_s": fp.fedavg_round_time_s,
            }
        )
    fits = [n.name for n in owners if _fits_alone(layers, n, schedule)]
    sky = next((r for r in rows if "round_s" in r), None)
    if fits and sky is not None:  # FedAvg: every owner that fits trains alone
        alone = [n for n in nodes if n.name in fits]
        fp = plan_federation(layers, alone, {n: samples[n] for n in fits}, schedule, "even")
        rows.insert(
            0,
            {
                "method": "fedavg (owners that fit)",
                "round_s": fp.round_time_s,
                "owners": fits,
                "steps": [p.steps for p in fp.pipelines],
            },
        )
    total = sum(samples.values())
    for row in rows:
        if "owners" not in row:
            continue
        row["data_share"] = sum(samples[o] for o in row["owners"]) / total
        acc = fedavg_accuracy(
            model_fn,
            [parts[o] for o in row["owners"]],
            row["steps"],
            test,
            args.rounds,
            args.lr,
            args.batch_size,
        )
        row["final_acc"] = acc[-1]
        hit = rounds_to(acc, args.target)
        row["rounds_to_target"] = hit
        row["time_to_target_s"] = None if hit is None else hit * row["round_s"]
    return rows


def rounds_to(accuracies: Sequence[float], target: float) -> int | None:
    """The first round from which the test accuracy stays at or above ``target``
    through the last round (a round that touches it and falls back does not count);
    None if it never does."""
    last_below = max((i for i, a in enumerate(accuracies) if a < target), default=-1)
    return last_below + 2 if last_below + 1 < len(accuracies) else None


def _fits_alone(layers: Sequence[LayerProfile], node: NodeProfile, schedule: Schedule) -> bool:
    cost = CostModel(list(layers), [node], schedule)
    return cost.stage_memory(0, len(layers) - 1) <= node.memory_bytes


def table(rows: Sequence[dict[str, Any]], target: float) -> str:
    """The rows as a markdown table."""
    cells = [
        [r["method"], num(r.get("round_s"), ".2f"), num(r.get("data_share"), ".0%")]
        + [num(r.get("final_acc")), num(r.get("rounds_to_target"), "d")]
        + [num(r.get("time_to_target_s"), ".1f"), r.get("note", "")]
        for r in rows
    ]
    head = ["method", "round s (pred.)", "data used", "final acc", f"rounds to {target:.2f}"]
    return tables.markdown([*head, "time to target s", "note"], cells)


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Run benchmarks 1 and 2 and print their tables; return their rows."""
    p = cli.parser("federated", __doc__, out=False)
    p.add_argument("--width", type=int, default=512, help="MLP hidden width")
    p.add_argument("--layers", type=int, default=6, help="MLP hidden layers")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rounds", type=int, default=15, help="rounds of the accuracy loop")
    p.add_argument("--target", type=float, default=0.95, help="target test accuracy")
    p.add_argument("--flops", type=float, default=5e9, help="FLOP/s of a native node")
    p.add_argument("--time-limit", type=float, default=10.0, help="optimal's limit (s)")
    args = cli.parse(p, argv)
    out = {}
    for title, spec in (
        ("1. owners too small for the model", SMALL_OWNERS),
        ("2. every owner fits", ALL_FIT),
    ):
        rows = compare(spec, args, args.time_limit)
        out[title] = rows
        print(f"\n## {title}\n\n{table(rows, args.target)}")
        fed = next((r for r in rows if r["method"].startswith("fedavg")), None)
        heur = next((r for r in rows if r["method"] == "sky heuristic" and "round_s" in r), None)
        if fed and heur:
            print(f"\nsky heuristic / fedavg round time: {heur['round_s'] / fed['round_s']:.3f}x")
    print(
        "\nRound times: the joint planner's predictions from the model's layer FLOPs, "
        f"devices at {args.flops:g} FLOP/s / (1 + slowdown); accuracy: the "
        "reference FedAvg loop over the owners each method trains (Sky's split execution "
        "equals it to 1e-5, tests/test_federation.py)."
    )
    return out


if __name__ == "__main__":
    main()
