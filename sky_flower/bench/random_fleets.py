"""Section 6 of ``python -m sky_flower.bench.planner``: random small fleets.

Fleets as users have them: few, unequal nodes, each with its own latency and bandwidth
(so the link between two stages depends on the pair), and memory that binds (each node
holds 25-70 % of the model). Fixed seeds. Two sets: 2-4 nodes x 5-9 layers, where brute
force gives the exact optimum, and 8 nodes x 10-16 layers, where ``optimal``'s proof
does (an unproven instance is counted and left out of the ratios). For each objective
(a GPipe step with M = 4 on ``direct``, and throughput) and method (``greedy`` is the
heuristic without its small-instance exact search): the share of
instances where the method is optimal (within 1e-6), the worst and mean ratio to the
exact optimum, refusals of instances that fit and acceptances of instances that do not
(against the exact memory check; must be 0 for ``heuristic`` and ``optimal``; ``even``
may refuse, it ignores memory), and the median and worst solve time.
"""

from __future__ import annotations

import time

import numpy as np

from sky_flower import tables
from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.partition import InfeasibleMemoryError, brute_force, heuristic, partition
from sky_flower.core.partition.feasible import check_memory
from sky_flower.core.profile import LayerProfile, NodeProfile

MIB = 1024 * 1024
METHODS = ("even", "greedy", "heuristic", "optimal")


def random_fleet(seed: int, nodes: int, num_layers: int, schedule: Schedule) -> CostModel:
    """One random instance (``seed`` fixes everything).

    Layers: 1-4 MiB of parameters, activations 16-256 KiB per sample, 1-10 ms forward
    per micro-batch (backward 1.5-2.5x). Node ``i``: a slowdown in 1-6 with +-20 %
    per-layer noise, latency 0.1-10 ms, bandwidth 12.5, 125 or 1,250 MB/s, memory
    25-70 % of the model's need; node 0 holds the data.
    """
    rng = np.random.default_rng(seed)
    act = rng.integers(16, 257, num_layers) * 1024.0
    layers = [
        LayerProfile(j, f"{j}:L", 0.0, 0.0, int(rng.integers(1, 5)) * MIB, 0, 0.0, float(act[j]))
        for j in range(num_layers)
    ]
    base = rng.uniform(1e-3, 1e-2, num_layers)
    ratio = rng.uniform(1.5, 2.5, num_layers)
    probe = CostModel(layers, [_node(0, base, ratio, 2**50, 0.0, 1e9, rng)], schedule)
    need = probe.stage_memory(0, num_layers - 1)
    fleet = [
        _node(
            i,
            base * rng.uniform(1, 6),
            ratio,
            int(need * rng.uniform(0.25, 0.7)),
            float(rng.uniform(1e-4, 1e-2)),
            float(rng.choice([12.5e6, 125e6, 1250e6])),
            rng,
        )
        for i in range(nodes)
    ]
    return CostModel(layers, fleet, schedule)


def _node(  # noqa: PLR0913
    i: int,
    base: np.ndarray,
    ratio: np.ndarray,
    memory: int,
    latency: float,
    bandwidth: float,
    rng: np.random.Generator,
) -> NodeProfile:
    fwd = base * rng.uniform(0.8, 1.2, len(base))
    return NodeProfile(
        name=f"n{i}",
        layer_fwd_s=tuple(float(v) for v in fwd),
        layer_bwd_s=tuple(float(v) for v in fwd * ratio),
        memory_bytes=memory,
        latency_s=latency,
        bandwidth_bps=bandwidth,
        holds_data=i == 0,
    )


def _solve(cost: CostModel, method: str, objective: str, limit: float) -> tuple:
    """``(plan or None, seconds)``."""
    t0 = time.perf_counter()
    try:
        if method == "greedy":  # the heuristic without its small-instance exact search
            plan = heuristic(cost, objective, small_exact=False)
        else:
            plan = partition(cost, method, objective=objective, time_limit_s=limit)
    except InfeasibleMemoryError:
        plan = None
    except ValueError:  # even with fewer layers than nodes
        plan = None
    return plan, time.perf_counter() - t0


def _instances(quick: bool) -> list[tuple[str, int, int, int]]:
    """``(set, seed, nodes, layers)``."""
    rng = np.random.default_rng(2026)
    small = [
        ("2-4 nodes", s, int(rng.integers(2, 5)), int(rng.integers(5, 10)))
        for s in range(40 if quick else 150)
    ]
    eight = [("8 nodes", 1000 + s, 8, int(rng.integers(10, 17))) for s in range(4 if quick else 16)]
    return small + eight


def random_fleets(quick: bool, limit: float = 60.0) -> None:
    """Section 6: print the table."""
    print(f"\n6. Random small fleets: a link per pair, binding memory (optimal limit {limit:g} s)")
    insts = _instances(quick)
    rows, notes = [], []
    for objective in ("step", "throughput"):
        for label in ("2-4 nodes", "8 nodes"):
            found, note = _rows(objective, label, [x for x in insts if x[0] == label], limit)
            rows += found
            notes.append(f"{label}, {objective}: {note}")
    head = ["set", "objective", "method", "optimal", "worst", "mean", "refus", "accep"]
    print(tables.text([*head, "median s", "max s"], rows, align="lll", sep="  ", indent="   "))
    print("\n".join(f"   {note}" for note in notes))


def _rows(objective: str, label: str, insts: list, limit: float) -> tuple[list[list], str]:
    """The table's rows of one set and objective, and the note on its instances."""
    stats = {m: {"ratios": [], "times": [], "refused": 0, "accepted": 0} for m in METHODS}
    unproven = infeasible = 0
    sched = Schedule(8, 4, "gpipe", "direct")
    for _, seed, n, L in insts:
        cost = random_fleet(seed, n, L, sched)
        fits = check_memory(cost).feasible
        plans = {m: _solve(cost, m, objective, limit) for m in METHODS}
        exact = None
        if fits and n <= 4:
            exact = brute_force(cost, objective).objective_value_s
        elif fits and plans["optimal"][0] is not None and plans["optimal"][0].proven_optimal:
            exact = plans["optimal"][0].objective_value_s
        unproven += fits and exact is None
        infeasible += not fits
        for m, (plan, secs) in plans.items():
            st = stats[m]
            st["times"].append(secs)
            st["refused"] += fits and plan is None and m != "even"
            st["accepted"] += (not fits) and plan is not None
            if exact is not None and plan is not None:
                st["ratios"].append(plan.objective_value_s / exact if exact > 0 else 1.0)
    rows = []
    for m in METHODS:
        st = stats[m]
        r = np.array(st["ratios"]) if st["ratios"] else np.array([np.nan])
        t = np.array(st["times"])
        cells = [
            label,
            objective,
            m,
            f"{np.mean(r <= 1 + 1e-6):.0%}",
            f"{np.nanmax(r):.3f}",
            f"{np.nanmean(r):.3f}",
            st["refused"],
            st["accepted"],
            f"{np.median(t):.3f}",
            f"{t.max():.2f}",
        ]
        rows.append(cells)
    return rows, (
        f"{len(insts)} instances, {infeasible} infeasible (proven), "
        f"{unproven} feasible but not proven (left out of the ratios)"
    )
