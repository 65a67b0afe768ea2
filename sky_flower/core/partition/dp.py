"""Exact dynamic programmes over node kinds, for one link between every pair of nodes.

Identical nodes are interchangeable, so the state is *how many* nodes of each kind are
in use (``prod_t (n_t + 1)`` states), not which ones.

* :class:`_PeriodDP` (``throughput``): for a cap ``T`` on every stage and link, the
  furthest layer each state reaches (a bottleneck/feasibility DP in the style of
  chain-partitioning by probing, descending from the heuristic's period);
* :class:`_SumDP` (one-pass ``step``: ``sequential`` or M = 1, ``direct``): a min-plus
  DP over (state, layers covered), the step being a sum over stages.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from sky_flower.core.cost import CostModel, Stage
from sky_flower.core.partition.plan import _kinds

DP_STATE_LIMIT = 5_000_000  # node-kind count vectors for the exact throughput programme
SUM_DP_WORK_LIMIT = 3_000_000_000  # states x kinds x (L + 1)^2 for the one-pass programme


def backtrack(
    state: int, reach: np.ndarray, via: np.ndarray, strides: list[int]
) -> list[tuple[int, int, int]]:
    """The path of a level-wise programme over kind counts from the empty state to
    ``state``: one ``(kind position, first layer, end)`` per appended node, in pipeline
    order (``reach``: layers covered per state; ``via``: the kind last appended)."""
    steps = []
    while state != 0:
        t = int(via[state])
        prev = state - strides[t]
        steps.append((t, int(reach[prev]), int(reach[state])))
        state = prev
    return steps[::-1]


def sweep_levels(  # noqa: PLR0913
    levels: Sequence[np.ndarray],
    digits: np.ndarray,
    strides: list[int],
    e0: int,
    num_layers: int,
    extend: Callable[[int, int, np.ndarray], np.ndarray],
    deadline: float = math.inf,
) -> list[tuple[int, int, int]] | None | str:
    """The level-wise furthest-reach programme over kind counts both DPs run: state
    ``s`` uses ``digits[s, t]`` nodes of kind ``t``, ``levels[k]`` the states with ``k``
    after the owner's ``[0, e0)``; ``extend(t, k, p)`` the ends of a node of kind ``t``
    appended ``k``-th after ``p`` layers (-1: none). Returns the path (:func:`backtrack`)
    to the first state reaching ``num_layers``, None, or ``"timeout"`` past ``deadline``."""
    num_states = len(digits)
    reach = np.full(num_states, -1, dtype=np.int64)
    via = np.full(num_states, -1, dtype=np.int64)
    reach[0] = e0
    for k in range(1, len(levels)):
        if time.perf_counter() > deadline:
            return "timeout"
        idx = levels[k]
        best = np.full(len(idx), -1, dtype=np.int64)
        best_t = np.full(len(idx), -1, dtype=np.int64)
        for t in range(len(strides)):
            rows = np.flatnonzero(digits[idx, t] > 0)
            p = reach[idx[rows] - strides[t]]
            live = p >= 0
            if not live.any():
                continue
            rows, p = rows[live], p[live]
            e = extend(t, k, p)
            better = e > best[rows]
            best[rows[better]] = e[better]
            best_t[rows[better]] = t
        reach[idx] = best
        via[idx] = best_t
        done = np.flatnonzero(best == num_layers)
        if len(done):
            return backtrack(int(idx[done[0]]), reach, via, strides)
    return None


class _OverKinds:
    """What both programmes share: the node kinds, their members, and the states (how
    many nodes of each kind are in use)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        kinds = _kinds(cost)
        self.kind_ids = sorted(set(kinds) - {-1})
        self.members = {t: [i for i, k in enumerate(kinds) if k == t] for t in self.kind_ids}
        self.counts = [len(self.members[t]) for t in self.kind_ids]
        self.num_states = math.prod(n + 1 for n in self.counts)

    def _stages(self, owner_end: int, steps: Iterable[tuple[int, int, int]]) -> list[Stage]:
        """Stages from the owner's block ``[0, owner_end)`` and, in pipeline order, one
        ``(kind position, first layer, end)`` per appended node; nodes of a kind are
        taken in index order."""
        pool = {t: list(self.members[tid]) for t, tid in enumerate(self.kind_ids)}
        stages = [(self.cost.owner, 0, owner_end - 1)]
        for t, p, e in steps:
            stages.append((pool[t].pop(0), p, e - 1))
        return stages


class _PeriodDP(_OverKinds):
    """Exact minimum period (``throughput``) when every pair of nodes has the same link.

    For a cap ``T`` on every stage's ``F + B`` and every link, a dynamic programme over
    how many nodes of each kind are in use (not which: identical nodes are
    interchangeable) keeps the furthest layer the pipeline can reach. Reaching further
    is never worse: the rest of the model from a later layer is a suffix, and every
    block of a plan for the longer suffix shrinks (less compute, less memory, the same
    cut positions). So each node, appended as the next stage, takes the longest block
    that fits ``T``, its memory, and ends at a cut whose link fits ``T``. ``T`` is
    feasible iff some state reaches the last layer. States: ``prod_t (n_t + 1)``.
    :meth:`solve` descends from the heuristic's period; the run that finds nothing
    faster proves the best plan optimal.
    """

    def __init__(self, cost: CostModel) -> None:
        super().__init__(cost)
        self._levels: list[np.ndarray] | None = None
        L, N = cost.num_layers, cost.num_nodes
        r = 2.0 if cost.relay else 1.0
        zero = np.zeros((N, 1))
        self.tp = np.concatenate([zero, np.cumsum(r * cost.fwd + cost.bwd, 1)], 1)
        self.tp_last = np.concatenate([zero, np.cumsum(cost.fwd + cost.bwd, 1)], 1)
        self.mem = {}
        for k in range(N):
            n = cost.inflight(k, N)
            if n not in self.mem:
                self.mem[n] = cost.static_prefix + n * cost.schedule.microbatch_size * (
                    cost.stash_prefix
                )
        i0 = cost.owner
        j = min(1, N - 1)
        other = j if j != i0 else 0
        cuts = np.arange(L - 1)
        self.links = cost.link_arrays(
            np.full(L - 1, i0), np.full(L - 1, other), cuts
        )  # the same for every pair

    def _extend(self, node: int, p: int, k: int, T: float, ok_prev: np.ndarray) -> int:
        cost = self.cost
        L = cost.num_layers
        tp = self.tp[node]
        e = int(np.searchsorted(tp, tp[p] + T, side="right")) - 1
        mp = self.mem[cost.inflight(k, cost.num_nodes)]
        e = min(e, int(np.searchsorted(mp, mp[p] + cost.capacity[node], side="right")) - 1, L)
        if e < L and cost.relay:  # as the last stage it does not recompute
            tl = self.tp_last[node]
            if tl[L] - tl[p] <= T and mp[L] - mp[p] <= cost.capacity[node]:
                e = L
        if e < L:
            e = int(ok_prev[e])  # the furthest cut <= e whose link fits T
        return e

    def _extend_many(self, t: int, p: np.ndarray, k: int, T: float, ok_prev: np.ndarray):  # noqa: ANN202
        """Vectorised :meth:`_extend` for a node of kind ``t`` at slot ``k``."""
        cost = self.cost
        L = cost.num_layers
        node = self.members[self.kind_ids[t]][0]
        tp = self.tp[node]
        e = np.searchsorted(tp, tp[p] + T, side="right") - 1
        mp = self.mem[cost.inflight(k, cost.num_nodes)]
        e = np.minimum(e, np.searchsorted(mp, mp[p] + cost.capacity[node], side="right") - 1)
        if cost.relay:  # as the last stage it does not recompute
            tl = self.tp_last[node]
            last_ok = (tl[L] - tl[p] <= T) & (mp[L] - mp[p] <= cost.capacity[node])
            e = np.where(last_ok, L, e)
        e = np.minimum(e, L)
        return np.where(e < L, ok_prev[e], e)

    def feasible(self, T: float) -> list[Stage] | None:
        """A plan with every stage and link <= ``T``, or None.

        States are processed level by level (``k`` nodes in use), vectorised over the
        states of a level.
        """
        cost = self.cost
        L = cost.num_layers
        ok = np.append(np.append([True], self.links <= T), True)  # cut at e: link e-1
        ok_prev = np.maximum.accumulate(np.where(ok, np.arange(L + 1), -1))
        e0 = self._extend(cost.owner, 0, 0, T, ok_prev)
        if e0 <= 0:
            return None
        if e0 == L:
            return [(cost.owner, 0, L - 1)]
        if self._levels is None:
            radix = [n + 1 for n in self.counts]
            self._strides = [math.prod(radix[t + 1 :]) for t in range(len(radix))]
            self._digits = np.indices(radix).reshape(len(radix), -1).T.astype(np.int16)
            level = self._digits.sum(axis=1)
            self._levels = [np.flatnonzero(level == k) for k in range(int(level.max()) + 1)]

        def extend(t: int, k: int, p: np.ndarray) -> np.ndarray:
            e = self._extend_many(t, p, k, T, ok_prev)
            return np.where(e > p, e, -1)  # a node appended covers more layers

        steps = sweep_levels(self._levels, self._digits, self._strides, e0, L, extend)
        return None if steps is None else self._stages(e0, steps)  # type: ignore[arg-type]

    def solve(self, upper: float, deadline: float) -> tuple:
        """``(stages, proven)``: the least-period plan found before ``deadline``.

        Descends from ``upper`` (the heuristic's period): each run asks for a plan
        strictly faster than the best so far; the first run that finds none proves the
        best optimal. A run that finds a plan stops early, so only the last run visits
        every state.
        """
        best = self.feasible(upper * (1 + 1e-12))
        if best is None:
            return None, False
        while time.perf_counter() < deadline:
            s = self.feasible(self.cost.period(best) * (1 - 1e-9))
            if s is None:
                return best, True
            best = s
        return best, False


class _SumDP(_OverKinds):
    """Exact minimum step for one pass (``sequential``, or any schedule with M = 1) on
    the ``direct`` transport when every pair of nodes has the same link.

    The step is then ``M (sum_k (f_k + b_k) + 2 sum links)``: a sum over stages, so a
    dynamic programme over (how many nodes of each kind are in use, layers covered)
    keeps the least cost; appending a node of kind t that takes ``[p, e)`` is a min-plus
    product with that kind's block-cost matrix (infinite where the block does not fit
    memory). Cost ``prod_t (n_t + 1) x kinds x L^2``.
    """

    def __init__(self, cost: CostModel) -> None:
        super().__init__(cost)
        L = cost.num_layers
        self.work = self.num_states * max(len(self.kind_ids), 1) * (L + 1) ** 2

    def _blocks(self, node: int, k: int) -> np.ndarray:
        """(L+1, L+1) cost of ``node`` as stage ``k`` holding ``[p, e)``; inf if not."""
        cost = self.cost
        L = cost.num_layers
        M = cost.schedule.microbatches
        c = cost.fwd_prefix[node] + cost.bwd_prefix[node]
        p, e = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
        block = c[e] - c[p]
        links = np.zeros(L + 1)
        if L > 1:
            links[1:L] = 2.0 * cost.link_arrays(
                np.full(L - 1, node), np.full(L - 1, node), np.arange(L - 1)
            )
        block = M * (block + links[e])
        n_in = cost.inflight(k, cost.num_nodes)
        mp = cost.static_prefix + n_in * cost.schedule.microbatch_size * cost.stash_prefix
        bad = (e <= p) | (mp[e] - mp[p] > cost.capacity[node])
        return np.where(bad, np.inf, block)

    def solve(self, deadline: float = math.inf) -> list[Stage] | None | str:
        """The least-step plan, None if nothing fits memory, or ``"timeout"`` when
        ``deadline`` (``time.perf_counter()``) passed first."""
        cost = self.cost
        L = cost.num_layers
        radix = [n + 1 for n in self.counts]
        strides = [math.prod(radix[t + 1 :]) for t in range(len(radix))]
        digits = np.indices(radix).reshape(len(radix), -1).T if radix else np.zeros((1, 0))
        level = digits.sum(axis=1) if radix else np.zeros(1, dtype=int)
        D = np.full((self.num_states, L + 1), np.inf)
        arg_p = np.full((self.num_states, L + 1), -1, dtype=np.int64)
        arg_t = np.full((self.num_states, L + 1), -1, dtype=np.int64)
        D[0] = self._blocks(cost.owner, 0)[0]
        reps = [self.members[t][0] for t in self.kind_ids]
        cache: dict[tuple[int, int], np.ndarray] = {}
        for k in range(1, int(level.max()) + 1 if radix else 1):
            if time.perf_counter() > deadline:
                return "timeout"
            for idx in np.flatnonzero(level == k):
                for t, dt in enumerate(digits[idx]):
                    if dt == 0:
                        continue
                    prev = idx - strides[t]
                    if not np.isfinite(D[prev]).any():
                        continue
                    key = (t, cost.inflight(k, cost.num_nodes))
                    if key not in cache:
                        cache[key] = self._blocks(reps[t], k)
                    cand = D[prev][:, None] + cache[key]
                    p_best = cand.argmin(axis=0)
                    v = cand[p_best, np.arange(L + 1)]
                    better = v < D[idx]
                    D[idx][better] = v[better]
                    arg_p[idx][better] = p_best[better]
                    arg_t[idx][better] = t
        best_idx = int(np.argmin(D[:, L]))
        if not np.isfinite(D[best_idx, L]):
            return None
        steps, idx, e = [], best_idx, L
        while idx != 0:
            t, p = int(arg_t[idx, e]), int(arg_p[idx, e])
            steps.append((t, p, e))
            idx, e = idx - strides[t], p
        return self._stages(e, reversed(steps))
