"""The slot/kind MILP of ``optimal``, solved by HiGHS (:func:`scipy.optimize.milp`).

A mixed-integer programme over pipeline *slots* and node *kinds*: nodes with identical
profiles are interchangeable, so the model chooses how many of each kind and where,
not which one, which removes the symmetry that stalls node-indexed models. Binary
``y[k, j]`` = layer j in slots ``<= k``, binary ``z[k, t]`` = slot k runs a node of
kind t, continuous ``x[k, j, t]`` = layer j in slot k of kind t. It needs the
``direct`` transport and links that are the same for every node pair
(:func:`_milp_ok` says why not otherwise).
"""

from __future__ import annotations

import time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from sky_flower.core.cost import CostModel, Stage
from sky_flower.core.partition.plan import _kinds

MILP_VARIABLE_LIMIT = 60_000  # slot x layer x kind variables


class _SlotMilp:
    """The slot/kind MILP (``direct`` transport, the same link between every pair).

    Slots ``k = 0..K-1`` in pipeline order (slot 0: the data owner); used slots come
    first. Variables: binary ``y[k, j]`` (k < K-1; layer j in slots <= k), binary
    ``z[k, t]`` (k >= 1; slot k runs a node of kind t), continuous ``x[k, j, t]`` (layer j
    in slot k, of kind t), then the objective's epigraph variables. Rows: ``y``
    monotone in j and k; ``sum_t x[k, j, t] = y[k, j] - y[k-1, j]``; ``x <= z``;
    ``sum_t z[k, t] <= 1`` and non-increasing in k; a used slot holds a layer; at most
    ``n_t`` slots of kind t; memory per slot. Link after slot k at layer j costs
    ``link_j (y[k, j] - y[k, j+1])``. Objectives: ``throughput``: ``min P``, ``P >=``
    every stage's ``F + B`` and every link; ``step``: the closed form of the schedule
    (``sequential``: ``M sum``; ``gpipe``/``1f1b``: GPipe's ``sum + (M-1)(PF + PB)``,
    for ``1f1b`` a surrogate, re-scored by the simulator).
    """

    def __init__(self, cost: CostModel, objective: str) -> None:
        self.cost = cost
        L = cost.num_layers
        K = min(cost.num_nodes, L)
        kinds = _kinds(cost)
        kind_ids = sorted(set(kinds) - {-1})
        self.rep = {t: kinds.index(t) for t in kind_ids}  # a representative node per kind
        self.members = {t: [i for i, k in enumerate(kinds) if k == t] for t in kind_ids}
        T = len(kind_ids)
        self.K, self.L, self.T, self.kind_ids = K, L, T, kind_ids
        ny = max(K - 1, 0) * L
        nz = (K - 1) * T
        nx = (K - 1) * L * T
        self.oy, self.oz, self.ox = 0, ny, ny + nz
        oe = ny + nz + nx
        step = objective == "step"
        kind = cost.schedule.kind
        M = cost.schedule.microbatches
        n_epi = 2 if (step and kind != "sequential") else (1 if not step else 0)
        self.nvar = oe + n_epi
        self.oe = oe
        mb = cost.schedule.microbatch_size
        owner = cost.owner
        lat = float(cost.latency[owner])
        link = lat + mb * cost.act_out * float(cost.inv_bw.max())  # link after layer j
        c = np.zeros(self.nvar)
        rows, cols, vals, lo, hi = [], [], [], [], []
        r = 0

        def add(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
            nonlocal r
            for col, v in entries:
                rows.append(r)
                cols.append(col)
                vals.append(v)
            lo.append(lb)
            hi.append(ub)
            r += 1

        def Y(k: int, j: int) -> int:
            return self.oy + k * L + j

        def Z(k: int, t: int) -> int:
            return self.oz + (k - 1) * T + t

        def X(k: int, j: int, t: int) -> int:
            return self.ox + ((k - 1) * L + j) * T + t

        def y_terms(k: int, j: int, v: float) -> tuple[list[tuple[int, float]], float]:
            """``v * y[k, j]`` as (entries, constant)."""
            if k < 0:
                return [], 0.0
            if k >= K - 1:
                return [], v
            return [(Y(k, j), v)], 0.0

        # monotone y
        for k in range(K - 1):
            for j in range(L - 1):
                add([(Y(k, j), 1.0), (Y(k, j + 1), -1.0)], 0.0, np.inf)
            if k > 0:
                for j in range(L):
                    add([(Y(k, j), 1.0), (Y(k - 1, j), -1.0)], 0.0, np.inf)
        # x decomposition, x <= z
        for k in range(1, K):
            for j in range(L):
                e = [(X(k, j, t), 1.0) for t in range(T)]
                e1, c1 = y_terms(k, j, -1.0)
                e2, c2 = y_terms(k - 1, j, 1.0)
                add(e + e1 + e2, -(c1 + c2), -(c1 + c2))  # sum_t x - y_k + y_(k-1) = 0
                for t in range(T):
                    add([(Z(k, t), 1.0), (X(k, j, t), -1.0)], 0.0, np.inf)
        # slot use
        for k in range(1, K):
            add([(Z(k, t), 1.0) for t in range(T)], -np.inf, 1.0)
            if k + 1 < K:
                add(
                    [(Z(k, t), 1.0) for t in range(T)] + [(Z(k + 1, t), -1.0) for t in range(T)],
                    0.0,
                    np.inf,
                )
            # a used slot holds a layer: sum_j x[k, j, .] >= sum_t z[k, t]
            add(
                [(X(k, j, t), 1.0) for j in range(L) for t in range(T)]
                + [(Z(k, t), -1.0) for t in range(T)],
                0.0,
                np.inf,
            )
        for ti, t in enumerate(kind_ids):
            add([(Z(k, ti), 1.0) for k in range(1, K)], -np.inf, float(len(self.members[t])))
        # memory
        for k in range(K):
            n_in = cost.inflight(k, K)
            mem = cost.memory_static + n_in * mb * cost.stash
            if k == 0:
                e = []
                const = 0.0
                for j in range(L):
                    ee, cc = y_terms(0, j, float(mem[j]))
                    e += ee
                    const += cc
                add(e, -np.inf, min(float(cost.capacity[owner]), float(mem.sum()) + 1) - const)
            else:
                e = [(X(k, j, t), float(mem[j])) for j in range(L) for t in range(T)]
                # a capacity above the whole model's need is vacuous; clipping it keeps
                # coefficients in HiGHS's range (it refuses |a| > 1e15)
                e += [
                    (Z(k, t), -min(float(cost.capacity[self.rep[tid]]), float(mem.sum()) + 1))
                    for t, tid in enumerate(kind_ids)
                ]
                add(e, -np.inf, 0.0)
        # stage compute F_k, B_k as linear expressions
        fwd, bwd = cost.fwd, cost.bwd

        def stage_expr(k: int, which: np.ndarray) -> tuple[list[tuple[int, float]], float]:
            if k == 0:
                e, const = [], 0.0
                for j in range(L):
                    ee, cc = y_terms(0, j, float(which[owner, j]))
                    e += ee
                    const += cc
                return e, const
            return [
                (X(k, j, t), float(which[self.rep[tid], j]))
                for j in range(L)
                for t, tid in enumerate(kind_ids)
            ], 0.0

        def link_expr(k: int) -> tuple[list[tuple[int, float]], float]:
            e, const = [], 0.0
            for j in range(L - 1):
                e1, c1 = y_terms(k, j, float(link[j]))
                e2, c2 = y_terms(k, j + 1, -float(link[j]))
                e += e1 + e2
                const += c1 + c2
            return e, const

        self.offset = 0.0
        exprs_f = [stage_expr(k, fwd) for k in range(K)]
        exprs_b = [stage_expr(k, bwd) for k in range(K)]
        exprs_l = [link_expr(k) for k in range(K - 1)]

        def to_obj(expr: tuple[list[tuple[int, float]], float], w: float) -> None:
            for col, v in expr[0]:
                c[col] += w * v
            self.offset += w * expr[1]

        def epi(var: int, expr: tuple[list[tuple[int, float]], float]) -> None:
            # var >= expr  <=>  var - expr_terms >= const
            add([(var, 1.0)] + [(col, -v) for col, v in expr[0]], expr[1], np.inf)

        if not step:  # throughput: min P
            P = oe
            c[P] = 1.0
            for k in range(K):
                e = (exprs_f[k][0] + exprs_b[k][0], exprs_f[k][1] + exprs_b[k][1])
                epi(P, e)
            for k in range(K - 1):
                epi(P, exprs_l[k])
        else:
            w = float(M) if kind == "sequential" else 1.0
            for k in range(K):
                to_obj(exprs_f[k], w)
                to_obj(exprs_b[k], w)
            for k in range(K - 1):
                to_obj(exprs_l[k], 2.0 * w)
            if kind != "sequential":
                PF, PB = oe, oe + 1
                c[PF] = c[PB] = M - 1
                for k in range(K):
                    epi(PF, exprs_f[k])
                    epi(PB, exprs_b[k])
                for k in range(K - 1):
                    epi(PF, exprs_l[k])
                    epi(PB, exprs_l[k])
        self.c = c
        A = coo_matrix((vals, (rows, cols)), shape=(r, self.nvar)).tocsr()
        self.constraints = LinearConstraint(A, np.array(lo), np.array(hi))
        lower = np.zeros(self.nvar)
        upper = np.ones(self.nvar)
        upper[oe:] = np.inf
        if K > 1:
            lower[Y(0, 0)] = 1.0  # the data owner holds layer 0
        self.bounds = Bounds(lower, upper)
        self.integrality = np.zeros(self.nvar)
        self.integrality[: self.ox] = 1

    def solve(self, time_limit_s: float, mip_rel_gap: float):  # noqa: ANN201
        """Run HiGHS; ``res.fun + offset`` is the objective. HiGHS's presolve (scipy
        1.x's) declares some small feasible instances of this programme infeasible
        (found by ``tests/test_partition.py``'s property test: a plan brute force finds,
        which satisfies every row); an "infeasible" answer is therefore checked once
        more without presolve, within the time left."""
        t0 = time.perf_counter()
        options = {"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False}
        res = milp(
            self.c,
            constraints=self.constraints,
            integrality=self.integrality,
            bounds=self.bounds,
            options=options,
        )
        if res.status == 2:  # infeasible: HiGHS's presolve can be wrong; ask without it
            left = max(time_limit_s - (time.perf_counter() - t0), 0.1)
            res = milp(
                self.c,
                constraints=self.constraints,
                integrality=self.integrality,
                bounds=self.bounds,
                options={**options, "time_limit": left, "presolve": False},
            )
        return res

    def to_stages(self, sol: np.ndarray) -> list[Stage]:
        """Stages from a solution: slot kinds mapped to distinct nodes of that kind."""
        K, L, T = self.K, self.L, self.T
        y = np.ones((K, L))
        if K > 1:
            y[: K - 1] = np.round(sol[: (K - 1) * L]).reshape(K - 1, L)
        z = np.round(sol[self.oz : self.ox]).reshape(K - 1, T) if K > 1 else np.zeros((0, T))
        slot_of = (1 - y).sum(axis=0).astype(int)  # slot index of each layer
        pool = {t: list(m) for t, m in self.members.items()}
        stages = []
        for k in range(K):
            js = np.flatnonzero(slot_of == k)
            if len(js) == 0:
                continue
            if k == 0:
                node = self.cost.owner
            else:
                t = int(np.argmax(z[k - 1]))
                node = pool[self.kind_ids[t]].pop(0)
            stages.append((node, int(js.min()), int(js.max())))
        return stages


def _milp_ok(cost: CostModel) -> str | None:
    """None if the MILP models this cost exactly, else why not."""
    if cost.relay:
        return "the MILP models the direct transport (relay adds per-message terms)"
    if len(set(cost.inv_bw.tolist())) > 1 or len(set(cost.latency.tolist())) > 1:
        return "the MILP needs the same link between every pair of nodes"
    return None


def plan_gap(value: float, lower_bound: float) -> float | None:
    """Relative gap ``(value - lower_bound) / value`` of a returned plan (objective
    ``value``, seconds) to a proven ``lower_bound`` (seconds, e.g. HiGHS's dual bound):
    the plan is within this fraction of the optimum. 0 when the bound meets the value;
    ``None`` when either is not finite or ``value <= 0``.

    HiGHS's own ``mip_gap`` is that of *its* incumbent, measured without the programme's
    constant offset; when the heuristic's plan is returned instead, or the incumbent is
    re-scored by the cost model, it describes a plan that was not returned.
    """
    if not (np.isfinite(value) and np.isfinite(lower_bound)) or value <= 0:
        return None
    return float(max(0.0, (value - lower_bound) / value))
