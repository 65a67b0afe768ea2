"""Small-instance enumeration: every order, idle set and cut (pure, no Flower).

:func:`_enumerate` scores every plan (identical nodes deduplicated) and keeps the best
that fits memory; ``optimal`` uses it up to ``ENUMERATION_LIMIT`` plans and the heuristic
up to ``HEURISTIC_ENUMERATION_LIMIT``.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from sky_flower.core.cost import CostModel, Stage
from sky_flower.core.partition.plan import _counts_to_stages, _kinds

HEURISTIC_ENUMERATION_LIMIT = 1_000  # plans; the heuristic enumerates instances this small
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
