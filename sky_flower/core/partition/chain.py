"""Exact plans with a link per pair of nodes: a DP over (nodes in use, last node, layer).

With per-node latency and bandwidth the link between consecutive stages depends on both
nodes, so the order of the nodes matters, and choosing it is NP-hard in general (with
every block of layers fixed, ordering the nodes to minimise the summed links is a
shortest Hamiltonian path; the period's bottleneck version is NP-hard too). The exact
method is therefore exponential in the number of distinct nodes, and stops where that
gets too big.

:class:`_ChainDP` keeps, for every state *(how many nodes of each kind are in use, the
link class of the last node, layers covered)*, the best value of a pipeline prefix.
Nodes with identical profiles are one *kind* (interchangeable); nodes with the same
latency and bandwidth are one *link class* (the link between two stages depends only on
their classes and the cut). With all nodes distinct the state is (set of used nodes,
last node, layer). Appending a node of kind ``t`` after a node of class ``c`` at cut
``p`` costs ``link(c, cls(t), p - 1)`` plus the block ``[p, e)`` on ``t``; a final pass
adds the last stage with its own terms (on ``relay`` the last stage does not recompute
and handles one message). Two semirings:

* ``max``: the steady-state period (``throughput``): ``max`` of stage ``F + B`` and links;
* ``sum``: a step that is a sum over stages (``sequential``, or ``M = 1`` on
  ``direct``), and the inner problem of the GPipe step below.

**GPipe with M > 1** (``direct``): the step is
``S + (M - 1) (PF + PB)`` with ``S = sum_k (F_k + B_k) + 2 sum links``,
``PF = max(F_k, links)`` and ``PB = max(B_k, links)``. :meth:`_ChainDP.gpipe` proves it by
branch and bound over boxes of caps ``[a1, b1] x [a2, b2]`` on ``(PF, PB)``, best lower
bound first. A box is solved by the min-sum programme under the caps ``F_k <= b1``,
``B_k <= b2``, links ``<= min(b1, b2)``: its plan (``S'``, ``PF'``, ``PB'``) is a
candidate, and every plan of the box with ``PF >= PF'`` and ``PB >= PB'`` has
``S >= S'``, so it is no better; what is left are the boxes ``PF < PF'`` and
``PF >= PF', PB < PB'``, each with lower bound ``S' + (M - 1) (a1 + a2)``. Lower
corners are raised by the ratio of backward to forward time (a block's ``B / F`` lies
between the least and largest per-layer ratio), which keeps the boxes near the plans
that exist. It ends when every box is empty or bounded above the incumbent: the
incumbent is optimal (the issue's "enumerate the candidate bottleneck values and solve a
min-sum programme under each cap", with the caps found rather than listed).

Memory: every stage must fit its node (position-independent charges; 1F1B with
``M > 1`` stashes by position, so the caller proves it only when memory cannot bind).
"""

from __future__ import annotations

import heapq
import math
import time

import numpy as np

from sky_flower.core.cost import CostModel, Stage
from sky_flower.core.partition.plan import _kinds

CHAIN_DP_WORK_LIMIT = 400_000_000  # states x classes x kinds x (L + 1)^2, per DP pass


def _band(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A block matrix ``[p, e]`` as its finite band: ``diag[d, e] = block[e - d - 1, e]``
    (``inf`` where ``e - d - 1 < 0``) and the ``p`` index of each entry, for
    ``d < W``, ``W`` the longest block with a finite value."""
    n = block.shape[0]
    p, e = np.nonzero(np.isfinite(block))
    width = int((e - p).max()) if len(p) else 0
    d = np.arange(width)[:, None]
    ee = np.arange(n)[None, :]
    pidx = ee - d - 1
    ok = pidx >= 0
    diag = np.where(ok, block[np.maximum(pidx, 0), ee], np.inf)
    return diag, np.maximum(pidx, 0)


class _ChainDP:
    """The DP over (kind counts, last link class, layer) (module docstring)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        L = cost.num_layers
        kinds = _kinds(cost)
        self.kind_ids = sorted(set(kinds) - {-1})
        self.members = [[i for i, k in enumerate(kinds) if k == t] for t in self.kind_ids]
        reps = [m[0] for m in self.members]
        link_key = [(float(cost.latency[i]), float(cost.inv_bw[i])) for i in range(cost.num_nodes)]
        classes: dict[tuple, int] = {}
        self.cls_owner = classes.setdefault(link_key[cost.owner], 0)
        self.cls = [classes.setdefault(link_key[r], len(classes)) for r in reps]
        self.class_rep = {c: i for i in [cost.owner, *reps] for c in [classes[link_key[i]]]}
        self.C = len(classes)
        radix = [len(m) + 1 for m in self.members]
        self.radix = radix
        self.num_states = math.prod(radix)
        self.strides = [math.prod(radix[t + 1 :]) for t in range(len(radix))]
        self.work = self.num_states * self.C * max(len(reps), 1) * (L + 1) ** 2
        self.reps = reps
        self._built = False

    def _build(self) -> None:
        """The per-kind memory masks and the class-pair links (on first use: the work
        estimate alone must stay cheap on large fleets)."""
        if self._built:
            return
        self._built = True
        cost, L, reps = self.cost, self.cost.num_layers, self.reps
        # per-kind block terms, (L+1, L+1) indexed [p, e] for the block [p, e)
        p, e = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
        self._p, self._e = p, e
        n_in = cost.inflight(0, cost.num_nodes)
        mp = cost.static_prefix + n_in * cost.schedule.microbatch_size * cost.stash_prefix
        self.fits = {i: (e > p) & (mp[e] - mp[p] <= cost.capacity[i]) for i in [cost.owner, *reps]}
        cuts = np.arange(L - 1)
        self.links = np.full((self.C, self.C, L + 1), np.inf)  # [c, c2, p]: cut before p
        for c, i in self.class_rep.items():
            for c2, i2 in self.class_rep.items():
                lk = cost.link_arrays(np.full(L - 1, i), np.full(L - 1, i2), cuts)
                self.links[c, c2, 1:L] = lk

    # --- block terms -------------------------------------------------------------------
    def block_fb(self, i: int, last: bool) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds per micro-batch of node ``i`` on ``[p, e)``."""
        cost, p, e = self.cost, self._p, self._e
        f = cost.fwd_prefix[i][e] - cost.fwd_prefix[i][p]
        b = cost.bwd_prefix[i][e] - cost.bwd_prefix[i][p]
        if cost.relay and not last:
            b = b + f
        return f, b

    def overhead(self, i: int, last: bool, first: bool, alone: bool) -> np.ndarray:
        """Per-step relay overhead of node ``i`` on ``[p, e)`` (0 on direct)."""
        cost = self.cost
        if not cost.relay:
            return np.zeros_like(self._p, dtype=float)
        state = cost.state_prefix[self._e] - cost.state_prefix[self._p]
        messages = 1.0 if last else 2.0
        t = messages * (cost.latency[i] + cost.state_rate[i] * state)
        if not alone and (first or last):
            t = t + 8.0 * cost.schedule.batch_size * cost.inv_bw[i]
        return t

    # --- the DP ------------------------------------------------------------------------
    def solve(  # noqa: PLR0913
        self,
        block: dict[tuple[int, bool], np.ndarray],
        alone: float,
        links: np.ndarray,
        semiring: str,
        deadline: float = math.inf,
    ) -> tuple[float, list[Stage] | None, bool]:
        """``(value, stages, finished)``: the best plan under the block values
        ``block[(node, is_last)]`` ((L+1, L+1), ``inf`` where not allowed), ``alone``
        (the owner as the only stage) and ``links[c, c2, p]``; ``finished`` is False
        when ``deadline`` stopped it (then the best plan so far)."""
        cost = self.cost
        L = cost.num_layers
        op = np.add if semiring == "sum" else np.maximum
        T, C, S = len(self.reps), self.C, self.num_states
        D = np.full((S, C, L + 1), np.inf)
        arg_p = np.zeros((S, C, L + 1), dtype=np.int32)
        arg_c = np.zeros((S, C, L + 1), dtype=np.int16)
        arg_t = np.zeros((S, C, L + 1), dtype=np.int16)
        D[0, self.cls_owner] = block[(cost.owner, False)][0]
        bands = {rep: _band(block[(rep, False)]) for rep in self.reps}
        best_v, best_end = alone, None
        digits = np.indices(self.radix).reshape(T, -1).T if T else np.zeros((1, 0), dtype=int)
        level = digits.sum(axis=1)
        finished = True
        for k in range(int(level.max()) + 1 if T else 1):
            if time.perf_counter() > deadline:
                finished = False
                break
            idx = np.flatnonzero(level == k)
            for t in range(T):
                rows = idx[digits[idx, t] < self.radix[t] - 1]
                if len(rows) == 0:
                    continue
                c2 = self.cls[t]
                rep = self.reps[t]
                nxt = rows + self.strides[t]
                for c in range(C):
                    prev = D[rows, c]  # (n, L+1) over p
                    if not np.isfinite(prev).any():
                        continue
                    a = op(prev, links[c, c2][None, :])
                    diag, pidx = bands[rep]
                    if len(diag) == 0:
                        continue
                    cand = op(a[:, pidx], diag[None])  # (n, d, e): from p = e - d - 1
                    dbest = cand.argmin(axis=1)
                    v = np.take_along_axis(cand, dbest[:, None, :], axis=1)[:, 0]
                    pbest = np.arange(L + 1)[None, :] - dbest - 1
                    cur = D[nxt, c2]
                    better = v < cur
                    if better.any():
                        D[nxt, c2] = np.where(better, v, cur)
                        arg_p[nxt, c2] = np.where(better, pbest, arg_p[nxt, c2])
                        arg_c[nxt, c2] = np.where(better, c, arg_c[nxt, c2])
                        arg_t[nxt, c2] = np.where(better, t, arg_t[nxt, c2])
                    fin = op(a, block[(rep, True)][:, L][None, :])  # last stage [p, L)
                    j = np.unravel_index(int(np.argmin(fin)), fin.shape)
                    if fin[j] < best_v:
                        best_v, best_end = float(fin[j]), (int(rows[j[0]]), c, int(j[1]), t)
        if best_end is None:
            if math.isfinite(alone):
                return alone, [(cost.owner, 0, L - 1)], finished
            return math.inf, None, finished
        return best_v, self._stages(best_end, arg_p, arg_c, arg_t), finished

    def _stages(self, end: tuple, arg_p: np.ndarray, arg_c: np.ndarray, arg_t: np.ndarray):  # noqa: ANN202
        """Stages from the final pass's ``(state, class, cut, kind)`` and the arg tables."""
        L = self.cost.num_layers
        s, c, p, t = end
        kinds_rev = [(t, p, L)]  # (kind, first, end)
        e = p
        while s != 0:
            t_prev, p_prev, c_prev = int(arg_t[s, c, e]), int(arg_p[s, c, e]), int(arg_c[s, c, e])
            kinds_rev.append((t_prev, p_prev, e))
            s, c, e = s - self.strides[t_prev], c_prev, p_prev
        pool = [list(m) for m in self.members]
        stages = [(self.cost.owner, 0, e - 1)]
        for t, a, b in reversed(kinds_rev):
            stages.append((pool[t].pop(0), a, b - 1))
        return stages

    # --- objectives --------------------------------------------------------------------
    def _blocks(self, value: object) -> dict[tuple[int, bool], np.ndarray]:
        """``value(node, last, first)`` -> block matrix, masked by memory."""
        out = {}
        for i in [self.cost.owner, *self.reps]:
            for last in (False, True):
                v = value(i, last, i == self.cost.owner and not last)  # type: ignore[operator]
                out[(i, last)] = np.where(self.fits[i], v, np.inf)
        return out

    def run(
        self, case: str, upper: float, deadline: float = math.inf
    ) -> tuple[float, list[Stage] | None, bool]:
        """The programme of ``case`` (:func:`_chain_case`): ``(value, stages, proven)``;
        ``upper``: a known plan's step (GPipe's branch and bound starts under it)."""
        if case == "throughput":
            return self.throughput(deadline)
        if case == "one_pass":
            return self.one_pass(deadline)
        return self.gpipe(upper, deadline)

    def throughput(self, deadline: float = math.inf) -> tuple[float, list[Stage] | None, bool]:
        """The least period (seconds per micro-batch)."""
        self._build()

        def value(i: int, last: bool, first: bool) -> np.ndarray:
            f, b = self.block_fb(i, last)
            return f + b

        blocks = self._blocks(value)
        L = self.cost.num_layers
        alone = float(blocks[(self.cost.owner, True)][0, L])
        return self.solve(blocks, alone, self.links, "max", deadline)

    def one_pass(self, deadline: float = math.inf) -> tuple[float, list[Stage] | None, bool]:
        """The least step when it is a sum over stages (``sequential``, or M = 1)."""
        self._build()
        M = self.cost.schedule.microbatches

        def value(i: int, last: bool, first: bool) -> np.ndarray:
            f, b = self.block_fb(i, last)
            return M * (f + b) + self.overhead(i, last, first, alone=False)

        blocks = self._blocks(value)
        owner, L = self.cost.owner, self.cost.num_layers
        f, b = self.block_fb(owner, True)
        alone_m = M * (f + b) + self.overhead(owner, True, True, alone=True)
        alone = float(np.where(self.fits[owner], alone_m, np.inf)[0, L])
        return self.solve(blocks, alone, 2.0 * M * self.links, "sum", deadline)

    def gpipe(
        self, upper: float, deadline: float = math.inf
    ) -> tuple[float, list[Stage] | None, bool]:
        """The least GPipe step (``direct``, M > 1) by branch and bound over caps on
        ``PF`` and ``PB`` (module docstring); ``upper`` is a known plan's step."""
        self._build()
        cost = self.cost
        M1 = cost.schedule.microbatches - 1
        nodes = [cost.owner, *self.reps]
        fb = {(i, last): self.block_fb(i, bool(last)) for i in nodes for last in (0, 1)}
        best_v, best_s = upper, None
        lo_f, lo_b = self._least_max(fb, 0, deadline), self._least_max(fb, 1, deadline)
        tighten = self._box_tightener()
        # boxes (lower bound, PF range, PB range, S of the enclosing box's plan)
        heap = [(0.0, lo_f, math.inf, lo_b, math.inf, 0.0)]
        while heap:
            _, a1, b1, a2, b2, s_in = heapq.heappop(heap)
            a1, a2 = tighten(a1, a2)
            if a1 > b1 or a2 > b2 or s_in + M1 * (a1 + a2) >= best_v * (1 - 1e-12):
                continue
            if time.perf_counter() > deadline:
                return best_v, best_s, False
            found = self._capped_sum(fb, b1, b2, deadline)
            if found is None:
                return best_v, best_s, False
            s_val, stages = found
            if stages is None:
                continue  # no plan under these caps
            t = cost.terms(stages)
            lk = float(t.link.max()) if len(t.link) else 0.0
            pf, pb = max(float(t.fwd.max()), lk), max(float(t.bwd.max()), lk)
            v = cost.step_time(stages)
            if v < best_v:
                best_v, best_s = v, stages
            # plans with PF >= pf and PB >= pb have S >= s_val: none beats this one
            below_f = pf * (1 - 1e-12) - 1e-300
            below_b = pb * (1 - 1e-12) - 1e-300
            if below_f >= a1:
                heapq.heappush(heap, (s_val + M1 * (a1 + a2), a1, below_f, a2, b2, s_val))
            if below_b >= a2:
                f_lo = max(a1, pf)
                heapq.heappush(heap, (s_val + M1 * (f_lo + a2), f_lo, b1, a2, below_b, s_val))
        return best_v, best_s, True

    def _box_tightener(self):  # noqa: ANN202
        """``tighten(a1, a2)``: raised lower bounds on ``PF`` and ``PB`` of plans with
        ``PF >= a1`` and ``PB >= a2``. A block's ``B / F`` lies between the least and
        the largest per-layer ratio ``r`` (a mediant), so a stage that sets
        ``PF >= a1`` has ``B >= r_min a1``, unless a link sets it (then ``PB >= a1``;
        impossible when ``a1`` exceeds every link); the same for ``PB``."""
        f, b = self.cost.fwd, self.cost.bwd
        both = (f > 0) & (b > 0)
        r = b[both] / f[both]
        r_min = 0.0 if ((b == 0) & (f > 0)).any() or not len(r) else float(r.min())
        r_max = math.inf if ((f == 0) & (b > 0)).any() or not len(r) else float(r.max())
        finite = self.links[np.isfinite(self.links)]
        l_max = float(finite.max()) if len(finite) else 0.0

        def tighten(a1: float, a2: float) -> tuple[float, float]:
            for _ in range(2):
                a2 = max(a2, a1 * r_min if a1 > l_max else min(a1 * r_min, a1))
                a1 = max(a1, a2 / r_max if a2 > l_max else min(a2 / r_max, a2))
            return a1, a2

        return tighten

    def _capped_sum(self, fb: dict, cf: float, cb: float, deadline: float) -> tuple | None:
        """``(S, stages)``: the least ``S = sum (F + B) + 2 sum links`` over plans with
        every ``F <= cf``, ``B <= cb`` and link ``<= min(cf, cb)`` (stages None if
        none); None when ``deadline`` stopped it."""

        def value(i: int, last: bool, first: bool) -> np.ndarray:
            f, b = fb[(i, int(last))]
            return np.where((f <= cf) & (b <= cb), f + b, np.inf)

        blocks = self._blocks(value)
        links = np.where(self.links <= min(cf, cb), 2.0 * self.links, np.inf)
        alone = float(blocks[(self.cost.owner, True)][0, self.cost.num_layers])
        s_val, stages, ok = self.solve(blocks, alone, links, "sum", deadline)
        return (s_val, stages) if ok else None

    def _least_max(self, fb: dict, which: int, deadline: float) -> float:
        """The least ``max(F_k, links)`` (``which`` 0) or ``max(B_k, links)`` (1) over
        every plan (seconds; a lower bound on ``PF`` or ``PB``; 0 if stopped)."""

        def value(i: int, last: bool, first: bool) -> np.ndarray:
            return fb[(i, int(last))][which]

        blocks = self._blocks(value)
        alone = float(blocks[(self.cost.owner, True)][0, self.cost.num_layers])
        v, _, done = self.solve(blocks, alone, self.links, "max", deadline)
        return v if done and math.isfinite(v) else 0.0


def _chain_case(cost: CostModel, objective: str) -> str | None:
    """Which exact :class:`_ChainDP` programme models this objective, or None."""
    sched = cost.schedule
    M = sched.microbatches
    stash_binds = bool((cost.capacity < cost.stage_memory(0, cost.num_layers - 1, M)).any())
    if sched.kind == "1f1b" and M > 1 and not cost.relay and stash_binds:
        return None  # 1F1B stashes by position: the programme charges N stages
    if objective == "throughput":
        return "throughput"
    if sched.kind == "sequential" or (M == 1 and not cost.relay):
        return "one_pass"
    if sched.kind == "gpipe" and not cost.relay:
        return "gpipe"
    return None
