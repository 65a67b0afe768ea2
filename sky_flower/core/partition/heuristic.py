"""``heuristic``: SkyComputing's two stages made fast and order-aware.

After Zhu, Li, You, *Sky Computing* (arXiv 2202.11836, Sec. 3.3): a speed-proportional
pre-allocation, then a greedy allocation under a per-stage time cap. For a cap ``T``
on a stage's time per micro-batch, nodes fill greedily in an order (data owner first,
then fastest first; also configured order and largest memory first): each takes the
longest block that fits ``T`` and its memory (binary search on prefix sums; a node that
fits nothing stays idle). A bisection finds the least feasible ``T`` (the throughput
plan); for the step objective a grid of larger ``T`` (fewer, fuller stages) is scored
too. The best candidates, ``even`` and the speed-proportional start are then polished
by moving boundary layers in both directions while the objective improves. O(N log L)
per fill.

Two more sources of candidates: the exact memory check's witness
(:func:`~sky_flower.core.partition.feasible.check_memory`; always when it is cheap, and
before any refusal, so a plan that fits is never refused), and on small instances, where
greedy fills can be far off (unequal nodes, per-pair links, binding memory), exact search
(:func:`_small_exact`: every plan up to ``HEURISTIC_ENUMERATION_LIMIT``, else the chain
DP of :mod:`.chain` when its work is small), bounded by work (``SMALL_EXACT_S`` seconds
only as a guard).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from sky_flower.core.cost import CostModel, Stage
from sky_flower.core.partition.chain import _chain_case, _ChainDP
from sky_flower.core.partition.enumeration import (
    HEURISTIC_ENUMERATION_LIMIT,
    _count_plans,
    _enumerate,
)
from sky_flower.core.partition.feasible import _KindDP, _pipeline_lengths, check_memory
from sky_flower.core.partition.plan import (
    InfeasibleMemoryError,
    Plan,
    _check_objective,
    _configured_order,
    _counts_to_stages,
    _even_stages,
    _infeasible_message,
    make_plan,
)


class _Filler:
    """Greedy fills under a per-stage time cap ``T`` (seconds per micro-batch)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        r = 2.0 if cost.relay else 1.0  # relay: assume recomputation (not the last stage)
        c = r * cost.fwd + cost.bwd
        self.time_prefix = np.concatenate([np.zeros((cost.num_nodes, 1)), np.cumsum(c, 1)], 1)
        self._mem: dict[int, np.ndarray] = {}

    def mem_prefix(self, inflight: int) -> np.ndarray:
        if inflight not in self._mem:
            cost = self.cost
            mb = cost.schedule.microbatch_size
            self._mem[inflight] = cost.static_prefix + inflight * mb * cost.stash_prefix
        return self._mem[inflight]

    def fill(
        self,
        order: Sequence[int],
        T: float,
        owner_max: int | None = None,
        num_stages: int | None = None,
    ) -> list | None:
        """Stages of the greedy fill, or None if layers are left over.

        Memory charges stage ``k`` the micro-batches it keeps in flight in a pipeline of
        ``len(order)`` stages (at least as many as any plan from this order has), or of
        exactly ``num_stages`` stages when given (then at most that many are filled).
        """
        cost = self.cost
        L, n = cost.num_layers, len(order)
        a, stages = 0, []
        for pos, i in enumerate(order):
            if a >= L:
                break
            if num_stages is not None and len(stages) == num_stages:
                return None
            tp = self.time_prefix[i]
            end_t = int(np.searchsorted(tp, tp[a] + T * (1 + 1e-12), side="right")) - 1
            if num_stages is None:
                mp = self.mem_prefix(cost.inflight(pos, n))
            else:
                mp = self.mem_prefix(cost.inflight(len(stages), num_stages))
            end_m = int(np.searchsorted(mp, mp[a] + cost.capacity[i], side="right")) - 1
            end = min(end_t, end_m, L)
            if pos == 0 and owner_max is not None:
                end = min(end, a + owner_max)
            if end <= a:
                if pos == 0:
                    return None  # the data owner must run stage 0
                continue  # idle
            stages.append((int(i), a, end - 1))
            a = end
        return stages if a == L else None

    def least_cap(self, order: Sequence[int], owner_max: int | None = None) -> tuple:
        """Bisection for the least ``T`` whose fill succeeds: ``(T, stages)`` or None."""
        stages = self.fill(order, math.inf, owner_max)
        if stages is None:
            return None
        lo = self.cost.period_lower_bound() * (1 - 1e-9)
        hi = max(self.time_prefix[i, b + 1] - self.time_prefix[i, a] for i, a, b in stages)
        best = stages
        for _ in range(60):
            if hi - lo <= 1e-7 * hi:
                break
            mid = 0.5 * (lo + hi)
            s = self.fill(order, mid, owner_max)
            if s is None:
                lo = mid
            else:
                hi, best = mid, s
        return hi, best


def _cap_grid(least: float, top: float, grid: int) -> np.ndarray:
    """Caps from ``least`` to ``top`` (geometric; from ``top / grid`` when ``least`` is 0,
    as when every layer's measured time is 0), without ``least`` itself."""
    if top <= 0:
        return np.zeros(0)
    lo = least if least > 0 else top / grid
    return np.geomspace(lo, max(top, lo), grid)[1:]


def _orders(cost: CostModel) -> list[list[int]]:
    others = [i for i in range(cost.num_nodes) if i != cost.owner]
    speed = cost.fwd.sum(1) + cost.bwd.sum(1)
    by_speed = sorted(others, key=lambda i: (speed[i], i))
    by_memory = sorted(others, key=lambda i: (-cost.capacity[i], speed[i], i))
    out: list[list[int]] = []
    for o in (by_speed, others, by_memory):
        cand = [cost.owner, *o]
        if cand not in out:
            out.append(cand)
    return out


def _speed_proportional(cost: CostModel) -> list[Stage] | None:
    """SkyComputing's pre-allocation: layer work shared in proportion to node speed, in
    configured order, every node used (None if the model has fewer layers than nodes)."""
    L, N = cost.num_layers, cost.num_nodes
    if L < N:
        return None
    c = cost.fwd + cost.bwd
    speed = 1.0 / np.maximum(c.sum(axis=1), 1e-300)
    order = _configured_order(cost)
    share = np.cumsum(speed[order] / speed.sum())
    work = c.mean(axis=0)
    cum = np.cumsum(work) / max(work.sum(), 1e-300)
    counts, start = [], 0
    for k in range(N):
        if k == N - 1:
            end = L
        else:
            end = int(np.searchsorted(cum, share[k] - 1e-12)) + 1
            end = min(max(end, start + 1), L - (N - 1 - k))
        counts.append(end - start)
        start = end
    return _counts_to_stages(order, counts)


def _excl_max(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``max(x[j] for j not in lo..hi)`` for each pair (``-inf`` if none)."""
    n = len(x)
    pre = np.concatenate([[-np.inf], np.maximum.accumulate(x)]) if n else np.array([-np.inf])
    suf = np.concatenate([np.maximum.accumulate(x[::-1])[::-1], [-np.inf]])
    return np.maximum(pre[lo], suf[np.minimum(hi + 1, n)])


class _Polisher:
    """A plan's stages as arrays, with the terms :func:`_polish` scores moves by."""

    def __init__(self, cost: CostModel, st: np.ndarray, objective: str) -> None:
        self.cost, self.objective = cost, objective
        self.node, self.a, self.b = st[:, 0].copy(), st[:, 1].copy(), st[:, 2].copy()
        S = len(self.node)
        self.M = cost.schedule.microbatches
        self.seq = cost.schedule.kind == "sequential"
        self.inflight = np.array([cost.inflight(k, S) for k in range(S)])
        self.cap = cost.capacity[self.node]
        self.ks = np.arange(S - 1)
        self.is_last = np.zeros(S, dtype=bool)
        self.is_last[-1] = True
        self.f, self.bw, self.over = self.stage_terms(np.arange(S), self.a, self.b)
        self.link = cost.link_arrays(self.node[:-1], self.node[1:], self.b[:-1])

    def stage_terms(self, k: np.ndarray, aa: np.ndarray, bb: np.ndarray) -> tuple:
        """Forward, backward and relay overhead of stages ``k`` holding ``aa..bb``."""
        cost = self.cost
        i = self.node[k]
        f = cost.fwd_prefix[i, bb + 1] - cost.fwd_prefix[i, aa]
        bw = cost.bwd_prefix[i, bb + 1] - cost.bwd_prefix[i, aa]
        if cost.relay:
            bw = bw + np.where(self.is_last[k], 0.0, f)
            msgs = np.where(self.is_last[k], 1.0, 2.0)
            state = cost.state_prefix[bb + 1] - cost.state_prefix[aa]
            over = msgs * (cost.latency[i] + cost.state_rate[i] * state)
        else:
            over = np.zeros(len(k))
        return f, bw, over

    def value(self) -> float:
        """The objective (closed form) of the current stages."""
        f, bw, link, over, M = self.f, self.bw, self.link, self.over, self.M
        c = f + bw
        if self.objective == "throughput":
            return max(c.max(), link.max())
        if self.seq:
            return M * (c.sum() + 2 * link.sum()) + over.sum()
        return (
            c.sum()
            + 2 * link.sum()
            + over.sum()
            + (M - 1) * (max(f.max(), link.max()) + max(bw.max(), link.max()))
        )

    def best_move(self, delta: int) -> tuple | None:
        """The best move of every boundary by ``delta`` layers that fits memory:
        ``((value, sum of squared stage times), boundary, delta)``, or None."""
        cost, a, b, node = self.cost, self.a, self.b, self.node
        f, bw, over, link, M = self.f, self.bw, self.over, self.link, self.M
        c = f + bw
        nb, na1 = b[:-1] + delta, a[1:] + delta
        ok = (nb >= a[:-1]) & (na1 <= b[1:])
        k = self.ks[ok]
        if len(k) == 0:
            return None
        k1 = k + 1
        f0, b0, o0 = self.stage_terms(k, a[k], nb[ok])
        f1, b1, o1 = self.stage_terms(k1, na1[ok], b[k1])
        mem0 = cost.memory_arrays(a[k], nb[ok], self.inflight[k])
        mem1 = cost.memory_arrays(na1[ok], b[k1], self.inflight[k1])
        fits = (mem0 <= self.cap[k]) & (mem1 <= self.cap[k1])
        if not fits.any():
            return None
        k, k1 = k[fits], k1[fits]
        f0, b0, o0, f1, b1, o1 = (v[fits] for v in (f0, b0, o0, f1, b1, o1))
        lk = cost.link_arrays(node[k], node[k1], b[k] + delta)
        c0, c1 = f0 + b0, f1 + b1
        csum = c.sum() - c[k] - c[k1] + c0 + c1
        lsum = link.sum() - link[k] + lk
        osum = over.sum() - over[k] - over[k1] + o0 + o1
        l_max = np.maximum(_excl_max(link, k, k), lk)
        if self.objective == "throughput":
            v = np.maximum(np.maximum(_excl_max(c, k, k1), np.maximum(c0, c1)), l_max)
        elif self.seq:
            v = M * (csum + 2 * lsum) + osum
        else:
            fm = np.maximum(_excl_max(f, k, k1), np.maximum(f0, f1))
            bm = np.maximum(_excl_max(bw, k, k1), np.maximum(b0, b1))
            v = csum + 2 * lsum + osum
            v = v + (M - 1) * (np.maximum(fm, l_max) + np.maximum(bm, l_max))
        sq = (c * c).sum() - c[k] ** 2 - c[k1] ** 2 + c0**2 + c1**2
        v = np.round(v, 12)
        j = int(np.lexsort((sq, v))[0])
        return ((float(v[j]), float(sq[j])), int(k[j]), delta)

    def move(self, k: int, delta: int) -> None:
        """Move the boundary after stage ``k`` by ``delta`` layers."""
        self.b[k] += delta
        self.a[k + 1] += delta
        kk = np.array([k, k + 1])
        self.f[kk], self.bw[kk], self.over[kk] = self.stage_terms(kk, self.a[kk], self.b[kk])
        self.link[k] = self.cost.link_arrays(
            self.node[k : k + 1], self.node[k + 1 : k + 2], self.b[k : k + 1]
        )[0]


def _polish(
    cost: CostModel, stages: list[Stage], objective: str, max_moves: int = 5000
) -> list[Stage]:
    """Move one boundary layer at a time, either way, while the objective improves.

    All ``2 (S - 1)`` moves are scored at once (vectorised, O(S) per round); the best
    improving move is made (ties broken by the sum of squared stage times, so stages
    even out). For ``1f1b`` the GPipe closed form stands in for the objective.
    """
    st = np.asarray(stages, dtype=int).reshape(-1, 3)
    if len(st) < 2:
        return [tuple(int(v) for v in r) for r in st]
    p = _Polisher(cost, st, objective)
    best = (float(p.value()), float(((p.f + p.bw) ** 2).sum()))
    for _ in range(max_moves):
        top = None
        for delta in (-1, 1):
            cand = p.best_move(delta)
            if cand is not None and (top is None or cand < top):
                top = cand
        if top is None or top[0] >= best:
            break
        best, k, delta = top
        p.move(k, delta)
    return [(int(i), int(x), int(y)) for i, x, y in zip(p.node, p.a, p.b, strict=True)]


CHEAP_CHECK_STATES = 4096  # the exact memory check always runs up to this many states
CHEAP_CHECK_NODES = 64  # ... on fleets up to this size (levels cost time on larger ones)


def seed_feasibility(
    cost: CostModel, consider: Callable[[list[Stage]], None], found: bool, time_limit_s: float
) -> None:
    """Run the exact memory check when it is cheap or nothing was found; its witness
    goes to ``consider``.

    Raises
    ------
    InfeasibleMemoryError
        If nothing was found and the check proves infeasibility or cannot decide (the
        message names the check).
    """
    if found and (
        cost.num_nodes > CHEAP_CHECK_NODES
        or _KindDP(cost).num_states * len(_pipeline_lengths(cost)) > CHEAP_CHECK_STATES
    ):
        return
    res = check_memory(cost, time_limit_s)
    if res.feasible:
        consider(res.stages)
        return
    if found:
        return
    if res.status == "infeasible":
        raise InfeasibleMemoryError(f"{_infeasible_message(cost)} (proven by {res.method})")
    raise InfeasibleMemoryError(
        f"no plan found that fits memory, and {res.method}: feasibility unknown, not proven "
        f"infeasible. {_infeasible_message(cost)}"
    )


# the exact small-instance search is bounded by work (HEURISTIC_ENUMERATION_LIMIT plans,
# HEURISTIC_CHAIN_WORK DP cells: at most about 0.5 s on one 2-core VM's core); this clock
# is only a guard for a far slower machine, so the plan does not depend on machine load
SMALL_EXACT_S = 5.0
HEURISTIC_CHAIN_WORK = 3_000_000  # the heuristic runs the chain DP up to this work


def _small_exact(
    cost: CostModel, objective: str, upper: float, deadline: float
) -> list[list[Stage]]:
    """Exact candidates on small instances, where greedy fills can be far off (unequal
    nodes, per-pair links, binding memory): every plan when there are at most
    ``HEURISTIC_ENUMERATION_LIMIT``, else the chain DP of :mod:`.chain` when its work is
    small (for schedules it does not model, its least-period plan as a stand-in)."""
    if _count_plans(cost.num_nodes, cost.num_layers) <= HEURISTIC_ENUMERATION_LIMIT:
        best, _ = _enumerate(cost, objective, deadline)
        return [best] if best is not None else []
    dp = _ChainDP(cost)
    if dp.work > HEURISTIC_CHAIN_WORK:
        return []
    _, stages, _ = dp.run(_chain_case(cost, objective) or "throughput", upper, deadline)
    return [stages] if stages is not None else []


def heuristic(
    cost: CostModel,
    objective: str = "step",
    grid: int = 16,
    time_limit_s: float = 10.0,
    small_exact: bool = True,
) -> Plan:
    """Fast order-aware greedy with bisection on the stage-time cap, then polishing.

    See the module docstring. Never worse than :func:`even` when ``even`` fits (it is
    one of the polished candidates).

    Parameters
    ----------
    cost : CostModel
    objective : {"step", "throughput"}
    grid : int
        Caps scored between the least feasible one and one stage per node (``step``).
    small_exact : bool
        Add :func:`_small_exact`'s candidates (off: greedy fills and polishing alone).
    time_limit_s : float
        Budget (seconds) of the exact memory check
        (:func:`~sky_flower.core.partition.feasible.check_memory`), whose witness seeds
        the candidates; it runs whenever it is cheap, and always before a refusal.

    Raises
    ------
    InfeasibleMemoryError
        If the exact check proves that no assignment fits memory, or cannot decide in
        ``time_limit_s`` while the greedy fills found nothing (the message says which).
    """
    _check_objective(objective)
    t0 = time.perf_counter()
    filler = _Filler(cost)
    cands: list[list[Stage]] = []
    score = {}

    def consider(s: list[Stage] | None) -> None:
        if s is not None and cost.fits(s):
            cands.append(s)
            score[len(cands) - 1] = cost.objective(s, objective)

    for order in _orders(cost):
        for owner_max in (None, 1) if objective == "step" else (None,):
            found = filler.least_cap(order, owner_max)
            if found is None:
                continue
            T, stages = found
            consider(stages)
            if objective == "step" and cost.num_nodes > 1:
                one = filler.fill(order, math.inf, owner_max)
                top = max(
                    filler.time_prefix[i, b + 1] - filler.time_prefix[i, a] for i, a, b in one
                )
                for T2 in _cap_grid(T, top, grid):
                    consider(filler.fill(order, float(T2), owner_max))
    if cost.num_layers >= cost.num_nodes:
        consider(_even_stages(cost))
        consider(_speed_proportional(cost))
    if not cands and cost.schedule.kind == "1f1b" and not cost.relay:
        # 1F1B stashes fewer micro-batches in shorter pipelines: a fill charged for every
        # node may miss a plan that fits with fewer stages
        for order in _orders(cost):
            for S in range(1, min(cost.num_nodes, cost.num_layers) + 1):
                consider(filler.fill(order, math.inf, num_stages=S))
    seed_feasibility(cost, consider, bool(cands), time_limit_s)
    if small_exact:
        deadline = t0 + min(time_limit_s, SMALL_EXACT_S)
        for stages in _small_exact(cost, objective, min(score.values()), deadline):
            consider(stages)
    ranked = sorted(score, key=score.get)
    # unpolished too: for 1F1B polishing scores GPipe's closed form, a stand-in
    polished = [cands[r] for r in ranked[:2]]
    polished += [_polish(cost, cands[r], objective) for r in ranked[:2]]
    if cost.num_layers >= cost.num_nodes:
        ev = _even_stages(cost)
        if cost.fits(ev):
            polished += [ev, _polish(cost, ev, objective)]
    best = min(polished, key=lambda s: cost.objective(s, objective))
    return make_plan(cost, "heuristic", best, time.perf_counter() - t0, objective=objective)
