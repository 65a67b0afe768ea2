"""Small-instance enumeration: every order, idle set and cut (pure, no Flower).

:func:`_enumerate` is the exact method ``optimal`` uses when there are at most
``ENUMERATION_LIMIT`` plans (identical nodes deduplicated); :func:`brute_force` wraps it
as a plan for tests. :func:`feasible_stages` finds *some* plan that fits memory (the
heuristic's greedy fill without a time cap), for callers that need any valid split.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from sky_flower.core.cost import CostModel, Stage
from sky_flower.core.partition.heuristic import _Filler, _orders
from sky_flower.core.partition.plan import (
    InfeasibleMemoryError,
    Plan,
    _counts_to_stages,
    _infeasible_message,
    _kinds,
    make_plan,
)

ENUMERATION_LIMIT = 20_000  # plans; above this ``optimal`` solves the MILP


def _count_plans(N: int, L: int) -> int:
    """Plans with the owner first: ordered choices of the other nodes x cut positions."""
    total = 0
    for s in range(min(N, L)):  # s other stages
        total += math.perm(N - 1, s) * math.comb(L - 1, s)
        if total > 10 * ENUMERATION_LIMIT:
            break
    return total


def _enumerate(cost: CostModel, objective: str) -> list[Stage] | None:
    """Best plan over every order (identical nodes deduplicated), idle set and cut."""
    L = cost.num_layers
    kinds = _kinds(cost)
    others = [i for i in range(cost.num_nodes) if i != cost.owner]
    best, best_v = None, math.inf
    for s in range(min(len(others), L - 1) + 1):
        seen: set[tuple] = set()
        for perm in itertools.permutations(others, s):
            sig = tuple(kinds[i] for i in perm)
            if sig in seen:
                continue
            seen.add(sig)
            order = [cost.owner, *perm]
            for cuts in itertools.combinations(range(1, L), s):
                counts = np.diff([0, *cuts, L])
                stages = _counts_to_stages(order, counts)
                if not cost.fits(stages):
                    continue
                v = cost.objective(stages, objective)
                if v < best_v:
                    best, best_v = stages, v
    return best


def brute_force(cost: CostModel, objective: str = "step") -> Plan:
    """Exhaustive search over every plan (tiny instances only; for tests).

    Raises
    ------
    InfeasibleMemoryError
        If none fits memory.
    """
    t0 = time.perf_counter()
    best = _enumerate(cost, objective)
    if best is None:
        raise InfeasibleMemoryError(_infeasible_message(cost))
    return make_plan(
        cost,
        "brute_force",
        best,
        time.perf_counter() - t0,
        objective=objective,
        proven_optimal=True,
    )


def feasible_stages(cost: CostModel) -> list[Stage]:
    """Some plan that fits every node's memory (greedy fill by memory, largest first).

    Raises
    ------
    InfeasibleMemoryError
        With the layers that do not fit and memory needed against memory available.
    """
    filler = _Filler(cost)
    sizes: list[int | None] = [None]
    if cost.schedule.kind == "1f1b" and not cost.relay:  # shorter pipelines stash less
        sizes += list(range(1, min(cost.num_nodes, cost.num_layers) + 1))
    for num_stages in sizes:
        for order in _orders(cost):
            s = filler.fill(order, math.inf, num_stages=num_stages)
            if s is not None and cost.fits(s):
                return s
    raise InfeasibleMemoryError(_infeasible_message(cost))


feasible_bounds = feasible_stages  # former name
