"""Planner benchmark: ``python -m sky_flower.bench.planner [--quick] [--optimal-limit S]``.

Prints the figures issue 3 asks for, measured side by side in one run (a table, not a
timed test; this machine is shared and noisy). The instance is SkyComputing's own
experiment: BERT-large (hidden 1024, sequence 128, batch 32) split into ``1 + 3L + 2``
entries (:func:`sky_flower.core.bert.bert_layer_profiles`) on its emulated fleet (slowdowns
1-6 from ``default_rng(35)``, :func:`sky_flower.core.fleets.skycomputing_slowdowns`), with the
``conf/fleet/skycomputing.yaml`` rate, memory and link, on the ``direct`` transport.

1. Steady state (``objective=throughput``: the slowest stage's seconds per micro-batch)
   at 64 nodes x 160 layers: even, heuristic, the lower bound (total work / total
   speed), and the ratios.
2. The same instance as a step: M = 4 x nodes micro-batches of one sample (GPipe and
   1F1B) and M = 1 (the sequential batch SkyComputing runs), against even and the bound.
3. Heuristic solve time at 64 x 483 entries and 1,024 nodes x 2,000 entries.
4. ``optimal`` at 16 nodes x 40 layers and 32 x 160 (throughput: the exact programme
   over node kinds) and 16 x 40 as a GPipe step (the MILP), proof status and gap.
5. even / heuristic / optimal over the sweep grid (nodes x layers), throughput.
6. Random small fleets with a link per pair of nodes and binding memory (fixed seeds):
   per method the share of instances where it is optimal, the worst and mean ratio to
   the exact optimum (brute force up to 4 nodes, ``optimal``'s proof at 8 nodes),
   feasibility disagreements with the exact memory check (must be 0), solve times.
"""

from __future__ import annotations

import argparse
import time

from sky_flower import tables
from sky_flower.bench.random_fleets import random_fleets
from sky_flower.core.bert import bert_layer_profiles
from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.fleets import skycomputing_slowdowns, synthetic_node_profiles
from sky_flower.core.partition import InfeasibleMemoryError, Plan, partition

FLOPS_PER_S = 1.0e12
MEMORY_BYTES = 8192 * 2**20
LATENCY_S = 1e-4
BANDWIDTH_BPS = 1.25e9


def instance(nodes: int, num_layers: int, schedule: Schedule) -> CostModel:
    """SkyComputing's BERT-large on its emulated fleet (``nodes`` nodes)."""
    layers = bert_layer_profiles(num_layers=num_layers)
    fleet = synthetic_node_profiles(
        layers,
        skycomputing_slowdowns(nodes),
        microbatch_size=schedule.microbatch_size,
        flops_per_s=FLOPS_PER_S,
        memory_bytes=MEMORY_BYTES,
        latency_s=LATENCY_S,
        bandwidth_bps=BANDWIDTH_BPS,
    )
    return CostModel(layers, fleet, schedule)


def _plan(cost: CostModel, method: str, objective: str, limit: float) -> Plan | str:
    try:
        return partition(cost, method, objective=objective, time_limit_s=limit)
    except (InfeasibleMemoryError, ValueError) as e:
        return type(e).__name__


def show(head: list[str], rows: list[list[object]], align: str = "l") -> None:
    """Print a section's table, indented under its title (``align``: :func:`tables.text`'s)."""
    print(tables.text(head, rows, align=align, sep="  ", indent="   "))


def steady_state() -> None:
    """Section 1."""
    cost = instance(64, 160, Schedule(32, 1, "gpipe", "direct"))
    e = partition(cost, "even", objective="throughput")
    h = partition(cost, "heuristic", objective="throughput")
    lb = cost.period_lower_bound()
    print("\n1. Steady state, 64 nodes x 160 layers (483 entries), s per micro-batch of 32")
    print(f"   even       {e.period_s:9.4f}")
    print(f"   heuristic  {h.period_s:9.4f}   ({len(h.stages)} stages, {len(h.idle_nodes)} idle)")
    print(f"   bound      {lb:9.4f}   (total work / total speed)")
    print(f"   even / heuristic = {e.period_s / h.period_s:.3f}  (target >= 1.8; paper 1.55x)")
    print(f"   heuristic / bound = {h.period_s / lb:.4f}  (target <= 1.08)")


def steps() -> None:
    """Section 2."""
    print("\n2. Step time, 64 nodes x 160 layers (s per step)")
    rows = []
    for label, sched in [
        ("GPipe M=256 (4 x 64)", Schedule(256, 256, "gpipe", "direct")),
        ("1F1B M=256 (4 x 64)", Schedule(256, 256, "1f1b", "direct")),
        ("sequential M=1", Schedule(32, 1, "sequential", "direct")),
    ]:
        cost = instance(64, 160, sched)
        e = partition(cost, "even").predicted_step_time_s
        h = partition(cost, "heuristic")
        step, lb = h.predicted_step_time_s, cost.step_lower_bound()
        cells = [e, step, lb, e / step, step / lb]
        rows.append([label, *(f"{v:.3f}" for v in cells), len(h.stages)])
    show(["schedule", "even", "heuristic", "bound", "even/heur", "heur/bound", "stages"], rows)


def solve_times() -> None:
    """Section 3."""
    print("\n3. Heuristic solve time (throughput; best of 3)")
    for nodes, num_layers, target in [(64, 160, 0.1), (1024, 666, 2.0)]:
        cost = instance(nodes, num_layers, Schedule(32, 1, "gpipe", "direct"))
        best = min(
            _timed(lambda c=cost: partition(c, "heuristic", objective="throughput"))
            for _ in range(3)
        )
        print(
            f"   {nodes:5d} nodes x {cost.num_layers:5d} entries: {best * 1e3:8.1f} ms "
            f"(target <= {target * 1e3:.0f} ms)"
        )


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def optimal_small(limit: float) -> None:
    """Section 4."""
    print(f"\n4. optimal (time limit {limit:g} s): throughput, and a GPipe step with M = 4")
    rows = []
    for nodes, num_layers, objective, sched in [
        (16, 40, "throughput", Schedule(32, 1, "gpipe", "direct")),
        (32, 160, "throughput", Schedule(32, 1, "gpipe", "direct")),
        (16, 40, "step", Schedule(32, 4, "gpipe", "direct")),
    ]:
        cost = instance(nodes, num_layers, sched)
        h = partition(cost, "heuristic", objective=objective)
        o = partition(cost, "optimal", objective=objective, time_limit_s=limit)
        rows.append(
            [
                f"{nodes}x{num_layers} {objective}",
                f"{h.objective_value_s:.4f}",
                f"{o.objective_value_s:.4f}",
                f"{o.lower_bound_s:.4f}",
                o.proven_optimal,
                tables.num(o.mip_gap),
                f"{o.solve_time_s:.2f}",
                o.note or "-",
            ]
        )
    head = ["instance", "heuristic", "optimal", "bound", "proven", "gap", "time s", "note"]
    show(head, rows, align="lrrrrrrl")


def grid(quick: bool, limit: float) -> None:
    """Section 5."""
    nodes_list = [4, 8, 16] if quick else [4, 8, 16, 32, 64]
    layers_list = [10, 20, 40] if quick else [10, 20, 40, 80, 160]
    print(f"\n5. Sweep grid, throughput (s per micro-batch); optimal limit {limit:g} s")
    rows = []
    for num_layers in layers_list:
        for nodes in nodes_list:
            cost = instance(nodes, num_layers, Schedule(32, 1, "gpipe", "direct"))
            res = {m: _plan(cost, m, "throughput", limit) for m in ("even", "heuristic", "optimal")}
            cells: list[object] = [nodes, num_layers]
            cells += [f"{p.period_s:.4f}" if isinstance(p, Plan) else p[:9] for p in res.values()]
            cells.append(f"{cost.period_lower_bound():.4f}")
            e, h, o = res["even"], res["heuristic"], res["optimal"]
            ok = isinstance(e, Plan) and isinstance(h, Plan)
            cells.append(f"{e.period_s / h.period_s:.2f}" if ok else "-")  # type: ignore[union-attr]
            cells.append(str(o.proven_optimal) if isinstance(o, Plan) else "-")
            rows.append(cells)
    show(["nodes", "layers", "even", "heur", "optimal", "bound", "e/h", "proven"], rows, "r")


def main(argv: list[str] | None = None) -> None:
    """Run every section and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid, short MILP limits")
    ap.add_argument("--optimal-limit", type=float, default=None, help="section 4 (s)")
    args = ap.parse_args(argv)
    limit4 = args.optimal_limit or (10.0 if args.quick else 60.0)
    steady_state()
    steps()
    solve_times()
    optimal_small(limit4)
    grid(args.quick, 2.0 if args.quick else 10.0)
    random_fleets(args.quick)


if __name__ == "__main__":
    main()
