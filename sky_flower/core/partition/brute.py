"""Exhaustive search as a plan, and *some* plan that fits (pure, no Flower).

:func:`brute_force` wraps the enumeration of :mod:`.enumeration` (every order, idle set
and cut) as a plan for tests. :func:`feasible_stages` finds *some* plan that fits memory
(a greedy fill without a time cap, else the exact check's witness), for callers that need
any valid split.
"""

from __future__ import annotations

import math
import time

from sky_flower.core.cost import CostModel, Stage
from sky_flower.core.partition.enumeration import _enumerate
from sky_flower.core.partition.heuristic import _Filler, _orders, seed_feasibility
from sky_flower.core.partition.plan import (
    InfeasibleMemoryError,
    Plan,
    _infeasible_message,
    make_plan,
)


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
