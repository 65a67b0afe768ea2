"""The three ways of choosing every owner's helpers: ``even``, ``heuristic``, ``optimal``.

Each returns a *solution*: ``(owner, helper set)`` in priority order (see
:mod:`~sky_flower.core.federated.instance`); the per-pipeline cuts come from
:func:`~sky_flower.core.partition.partition` with the same method.
"""

from __future__ import annotations

import itertools
import math
import time

from sky_flower.core.federated.instance import Instance, Solution

HEURISTIC_BUDGET_S = 0.6  # local search stops improving after this (seconds)
OPTIMAL_PIPELINE_LIMIT = 4096  # per-pipeline exact solves (owners x helper subsets)
OPTIMAL_SCHEDULE_LIMIT = 2_000_000  # helper-set combinations x orders after pruning


def by_samples(inst: Instance) -> list[int]:
    """Owner indices, most samples first (ties: fleet order)."""
    return sorted(range(inst.K), key=lambda k: (-inst.samples[k], k))


def even_solution(inst: Instance) -> tuple[Solution, str]:
    """Helpers dealt round-robin over the owners, most samples first.

    Rank the owners by samples (most first, ties: fleet order). With at least as many
    helpers as owners (``H >= K``), helper ``h`` (fleet order of the helpers) joins the
    owner ranked ``h mod K``, and every pipeline starts at once. With fewer
    (``0 < H < K``), the owner ranked ``r`` takes helper ``r mod H`` alone, and the
    pipelines sharing a helper run one after another, most samples first. With no
    helpers every owner trains alone. Inside each pipeline the ``even`` partition cuts
    equal layer counts in fleet order (owner first).
    """
    order = by_samples(inst)
    K, H = inst.K, inst.H
    if H >= K:
        sets = [frozenset(h for h in range(H) if h % K == r) for r in range(K)]
        note = "even: helper h joins the owner ranked h mod K by samples; all at once"
    elif H:
        sets = [frozenset({r % H}) for r in range(K)]
        note = (
            "even: the owner ranked r by samples takes helper r mod H; pipelines sharing "
            "a helper run one after another, most samples first"
        )
    else:
        sets = [frozenset() for _ in range(K)]
        note = "even: no helpers, every owner trains alone"
    return [(order[r], sets[r]) for r in range(K)], note


def heuristic_solution(inst: Instance) -> tuple[Solution, str]:
    """Stub until the chain search lands: the ``even`` assignment with heuristic cuts."""
    return even_solution(inst)[0], "heuristic cuts over the even assignment"


def optimal_solution(inst: Instance, deadline: float) -> tuple[Solution, bool, str]:
    """Stub until the enumeration lands."""
    return even_solution(inst)[0], False, "optimal cuts over the even assignment"


_ = (itertools, math, time, HEURISTIC_BUDGET_S, OPTIMAL_PIPELINE_LIMIT, OPTIMAL_SCHEDULE_LIMIT)
