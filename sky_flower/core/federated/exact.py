"""The joint ``optimal``: exhaustive search over helper sets and orders, with proof.

The model it is exact for: every owner's pipeline runs, without preemption, on the
nodes its plan's stages name (the owner and some helpers; owners do not help each
other), pipelines sharing a node run one after another (in some order), and the round
ends when the last pipeline does. For an optimal schedule with node sets ``U_k``, the
per-pipeline optimum over ``U_k`` is no slower and uses no more nodes, so it suffices to
enumerate, per owner, every helper set ``S`` with the ``optimal`` cuts over ``[owner] +
S``, and per combination every order of the pipelines that share nodes (a pipeline
starts when every earlier one sharing a node has finished: the earliest schedule for
that order).

Pruning, none of which drops the optimum: per owner, helper sets whose plan uses the
same nodes keep the fastest; a set is dropped when another uses a subset of its nodes
and is no slower; combinations are searched slowest-owner first with candidates sorted
by time and cut once a pipeline alone is no faster than the best round so far (the
heuristic's round is the first incumbent); orders are enumerated per connected group of
pipelines sharing nodes. Proven when the search completes and every per-pipeline plan
was proven optimal. Past :data:`OPTIMAL_PIPELINE_LIMIT` per-pipeline solves or
:data:`OPTIMAL_SCHEDULE_LIMIT` combinations x orders, or at the time limit, the best
plan found (at worst the heuristic's) is returned, not proven.
"""

from __future__ import annotations

import itertools
import math
import time

from sky_flower.core.federated.instance import Instance, Solution

OPTIMAL_PIPELINE_LIMIT = 4096  # owners x helper subsets solved exactly
OPTIMAL_SCHEDULE_LIMIT = 2_000_000  # combinations x orders, after pruning

Candidate = tuple[float, frozenset[str], frozenset[int]]  # time, nodes used, helper set


def candidates(inst: Instance, k: int, deadline: float) -> list[Candidate] | None:
    """Owner ``k``'s undominated pipelines over every helper subset, fastest first
    (None if ``deadline`` passes first)."""
    by_nodes: dict[frozenset[str], Candidate] = {}
    for r in range(inst.H + 1):
        for subset in itertools.combinations(range(inst.H), r):
            if time.perf_counter() > deadline:
                return None
            plan = inst.plan(k, subset, "optimal")
            if plan is None:
                continue
            t = inst.steps[k] * plan.predicted_step_time_s
            used = frozenset(s.node for s in plan.stages)
            if used not in by_nodes or t < by_nodes[used][0]:
                by_nodes[used] = (t, used, frozenset(subset))
    cands = sorted(by_nodes.values(), key=lambda c: (c[0], len(c[1])))
    return [
        c for i, c in enumerate(cands) if not any(d[1] <= c[1] and d[0] <= c[0] for d in cands[:i])
    ]


def best_order(times: list[float], used: list[frozenset[str]]) -> tuple[float, list[int]]:
    """Least makespan over the orders of pipelines (times, nodes used), and the order.

    Orders are enumerated per connected group of pipelines sharing nodes."""
    n = len(times)
    group = list(range(n))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for i, j in itertools.combinations(range(n), 2):
        if used[i] & used[j]:
            group[root(i)] = root(j)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    span, order = 0.0, []
    for members in groups.values():
        best, best_perm = math.inf, members
        for perm in itertools.permutations(members):
            ends: dict[int, float] = {}
            for i in perm:
                start = max((e for j, e in ends.items() if used[i] & used[j]), default=0.0)
                ends[i] = start + times[i]
            if max(ends.values()) < best:
                best, best_perm = max(ends.values()), list(perm)
        span, order = max(span, best), order + best_perm
    return span, order


def optimal_solution(
    inst: Instance, deadline: float, incumbent: Solution
) -> tuple[Solution, bool, str, str]:
    """The exact solution (module docstring), or the heuristic's ``incumbent`` improved
    as far as the limits allow. Returns the solution, whether it is proven, a note, and
    the per-pipeline method of its cuts (``heuristic`` when the search did not run)."""
    fallback = "heuristic plan, not proven"
    if inst.K * 2**inst.H > OPTIMAL_PIPELINE_LIMIT:
        why = f"{inst.K} owners x 2^{inst.H} helper sets exceed {OPTIMAL_PIPELINE_LIMIT}"
        return incumbent, False, f"optimal: {why} exact pipeline solves: {fallback}", "heuristic"
    owners = sorted(range(inst.K), key=lambda k: -inst.alone_time(k))
    cands = []
    for k in owners:  # the product only grows: stop as soon as it passes the limit
        c = candidates(inst, k, deadline)
        if c is None:
            return incumbent, False, f"optimal: time limit: {fallback}", "heuristic"
        cands.append(c)
        size = math.prod(len(c) for c in cands) * math.factorial(inst.K)
        if size > OPTIMAL_SCHEDULE_LIMIT:
            why = f"over {OPTIMAL_SCHEDULE_LIMIT} combinations x orders"
            return incumbent, False, f"optimal: {why}: {fallback}", "heuristic"
    best = inst.makespan(incumbent, "optimal")
    best_sol, complete = incumbent, True
    chosen: list[Candidate] = []

    def search(depth: int) -> None:
        nonlocal best, best_sol, complete
        if time.perf_counter() > deadline:
            complete = False
            return
        if depth == len(owners):
            span, order = best_order([c[0] for c in chosen], [c[1] for c in chosen])
            if span < best:
                best = span
                best_sol = [(owners[i], chosen[i][2]) for i in order]
            return
        for c in cands[depth]:
            if c[0] >= best:
                break
            chosen.append(c)
            search(depth + 1)
            chosen.pop()
            if not complete:
                return

    search(0)
    proven = complete and inst.unproven == 0
    note = "optimal: exhaustive over helper sets and orders"
    if not complete:
        note = "optimal: time limit reached, best plan found, not proven"
    elif inst.unproven:
        note += f", but {inst.unproven} pipeline plan(s) not proven optimal"
    return best_sol, proven, note, "optimal"
