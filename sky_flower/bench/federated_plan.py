"""Joint-planner benchmark (issue 13, benchmark 3): ``python -m sky_flower.bench.federated_plan``.

Prints, measured side by side in one run (a table, not a timed test):

1. Owners 2, 4, 8, 16 with a fixed set of helpers: the predicted round time of ``even``,
   ``heuristic`` and ``optimal`` (where it finishes within ``--optimal-limit``) against
   the lower bound and FedAvg's round, and the planner's time. The model is BERT-large
   cut to ``--layers`` encoder layers (:func:`sky_flower.core.bert.bert_layer_profiles`);
   owners alternate phones (``--phone-gib``, too small for the model) and laptops
   (``--laptop-gib``), with SkyComputing's emulated slowdowns
   (:func:`sky_flower.core.fleets.skycomputing_slowdowns`); the helpers are
   ``--edge`` edge boxes and ``--cloud`` cloud nodes (4x the rate). Owner ``i`` holds
   ``256 (1 + i mod 4)`` samples.
2. The scale target: 64 nodes, 16 of them owners, BERT-large (24 layers): the
   heuristic's planner time and round against the bound.

Options: ``--quick`` (owners 2 and 4 only, no scale run).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.core.bert import bert_layer_profiles
from sky_flower.core.cost import Schedule
from sky_flower.core.federated import FederatedPlan, plan_federation
from sky_flower.core.fleets import skycomputing_slowdowns, synthetic_node_profiles
from sky_flower.core.partition import InfeasibleMemoryError
from sky_flower.core.profile import LayerProfile, NodeProfile

FLOPS_PER_S = 1.0e12
GIB = 2**30
LATENCY_S = 1e-3
BANDWIDTH_BPS = 1.25e8


def fleet(
    layers: list[LayerProfile],
    owners: int,
    args: argparse.Namespace,
    schedule: Schedule,
) -> tuple[list[NodeProfile], dict[str, int]]:
    """Owners (phones and laptops, alternating), then the edge and cloud helpers."""
    slow = skycomputing_slowdowns(owners)
    helpers = args.edge + args.cloud
    slow += [0.0] * (args.edge + args.cloud)  # the nominal rate (cloud: 4x below)
    mem = [(args.phone_gib if i % 2 == 0 else args.laptop_gib) * GIB for i in range(owners)]
    mem += [16 * GIB] * args.edge + [80 * GIB] * args.cloud
    names = [f"{'phone' if i % 2 == 0 else 'laptop'}{i}" for i in range(owners)]
    names += [f"edge{i}" for i in range(args.edge)] + [f"cloud{i}" for i in range(args.cloud)]
    nodes = synthetic_node_profiles(
        layers,
        slow,
        microbatch_size=schedule.microbatch_size,
        flops_per_s=FLOPS_PER_S,
        memory_bytes=[int(m) for m in mem],
        latency_s=LATENCY_S,
        bandwidth_bps=BANDWIDTH_BPS,
        names=names,
    )
    cloud_rate = [dataclasses.replace(n) for n in nodes]
    for i in range(owners + args.edge, owners + helpers):  # cloud: 4x the nominal rate
        n = cloud_rate[i]
        cloud_rate[i] = dataclasses.replace(
            n,
            layer_fwd_s=tuple(t / 4 for t in n.layer_fwd_s),
            layer_bwd_s=tuple(t / 4 for t in n.layer_bwd_s),
        )
    nodes = [dataclasses.replace(n, holds_data=i < owners) for i, n in enumerate(cloud_rate)]
    samples = {nodes[i].name: 256 * (1 + i % 4) for i in range(owners)}
    return nodes, samples


def _cells(fp: FederatedPlan | str) -> list[str]:
    if isinstance(fp, str):
        return [fp, "", "", "", "", ""]
    shared = sum(1 for p in fp.pipelines if p.after)
    return [
        f"{fp.round_time_s:.1f}",
        f"{fp.round_time_s / fp.lower_bound_s:.2f}",
        f"{fp.solve_time_s:.2f}",
        "yes" if fp.proven_optimal else "no",
        f"{shared}",
        f"{len(fp.idle_helpers)}",
    ]


def owners_sweep(args: argparse.Namespace) -> None:
    """Section 1."""
    schedule = Schedule(args.batch, args.microbatches, "gpipe", "direct")
    layers = bert_layer_profiles(num_layers=args.layers)
    print(
        f"\n1. Round time vs owners: BERT-large {args.layers} layers ({len(layers)} entries), "
        f"gpipe M={args.microbatches} batch {args.batch}, direct; helpers: {args.edge} edge "
        f"(16 GiB), {args.cloud} cloud (80 GiB, 4x); owners: phones {args.phone_gib} GiB / "
        f"laptops {args.laptop_gib} GiB"
    )
    rows, notes = [], []
    for owners in args.owners:
        nodes, samples = fleet(layers, owners, args, schedule)
        fps: dict[str, FederatedPlan | str] = {}
        for method in ("even", "heuristic", "optimal"):
            try:
                fps[method] = plan_federation(
                    layers, nodes, samples, schedule, method, time_limit_s=args.optimal_limit
                )
            except (InfeasibleMemoryError, ValueError) as e:
                fps[method] = type(e).__name__
        rows += [[owners, method, *_cells(fp)] for method, fp in fps.items()]
        ref = next(fp for fp in fps.values() if not isinstance(fp, str))
        fedavg = tables.num(ref.fedavg_round_time_s, ".1f", " s", missing="infeasible")
        notes.append(f"   {owners} owners: bound {ref.lower_bound_s:.1f} s, FedAvg {fedavg}")
    head = ["owners", "method", "round s", "/bound", "plan s", "proven", "waits", "idle"]
    print(tables.text(head, rows, align="rl", sep="  ", indent="   "))
    print("\n".join(notes))


def scale(args: argparse.Namespace) -> None:
    """Section 2."""
    schedule = Schedule(32, 4, "gpipe", "direct")
    layers = bert_layer_profiles()
    nodes = synthetic_node_profiles(
        layers, skycomputing_slowdowns(64), 8, FLOPS_PER_S, [4 * GIB] * 16 + [16 * GIB] * 48
    )
    nodes = [dataclasses.replace(n, holds_data=i < 16) for i, n in enumerate(nodes)]
    samples = {n.name: 320 * (1 + i % 4) for i, n in enumerate(nodes[:16])}
    print("\n2. Scale: 64 nodes (16 owners of 4 GiB, 48 helpers of 16 GiB), BERT-large")
    for method in ("even", "heuristic"):
        t0, c0 = time.perf_counter(), time.process_time()
        fp = plan_federation(layers, nodes, samples, schedule, method)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(
            f"   {method:<9} planner {took:.3f} s ({cpu:.3f} s CPU), "
            f"round {fp.round_time_s:.1f} s, "
            f"bound {fp.lower_bound_s:.1f} s (x{fp.round_time_s / fp.lower_bound_s:.2f}), "
            f"idle helpers {len(fp.idle_helpers)}"
        )


def main(argv: list[str] | None = None) -> None:
    """Parse the options and print both sections."""
    ap = cli.parser("federated_plan", __doc__, quick="owners 2 and 4 only, no scale run", out=False)
    ap.add_argument("--owners", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--edge", type=int, default=3)
    ap.add_argument("--cloud", type=int, default=1)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--phone-gib", type=float, default=1.5)
    ap.add_argument("--laptop-gib", type=float, default=8.0)
    ap.add_argument("--optimal-limit", type=float, default=60.0)
    args = cli.parse(ap, argv)
    if args.quick:
        args.owners = [o for o in args.owners if o <= 4]
    owners_sweep(args)
    if not args.quick:
        scale(args)


if __name__ == "__main__":
    main()
