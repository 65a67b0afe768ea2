"""Exact memory feasibility: does *any* plan fit every node's memory? (pure, no Flower)

Deciding whether the layers fit is a contiguous bin-packing problem with a free choice
of bins and their order (NP-hard in general: 3-partition reduces to it), so greedy
fills in a few node orders miss plans that fit. :func:`check_memory` decides it
exactly, cheapest proof first:

1. **A dynamic programme over capacity kinds.** For memory only a node's capacity
   matters, so nodes with the same capacity (capacities above the whole model's need
   count as one) are interchangeable; the state is *how many* nodes of each kind are in
   use (``prod_t (n_t + 1)`` states) and keeps the furthest layer the pipeline reaches.
   Reaching further is never worse (the rest of the model is a suffix, and every block
   of a plan for a longer suffix shrinks), so each appended node takes the longest
   block that fits it. A node may take an empty block, which keeps the proof valid for
   1F1B, whose stages stash ``min(S - k, M)`` micro-batches: the programme runs once
   per pipeline length ``S`` with that charge, and dropping empty stages only lowers it.
2. **The feasibility MILP** (HiGHS via :func:`scipy.optimize.milp`) over pipeline slots
   and capacity kinds when the programme has too many states: binary ``y[k, j]`` =
   layer j in slots ``<= k``, binary ``z[k, t]`` = slot k runs a node of kind t. Within
   its time limit it proves feasibility (a witness) or infeasibility; when it runs out
   the answer is ``unknown``, never ``infeasible``.

The witness seeds the heuristic; the result says which check decided.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from sky_flower.core.cost import CostModel, Stage
from sky_flower.core.partition.dp import sweep_levels

FEASIBILITY_STATE_LIMIT = 4_000_000  # capacity-kind count vectors x pipeline lengths


@dataclass(frozen=True)
class Feasibility:
    """What :func:`check_memory` found.

    Attributes
    ----------
    status : {"feasible", "infeasible", "unknown"}
        ``unknown`` only when the check ran out of time or size.
    stages : list of Stage or None
        A witness plan that fits (``feasible`` only).
    method : str
        Which check decided (for messages).
    """

    status: str
    stages: list[Stage] | None
    method: str

    @property
    def feasible(self) -> bool:
        """True when a plan that fits exists (a witness is in ``stages``)."""
        return self.status == "feasible"


def _capacity_kinds(cost: CostModel) -> tuple[list[float], list[list[int]]]:
    """Distinct capacities of the non-owner nodes (clipped to the whole model's need
    plus one byte) and the nodes of each, largest capacity first."""
    top = cost.stage_memory(0, cost.num_layers - 1) + 1.0
    groups: dict[float, list[int]] = {}
    for i in range(cost.num_nodes):
        if i != cost.owner:
            groups.setdefault(min(float(cost.capacity[i]), top), []).append(i)
    caps = sorted(groups, reverse=True)
    return caps, [groups[c] for c in caps]


def _pipeline_lengths(cost: CostModel) -> list[int]:
    """Pipeline lengths to charge separately (1F1B's stash depends on them)."""
    n = min(cost.num_nodes, cost.num_layers)
    charges = {tuple(cost.inflight(k, s) for k in range(s)) for s in range(1, n + 1)}
    if all(len(set(c)) == 1 for c in charges) and len({c[0] for c in charges}) == 1:
        return [cost.num_nodes]  # the same charge for every stage of every pipeline
    return list(range(1, n + 1))


class _KindDP:
    """Furthest-reach DP over capacity-kind counts (module docstring, check 1)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.caps, self.members = _capacity_kinds(cost)
        self.counts = [len(m) for m in self.members]
        radix = [n + 1 for n in self.counts]
        self.num_states = math.prod(radix)
        self.strides = [math.prod(radix[t + 1 :]) for t in range(len(radix))]
        self.radix = radix

    def run(self, S: int, deadline: float) -> list[Stage] | None | str:
        """A witness for pipelines of at most ``S`` stages charged as ``S``, None if
        none, or ``"timeout"``."""
        cost = self.cost
        L = cost.num_layers
        mb = cost.schedule.microbatch_size
        n_stages = min(S, cost.num_nodes)

        def mem(k: int) -> np.ndarray:
            return cost.static_prefix + cost.inflight(k, n_stages) * mb * cost.stash_prefix

        m0 = mem(0)
        e0 = min(int(np.searchsorted(m0, m0[0] + cost.capacity[cost.owner], "right")) - 1, L)
        if e0 <= 0:
            return None
        if e0 == L:
            return [(cost.owner, 0, L - 1)]
        if not self.radix:
            return None
        digits = np.indices(self.radix).reshape(len(self.radix), -1).T
        level = digits.sum(axis=1)
        levels = [np.flatnonzero(level == k) for k in range(min(n_stages - 1, level.max()) + 1)]

        mems: dict[int, np.ndarray] = {}

        def extend(t: int, k: int, p: np.ndarray) -> np.ndarray:
            mp = mems[k] if k in mems else mems.setdefault(k, mem(k))
            e = np.minimum(np.searchsorted(mp, mp[p] + self.caps[t], side="right") - 1, L)
            return np.maximum(e, p)  # an empty block: the node holds nothing

        steps = sweep_levels(levels, digits, self.strides, e0, L, extend, deadline)
        return steps if steps is None or steps == "timeout" else self._witness(steps, e0)  # type: ignore[arg-type]

    def _witness(self, steps: list[tuple[int, int, int]], e0: int) -> list[Stage]:
        pool = [list(m) for m in self.members]
        stages = [(self.cost.owner, 0, e0 - 1)]
        for t, p, e in steps:
            node = pool[t].pop(0)
            if e > p:
                stages.append((node, p, e - 1))
        return stages


def _decode(cost: CostModel, x: np.ndarray, K: int, members: list[list[int]]) -> list[Stage]:
    """Stages from a solution of the feasibility MILP (``y`` then ``z`` columns)."""
    L, T = cost.num_layers, len(members)
    ny = (K - 1) * L
    yv = np.ones((K, L))
    yv[: K - 1] = np.round(x[:ny]).reshape(K - 1, L)
    zv = np.round(x[ny:]).reshape(K - 1, T)
    slot_of = (1 - yv).sum(axis=0).astype(int)
    pool = [list(m) for m in members]
    stages = []
    for k in range(K):
        js = np.flatnonzero(slot_of == k)
        if len(js):
            node = cost.owner if k == 0 else pool[int(np.argmax(zv[k - 1]))].pop(0)
            stages.append((node, int(js.min()), int(js.max())))
    return stages


def _milp_feasible(cost: CostModel, time_limit_s: float, exact: bool) -> Feasibility:
    """The slot/capacity-kind feasibility MILP (module docstring, check 2); ``exact``:
    every stage stashes the same (else the MILP charges the most, and proves only
    feasibility)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    caps, members = _capacity_kinds(cost)
    L, K, T = cost.num_layers, min(cost.num_nodes, cost.num_layers), len(caps)
    if K == 1:
        return _one_stage(cost)
    mem = cost.memory_static + cost.inflight(0, K) * cost.schedule.microbatch_size * cost.stash
    ny, nz = (K - 1) * L, (K - 1) * T  # y[k, j] for k < K - 1; z[k, t] for k >= 1
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def add(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        for c, v in entries:
            rows.append(len(lo))
            cols.append(c)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)

    def y(k: int, j: int) -> list[tuple[int, float]]:  # empty = the constant 0 or 1
        return [(k * L + j, 1.0)] if 0 <= k < K - 1 else []

    def slot(k: int, j: int, sign: float) -> tuple[list[tuple[int, float]], float]:
        """``sign * (y[k, j] - y[k-1, j])`` as entries and a constant."""
        ent = [(c, sign * v) for c, v in y(k, j)] + [(c, -sign * v) for c, v in y(k - 1, j)]
        const = sign * ((k >= K - 1) - 0.0) if k >= 0 else 0.0
        return ent, const

    zcol = [[ny + (k - 1) * T + t for t in range(T)] for k in range(1, K)]
    for k in range(K - 1):
        for j in range(L - 1):
            add([(k * L + j, 1.0), (k * L + j + 1, -1.0)], 0.0, np.inf)
        if k > 0:
            for j in range(L):
                add([(k * L + j, 1.0), ((k - 1) * L + j, -1.0)], 0.0, np.inf)
    for k in range(1, K):
        zs = zcol[k - 1]
        add([(c, 1.0) for c in zs], -np.inf, 1.0)
        for j in range(L):  # a layer in slot k needs a node there
            ent, const = slot(k, j, 1.0)
            add(ent + [(c, -1.0) for c in zs], -np.inf, -const)
        ent, const = [], 0.0
        for j in range(L):
            e, c = slot(k, j, float(mem[j]))
            ent += e
            const += c
        add(ent + [(c, -cap) for c, cap in zip(zs, caps, strict=True)], -np.inf, -const)
    for t in range(T):
        add([(zcol[k - 1][t], 1.0) for k in range(1, K)], -np.inf, float(len(members[t])))
    owner_cap = min(float(cost.capacity[cost.owner]), float(mem.sum()) + 1.0)
    add([(j, float(mem[j])) for j in range(L)], -np.inf, owner_cap)
    nvar = ny + nz
    lower = np.zeros(nvar)
    lower[0] = 1.0  # the data owner holds layer 0
    a = coo_matrix((vals, (rows, cols)), shape=(len(lo), nvar)).tocsr()
    res = milp(
        np.zeros(nvar),
        constraints=LinearConstraint(a, np.array(lo), np.array(hi)),
        integrality=np.ones(nvar),
        bounds=Bounds(lower, np.ones(nvar)),
        options={"time_limit": max(time_limit_s, 0.1), "disp": False},
    )
    method = "the feasibility MILP over capacity kinds (HiGHS)"
    if res.x is not None:
        stages = _decode(cost, res.x, K, members)
        if cost.fits(stages):
            return Feasibility("feasible", stages, method)
    if res.status == 2 and exact:  # infeasible, proven
        return Feasibility("infeasible", None, method)
    return Feasibility("unknown", None, method + f" stopped: {res.message}")


def _one_stage(cost: CostModel) -> Feasibility:
    """One layer or one node: the only plan is the data owner alone."""
    alone = [(cost.owner, 0, cost.num_layers - 1)]
    if cost.fits(alone):
        return Feasibility("feasible", alone, "the one-stage check")
    return Feasibility("infeasible", None, "the one-stage check (one node or one layer)")


def check_memory(cost: CostModel, time_limit_s: float = 10.0) -> Feasibility:
    """Decide exactly whether some plan fits every node's memory.

    Parameters
    ----------
    cost : CostModel
    time_limit_s : float
        Wall-clock budget (seconds) of the whole check.

    Returns
    -------
    Feasibility
        ``feasible`` with a witness plan, ``infeasible`` (proven), or ``unknown`` (the
        check ran out of time; only possible for fleets with many distinct capacities).
    """
    deadline = time.perf_counter() + time_limit_s
    dp = _KindDP(cost)
    lengths = _pipeline_lengths(cost)
    method = "the exact dynamic programme over capacity kinds"
    if cost.num_layers == 1 or cost.num_nodes == 1:
        return _one_stage(cost)
    if dp.num_states * len(lengths) <= FEASIBILITY_STATE_LIMIT:
        for S in lengths:
            out = dp.run(S, deadline)
            if isinstance(out, str):
                return Feasibility("unknown", None, method + f" (time limit {time_limit_s:g} s)")
            if out is not None:
                return Feasibility("feasible", out, method)
        return Feasibility("infeasible", None, method)
    if len(lengths) > 1:
        out = dp.run(lengths[-1], deadline) if dp.num_states <= FEASIBILITY_STATE_LIMIT else None
        if isinstance(out, list):
            return Feasibility("feasible", out, method)
    return _milp_feasible(cost, deadline - time.perf_counter(), exact=len(lengths) == 1)
