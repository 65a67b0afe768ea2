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
from sky_flower.core.partition.heuristic import _Filler, _orders, seed_feasibility
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


def _enumerate(
    cost: CostModel, objective: str, deadline: float = math.inf
) -> tuple[list[Stage] | None, bool]:
    """Best plan over every order (identical nodes deduplicated), idle set and cut, and
    whether the enumeration finished before ``deadline`` (``time.perf_counter()``)."""
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
            if time.perf_counter() > deadline:
                return best, False
            for cuts in itertools.combinations(range(1, L), s):
                counts = np.diff([0, *cuts, L])
                stages = _counts_to_stages(order, counts)
                if not cost.fits(stages):
                    continue
                v = cost.objective(stages, objective)
                if v < best_v:
                    best, best_v = stages, v
    return best, True


def brute_force(cost: CostModel, objective: str = "step") -> Plan:
    """Exhaustive search over every plan (tiny instances only; for tests).

    Raises
    ------
    InfeasibleMemoryError
        If none fits memory.
    """
    t0 = time.perf_counter()
    best, _ = _enumerate(cost, objective)
    if best is None:
        raise InfeasibleMemoryError(
            f"{_infeasible_message(cost)} (proven by exhaustive enumeration)"
        )
    return make_plan(
        cost,
        "brute_force",
        best,
        time.perf_counter() - t0,
        objective=objective,
        proven_optimal=True,
    )


def feasible_stages(cost: CostModel, time_limit_s: float = 10.0) -> list[Stage]:
    """Some plan that fits every node's memory: a greedy fill by memory (largest first),
    else the exact check's witness (:func:`~sky_flower.core.partition.feasible.check_memory`).

    Raises
    ------
    InfeasibleMemoryError
        With the layers that do not fit, memory needed against memory available, and
        which check proved it (or that it ran out of ``time_limit_s``: unknown).
    """
    filler = _Filler(cost)
    for order in _orders(cost):
        s = filler.fill(order, math.inf)
        if s is not None and cost.fits(s):
            return s
    found: list[list[Stage]] = []
    seed_feasibility(cost, found.append, False, time_limit_s)
    return found[0]


feasible_bounds = feasible_stages  # former name
