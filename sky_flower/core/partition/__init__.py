"""Load-balanced layer partitioner: ``even``, ``heuristic``, ``optimal`` (pure, no Flower).

Layer profiles + node profiles + schedule in (a :class:`~sky_flower.core.cost.CostModel`), a
:class:`Plan` out. A plan is a list of stages ``(node, first, last)``: the data owner
runs stage 0, the planner chooses the order of the other nodes, and a node may be left
idle when the pipeline is faster without it (the plan lists idle nodes). Every method is
scored by the same cost model, for one of two objectives:

* ``step``: :meth:`CostModel.step_time`, the time of one step of the schedule that runs
  (``sequential``, ``gpipe`` or ``1f1b`` with ``M`` micro-batches, transfers included);
* ``throughput``: :meth:`CostModel.period`, the slowest resource's time per
  micro-batch, which sets a full pipeline's throughput.

Methods:

* ``even``: equal layer counts over every node in configured order (the first
  ``L mod N`` take one more): SkyComputing's baseline.
* ``heuristic``: SkyComputing's two stages (Zhu, Li, You, arXiv 2202.11836, Sec. 3.3)
  made fast and order-aware. For a cap ``T`` on a stage's time per micro-batch, nodes
  fill greedily in an order (data owner first, then fastest first; also configured
  order and largest memory first): each takes the longest block that fits ``T`` and its
  memory (binary search on prefix sums; a node that fits nothing stays idle). A
  bisection finds the least feasible ``T`` (the throughput plan); for the step objective
  a grid of larger ``T`` (fewer, fuller stages) is scored too. The best candidate, and
  ``even`` and SkyComputing's speed-proportional start, are then polished by moving
  boundary layers in both directions while the objective improves. O(N log L) per fill.
* ``optimal``: exact. Small instances are enumerated (every order, idle set and cut).
  With one link for every pair of nodes, two dynamic programmes over how many nodes of
  each kind are in use (identical nodes are interchangeable) prove the optimum:
  :class:`_PeriodDP` for ``throughput``, :class:`_SumDP` for a one-pass step
  (``sequential`` or M = 1, ``direct``). Otherwise a MILP solved by HiGHS
  (:func:`scipy.optimize.milp`) over pipeline *slots* and node *kinds* (nodes with
  identical profiles are interchangeable, so the model chooses how many of each kind
  and where, not which one; this removes the symmetry that stalls node-indexed
  models): binary ``y[k, j]`` = layer j in slots ``<= k``,
  binary ``z[k, t]`` = slot k runs a node of kind t, continuous ``x[k, j, t]`` = layer j
  in slot k of kind t. The MILP needs the ``direct`` transport and links that are the
  same for every node pair (otherwise the heuristic's plan is returned, with a note).

Every plan carries a lower bound (:meth:`CostModel.lower_bound`: total work over total
speed, and one micro-batch's critical path; for ``optimal`` also HiGHS's dual bound).

Example
-------
>>> plan = partition(cost_model, "heuristic")   # doctest: +SKIP
>>> print(plan.table())                          # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from sky_flower.core.cost import CostModel, Stage

METHODS = ("even", "heuristic", "optimal")
OBJECTIVES = ("step", "throughput")
MIB = 1024 * 1024
ENUMERATION_LIMIT = 20_000  # plans; above this ``optimal`` solves the MILP
DP_STATE_LIMIT = 5_000_000  # node-kind count vectors for the exact throughput programme
MILP_VARIABLE_LIMIT = 60_000  # slot x layer x kind variables
SUM_DP_WORK_LIMIT = 3_000_000_000  # states x kinds x (L + 1)^2 for the one-pass programme


class InfeasibleMemoryError(ValueError):
    """No assignment of the layers fits the nodes' memory (message says which layers)."""


@dataclass(frozen=True)
class StagePlan:
    """One stage of a plan: a node and the contiguous block of layers it holds."""

    node: str
    node_index: int
    first_layer: int
    last_layer: int
    compute_s: float
    transfer_s: float
    memory_bytes: float
    memory_capacity_bytes: float

    @property
    def num_layers(self) -> int:
        """Number of layers in the stage."""
        return self.last_layer - self.first_layer + 1


@dataclass
class Plan:
    """A partition of the model over the nodes, with its predicted cost.

    Attributes
    ----------
    method : str
        ``even``, ``heuristic``, ``optimal`` (or ``brute_force`` in tests).
    stages : list of StagePlan
        In pipeline order; stage 0 is the data owner. ``compute_s`` is forward +
        backward seconds per micro-batch; ``transfer_s`` the outgoing link's seconds per
        micro-batch plus the stage's per-step overhead.
    predicted_step_time_s : float
        :meth:`CostModel.step_time` of this plan (seconds per step).
    lower_bound_s : float
        A lower bound on the plan's objective over all valid plans (seconds per step for
        ``step``, per micro-batch for ``throughput``).
    solve_time_s : float
        Wall time the method took (seconds).
    proven_optimal : bool
        True only when ``optimal`` proved optimality (enumeration or MILP).
    mip_gap : float or None
        Relative gap reported by HiGHS (``optimal`` by MILP only).
    note : str
        What happened (fallbacks, time limits).
    period_s : float
        :meth:`CostModel.period`: steady-state seconds per micro-batch.
    objective : str
        ``step`` or ``throughput``.
    idle_nodes : list of str
        Nodes that hold no stage.
    """

    method: str
    stages: list[StagePlan]
    predicted_step_time_s: float
    lower_bound_s: float
    solve_time_s: float
    proven_optimal: bool = False
    mip_gap: float | None = None
    note: str = ""
    schedule: dict = field(default_factory=dict)
    period_s: float = 0.0
    objective: str = "step"
    idle_nodes: list[str] = field(default_factory=list)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """``(first_layer, last_layer)`` per stage."""
        return [(s.first_layer, s.last_layer) for s in self.stages]

    @property
    def spec(self) -> list[Stage]:
        """``(node index, first layer, last layer)`` per stage."""
        return [(s.node_index, s.first_layer, s.last_layer) for s in self.stages]

    @property
    def objective_value_s(self) -> float:
        """The value the plan was chosen for (step time or period)."""
        return self.period_s if self.objective == "throughput" else self.predicted_step_time_s

    def to_dict(self) -> dict:
        """JSON form (``plan.json``)."""
        return {
            "method": self.method,
            "objective": self.objective,
            "stages": [
                {
                    "node": s.node,
                    "first_layer": s.first_layer,
                    "last_layer": s.last_layer,
                    "compute_s": s.compute_s,
                    "transfer_s": s.transfer_s,
                    "memory_bytes": s.memory_bytes,
                    "memory_capacity_bytes": s.memory_capacity_bytes,
                }
                for s in self.stages
            ],
            "idle_nodes": list(self.idle_nodes),
            "predicted_step_time_s": self.predicted_step_time_s,
            "period_s": self.period_s,
            "lower_bound_s": self.lower_bound_s,
            "solve_time_s": self.solve_time_s,
            "proven_optimal": self.proven_optimal,
            "mip_gap": self.mip_gap,
            "note": self.note,
            "schedule": self.schedule,
        }

    def table(self) -> str:
        """The plan as a text table (stage, node, layers, compute s, transfer s, memory)."""
        head = (
            f"{'stage':>5}  {'node':<12} {'layers':>9}  {'compute s':>9}  "
            f"{'transfer s':>10}  {'memory MiB':>15}"
        )
        rows = [head, "-" * len(head)]
        for k, s in enumerate(self.stages):
            mem = f"{s.memory_bytes / MIB:.1f}/{s.memory_capacity_bytes / MIB:.0f}"
            rows.append(
                f"{k:>5}  {s.node:<12} {f'{s.first_layer}-{s.last_layer}':>9}  "
                f"{s.compute_s:9.4f}  {s.transfer_s:10.4f}  {mem:>15}"
            )
        gap = f", gap {self.mip_gap:.2e}" if self.mip_gap is not None else ""
        rows.append(
            f"{self.method}: predicted step {self.predicted_step_time_s:.4f} s, period "
            f"{self.period_s:.4f} s/micro-batch, lower bound ({self.objective}) "
            f"{self.lower_bound_s:.4f} s, solved in {self.solve_time_s * 1e3:.1f} ms"
            f"{', proven optimal' if self.proven_optimal else ''}{gap}"
        )
        if self.idle_nodes:
            shown = ", ".join(self.idle_nodes[:12])
            more = len(self.idle_nodes) - 12
            rows.append(
                f"idle ({len(self.idle_nodes)}): {shown}"
                + (f", ... {more} more" if more > 0 else "")
            )
        if self.note:
            rows.append(f"note: {self.note}")
        return "\n".join(rows)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}: use one of {', '.join(OBJECTIVES)}")


def make_plan(
    cost: CostModel,
    method: str,
    stages: Sequence[Sequence[int]],
    solve_time_s: float,
    lower_bound_s: float | None = None,
    objective: str = "step",
    **extra: object,
) -> Plan:
    """Build a :class:`Plan` for ``stages`` (triples, or pairs = configured order)."""
    spec = cost.as_stages(stages)
    cost.check_stages(spec)
    t = cost.terms(spec)
    S = len(spec)
    link_out = np.concatenate([t.link, [0.0]])
    mems = cost.stage_memories(spec)
    plans = [
        StagePlan(
            node=cost.nodes[i].name,
            node_index=i,
            first_layer=a,
            last_layer=b,
            compute_s=float(t.fwd[k] + t.bwd[k]),
            transfer_s=float(link_out[k] + t.overhead[k]),
            memory_bytes=mems[k],
            memory_capacity_bytes=float(cost.capacity[i]),
        )
        for k, (i, a, b) in enumerate(spec)
    ]
    used = {i for i, _, _ in spec}
    sched = cost.schedule
    lb = cost.lower_bound(objective) if lower_bound_s is None else lower_bound_s
    return Plan(
        method=method,
        stages=plans,
        predicted_step_time_s=cost.step_time_of(t),
        lower_bound_s=lb,
        solve_time_s=solve_time_s,
        schedule={
            "batch_size": sched.batch_size,
            "microbatches": sched.microbatches,
            "kind": sched.kind,
            "transport": sched.transport,
        },
        period_s=float(max((t.fwd + t.bwd).max(), t.link.max() if S > 1 else 0.0)),
        objective=objective,
        idle_nodes=[n.name for i, n in enumerate(cost.nodes) if i not in used],
        **extra,  # type: ignore[arg-type]
    )


def _counts_to_stages(order: Sequence[int], counts: Sequence[int]) -> list[Stage]:
    stages, start = [], 0
    for i, c in zip(order, counts, strict=True):
        stages.append((int(i), start, start + int(c) - 1))
        start += int(c)
    return stages


def _configured_order(cost: CostModel) -> list[int]:
    return [cost.owner] + [i for i in range(cost.num_nodes) if i != cost.owner]


def _even_stages(cost: CostModel) -> list[Stage]:
    L, N = cost.num_layers, cost.num_nodes
    return _counts_to_stages(
        _configured_order(cost), [L // N + (1 if i < L % N else 0) for i in range(N)]
    )


def _infeasible_message(cost: CostModel) -> str:
    L = cost.num_layers
    cap_max = float(cost.capacity.max())
    one = np.array([cost.stage_memory(j, j) for j in range(L)])
    too_big = [j for j in range(L) if one[j] > cap_max]
    sched = cost.schedule
    if too_big:
        layers = ", ".join(
            f"layer {j} ({cost.layers[j].name}) needs {one[j] / MIB:.1f} MiB" for j in too_big[:5]
        )
        return (
            f"infeasible memory budget: {layers}, but the largest node has "
            f"{cap_max / MIB:.1f} MiB. Give a node more memory, lower the batch size "
            f"(now {sched.batch_size}), or split the layer."
        )
    owner = cost.nodes[cost.owner]
    first = cost.stage_memory(0, 0, cost.inflight(0, cost.num_nodes))
    if first > cost.capacity[cost.owner]:
        return (
            f"infeasible memory budget: the data owner {owner.name!r} must run stage 0 (raw "
            f"inputs never leave it), but layer 0 ({cost.layers[0].name}) alone needs "
            f"{first / MIB:.1f} MiB and it has {cost.capacity[cost.owner] / MIB:.1f} MiB. "
            f"Give {owner.name!r} more memory or lower the batch size (now {sched.batch_size})."
        )
    need, have = cost.stage_memory(0, L - 1), float(cost.capacity.sum())
    caps = ", ".join(
        f"{n.name}={c / MIB:.1f}" for n, c in zip(cost.nodes[:8], cost.capacity, strict=False)
    )
    return (
        f"infeasible memory budget: the model needs {need / MIB:.1f} MiB (params, grads, "
        f"optimizer state, activations of {sched.microbatches} micro-batch(es) of "
        f"{sched.microbatch_size}) against {have / MIB:.1f} MiB available over "
        f"{cost.num_nodes} nodes ({caps}{', ...' if cost.num_nodes > 8 else ''} MiB), and "
        "no contiguous split fits every node. Add memory or nodes, or lower the batch size."
    )


# --------------------------------------------------------------------------------------
# even
# --------------------------------------------------------------------------------------
def even(cost: CostModel, objective: str = "step") -> Plan:
    """Equal layer counts over every node, in configured order (data owner first).

    Raises
    ------
    InfeasibleMemoryError
        If a node cannot hold its equal share (names the node and the numbers).
    ValueError
        If there are fewer layers than nodes.
    """
    _check_objective(objective)
    t0 = time.perf_counter()
    if cost.num_layers < cost.num_nodes:
        raise ValueError(
            f"even allocation needs at least one layer per node: the model has "
            f"{cost.num_layers} layers, the fleet {cost.num_nodes} nodes. Use "
            "allocation=heuristic or allocation=optimal, which may leave nodes idle."
        )
    stages = _even_stages(cost)
    mems = cost.stage_memories(stages)
    for (i, a, b), need in zip(stages, mems, strict=True):
        if need > cost.capacity[i]:
            raise InfeasibleMemoryError(
                f"even allocation puts layers {a}..{b} on node {cost.nodes[i].name!r}: "
                f"{need / MIB:.1f} MiB needed, {cost.capacity[i] / MIB:.1f} MiB available. "
                "Use allocation=heuristic or allocation=optimal, which respect memory."
            )
    return make_plan(cost, "even", stages, time.perf_counter() - t0, objective=objective)


# --------------------------------------------------------------------------------------
# heuristic
# --------------------------------------------------------------------------------------
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


def _polish(
    cost: CostModel, stages: list[Stage], objective: str, max_moves: int = 5000
) -> list[Stage]:
    """Move one boundary layer at a time, either way, while the objective improves.

    All ``2 (S - 1)`` moves are scored at once (vectorised, O(S) per round); the best
    improving move is made (ties broken by the sum of squared stage times, so stages
    even out). For ``1f1b`` the GPipe closed form stands in for the objective.
    """
    st = np.asarray(stages, dtype=int).reshape(-1, 3)
    node, a, b = st[:, 0].copy(), st[:, 1].copy(), st[:, 2].copy()
    S = len(node)
    if S < 2:
        return [tuple(int(v) for v in r) for r in st]
    M = cost.schedule.microbatches
    seq = cost.schedule.kind == "sequential"
    inflight = np.array([cost.inflight(k, S) for k in range(S)])
    cap = cost.capacity[node]
    ks = np.arange(S - 1)
    is_last = np.zeros(S, dtype=bool)
    is_last[-1] = True

    def stage_terms(k: np.ndarray, aa: np.ndarray, bb: np.ndarray) -> tuple:
        i = node[k]
        f = cost.fwd_prefix[i, bb + 1] - cost.fwd_prefix[i, aa]
        bw = cost.bwd_prefix[i, bb + 1] - cost.bwd_prefix[i, aa]
        if cost.relay:
            bw = bw + np.where(is_last[k], 0.0, f)
            msgs = np.where(is_last[k], 1.0, 2.0)
            state = cost.state_prefix[bb + 1] - cost.state_prefix[aa]
            over = msgs * (cost.latency[i] + cost.state_rate[i] * state)
        else:
            over = np.zeros(len(k))
        return f, bw, over

    f, bw, over = stage_terms(np.arange(S), a, b)
    link = cost.link_arrays(node[:-1], node[1:], b[:-1])

    def value(f, bw, link, over):  # noqa: ANN001, ANN202
        c = f + bw
        if objective == "throughput":
            return max(c.max(), link.max())
        if seq:
            return M * (c.sum() + 2 * link.sum()) + over.sum()
        return (
            c.sum()
            + 2 * link.sum()
            + over.sum()
            + (M - 1) * (max(f.max(), link.max()) + max(bw.max(), link.max()))
        )

    best = (float(value(f, bw, link, over)), float(((f + bw) ** 2).sum()))
    for _ in range(max_moves):
        c = f + bw
        top = None
        for delta in (-1, 1):
            nb, na1 = b[:-1] + delta, a[1:] + delta
            ok = (nb >= a[:-1]) & (na1 <= b[1:])
            k = ks[ok]
            if len(k) == 0:
                continue
            k1 = k + 1
            f0, b0, o0 = stage_terms(k, a[k], nb[ok])
            f1, b1, o1 = stage_terms(k1, na1[ok], b[k1])
            mem0 = cost.memory_arrays(a[k], nb[ok], inflight[k])
            mem1 = cost.memory_arrays(na1[ok], b[k1], inflight[k1])
            fits = (mem0 <= cap[k]) & (mem1 <= cap[k1])
            if not fits.any():
                continue
            k, k1 = k[fits], k1[fits]
            f0, b0, o0, f1, b1, o1 = (v[fits] for v in (f0, b0, o0, f1, b1, o1))
            lk = cost.link_arrays(node[k], node[k1], b[k] + delta)
            c0, c1 = f0 + b0, f1 + b1
            csum = c.sum() - c[k] - c[k1] + c0 + c1
            lsum = link.sum() - link[k] + lk
            osum = over.sum() - over[k] - over[k1] + o0 + o1
            l_max = np.maximum(_excl_max(link, k, k), lk)
            if objective == "throughput":
                v = np.maximum(np.maximum(_excl_max(c, k, k1), np.maximum(c0, c1)), l_max)
            elif seq:
                v = M * (csum + 2 * lsum) + osum
            else:
                fm = np.maximum(_excl_max(f, k, k1), np.maximum(f0, f1))
                bm = np.maximum(_excl_max(bw, k, k1), np.maximum(b0, b1))
                v = csum + 2 * lsum + osum
                v = v + (M - 1) * (np.maximum(fm, l_max) + np.maximum(bm, l_max))
            sq = (c * c).sum() - c[k] ** 2 - c[k1] ** 2 + c0**2 + c1**2
            v = np.round(v, 12)
            j = int(np.lexsort((sq, v))[0])
            cand = ((float(v[j]), float(sq[j])), int(k[j]), delta)
            if top is None or cand < top:
                top = cand
        if top is None or top[0] >= best:
            break
        best, k, delta = top
        b[k] += delta
        a[k + 1] += delta
        kk = np.array([k, k + 1])
        f[kk], bw[kk], over[kk] = stage_terms(kk, a[kk], b[kk])
        link[k] = cost.link_arrays(node[k : k + 1], node[k + 1 : k + 2], b[k : k + 1])[0]
    return [(int(i), int(x), int(y)) for i, x, y in zip(node, a, b, strict=True)]


def heuristic(cost: CostModel, objective: str = "step", grid: int = 16) -> Plan:
    """Fast order-aware greedy with bisection on the stage-time cap, then polishing.

    See the module docstring. Never worse than :func:`even` when ``even`` fits (it is
    one of the polished candidates).

    Parameters
    ----------
    cost : CostModel
    objective : {"step", "throughput"}
    grid : int
        Caps scored between the least feasible one and one stage per node (``step``).

    Raises
    ------
    InfeasibleMemoryError
        If no assignment fits memory.
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
                for T2 in np.geomspace(T, max(top, T), grid)[1:]:
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
    if not cands:
        raise InfeasibleMemoryError(_infeasible_message(cost))
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


# --------------------------------------------------------------------------------------
# optimal: enumeration (small) or the slot/kind MILP
# --------------------------------------------------------------------------------------
def _count_plans(N: int, L: int) -> int:
    """Plans with the owner first: ordered choices of the other nodes x cut positions."""
    total = 0
    for s in range(min(N, L)):  # s other stages
        total += math.perm(N - 1, s) * math.comb(L - 1, s)
        if total > 10 * ENUMERATION_LIMIT:
            break
    return total


def _kinds(cost: CostModel) -> list[int]:
    """Kind label per node: nodes with identical profiles share a label; the data owner
    is always its own kind."""
    labels: dict[tuple, int] = {}
    out = []
    for i in range(cost.num_nodes):
        if i == cost.owner:
            out.append(-1)
            continue
        key = (
            cost.fwd[i].tobytes(),
            cost.bwd[i].tobytes(),
            cost.capacity[i],
            cost.latency[i],
            cost.inv_bw[i],
            cost.state_rate[i],
        )
        out.append(labels.setdefault(key, len(labels)))
    return out


def _enumerate(cost: CostModel, objective: str) -> list[Stage] | None:
    """Best plan over every order (identical nodes deduplicated), idle set and cut."""
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
            for cuts in itertools.combinations(range(1, L), s):
                counts = np.diff([0, *cuts, L])
                stages = _counts_to_stages(order, counts)
                if not cost.fits(stages):
                    continue
                v = cost.objective(stages, objective)
                if v < best_v:
                    best, best_v = stages, v
    return best


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
        """Run HiGHS; ``res.fun + offset`` is the objective."""
        return milp(
            self.c,
            constraints=self.constraints,
            integrality=self.integrality,
            bounds=self.bounds,
            options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False},
        )

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


class _PeriodDP:
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
        self.cost = cost
        kinds = _kinds(cost)
        self.kind_ids = sorted(set(kinds) - {-1})
        self.members = {t: [i for i, k in enumerate(kinds) if k == t] for t in self.kind_ids}
        self.counts = [len(self.members[t]) for t in self.kind_ids]
        self.num_states = math.prod(n + 1 for n in self.counts)
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
        digits, strides = self._digits, self._strides
        reach = np.full(self.num_states, -1, dtype=np.int64)
        via = np.full(self.num_states, -1, dtype=np.int64)
        reach[0] = e0
        for k in range(1, len(self._levels)):
            idx = self._levels[k]
            best = np.full(len(idx), -1, dtype=np.int64)
            best_t = np.full(len(idx), -1, dtype=np.int64)
            for t in range(len(strides)):
                has = digits[idx, t] > 0
                if not has.any():
                    continue
                rows = np.flatnonzero(has)
                p = reach[idx[rows] - strides[t]]
                live = p > 0
                if not live.any():
                    continue
                rows, p = rows[live], p[live]
                e = self._extend_many(t, p, k, T, ok_prev)
                better = (e > p) & (e > best[rows])
                best[rows[better]] = e[better]
                best_t[rows[better]] = t
            reach[idx] = best
            via[idx] = best_t
            done = np.flatnonzero(best == L)
            if len(done):
                node_idx = int(idx[done[0]])
                steps = []
                while node_idx != 0:
                    t = int(via[node_idx])
                    prev = node_idx - strides[t]
                    steps.append((t, int(reach[prev]), int(reach[node_idx])))
                    node_idx = prev
                pool = {t: list(self.members[tid]) for t, tid in enumerate(self.kind_ids)}
                stages = [(cost.owner, 0, e0 - 1)]
                for t, p0, e in reversed(steps):
                    stages.append((pool[t].pop(0), p0, e - 1))
                return stages
        return None

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


class _SumDP:
    """Exact minimum step for one pass (``sequential``, or any schedule with M = 1) on
    the ``direct`` transport when every pair of nodes has the same link.

    The step is then ``M (sum_k (f_k + b_k) + 2 sum links)``: a sum over stages, so a
    dynamic programme over (how many nodes of each kind are in use, layers covered)
    keeps the least cost; appending a node of kind t that takes ``[p, e)`` is a min-plus
    product with that kind's block-cost matrix (infinite where the block does not fit
    memory). Cost ``prod_t (n_t + 1) x kinds x L^2``.
    """

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        kinds = _kinds(cost)
        self.kind_ids = sorted(set(kinds) - {-1})
        self.members = {t: [i for i, k in enumerate(kinds) if k == t] for t in self.kind_ids}
        self.counts = [len(self.members[t]) for t in self.kind_ids]
        self.num_states = math.prod(n + 1 for n in self.counts)
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

    def solve(self) -> list[Stage] | None:
        """The least-step plan, or None if nothing fits memory."""
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
        pool = {t: list(self.members[tid]) for t, tid in enumerate(self.kind_ids)}
        stages = [(cost.owner, 0, e - 1)]
        for t, p, e2 in reversed(steps):
            stages.append((pool[t].pop(0), p, e2 - 1))
        return stages


def _milp_ok(cost: CostModel) -> str | None:
    """None if the MILP models this cost exactly, else why not."""
    if cost.relay:
        return "the MILP models the direct transport (relay adds per-message terms)"
    if len(set(cost.inv_bw.tolist())) > 1 or len(set(cost.latency.tolist())) > 1:
        return "the MILP needs the same link between every pair of nodes"
    return None


def optimal(
    cost: CostModel,
    objective: str = "step",
    time_limit_s: float = 30.0,
    mip_rel_gap: float = 1e-6,
    solver: str = "auto",
) -> Plan:
    """Minimum objective over every plan (order, idle nodes, cuts), proven.

    Enumeration when there are at most ``ENUMERATION_LIMIT`` plans, otherwise the
    slot/kind MILP (module docstring) solved by HiGHS. Never worse than
    :func:`heuristic`: if HiGHS stops at the time limit, the better of its incumbent
    and the heuristic's plan is returned, with a note.

    Parameters
    ----------
    objective : {"step", "throughput"}
    time_limit_s : float
        HiGHS time limit (seconds).
    mip_rel_gap : float
        Relative gap at which HiGHS may stop and call the solution optimal.
    solver : {"auto", "enumerate", "milp", "dp"}
        ``auto``: enumeration up to ``ENUMERATION_LIMIT`` plans; else, for
        ``throughput`` with one link for every pair, the exact programme over node kinds
        (``dp``, up to ``DP_STATE_LIMIT`` states); else the MILP.

    Raises
    ------
    InfeasibleMemoryError
        If no assignment fits memory.
    ValueError
        On an unknown solver.
    """
    _check_objective(objective)
    if solver not in ("auto", "enumerate", "milp", "dp"):
        raise ValueError(f"unknown solver {solver!r}: use auto, enumerate, milp or dp")
    t0 = time.perf_counter()
    h = heuristic(cost, objective)  # raises a clear error before any solving
    lb = cost.lower_bound(objective)
    small = _count_plans(cost.num_nodes, cost.num_layers) <= ENUMERATION_LIMIT
    if solver == "enumerate" or (solver == "auto" and small):
        best = _enumerate(cost, objective)
        v = cost.objective(best, objective)
        return make_plan(
            cost,
            "optimal",
            best,
            time.perf_counter() - t0,
            lower_bound_s=min(lb, v),
            objective=objective,
            proven_optimal=True,
            note="exhaustive enumeration",
        )
    uniform = len(set(cost.inv_bw.tolist())) == 1 and len(set(cost.latency.tolist())) == 1
    if objective == "throughput" and uniform and solver in ("auto", "dp"):
        dp = _PeriodDP(cost)
        if dp.num_states <= DP_STATE_LIMIT:
            deadline = t0 + time_limit_s
            stages, proven = dp.solve(h.period_s, deadline)
            if stages is None or cost.period(stages) > h.period_s:
                stages = h.spec
            one_f = cost.schedule.kind == "1f1b" and not cost.relay
            proven = proven and not one_f
            v = cost.period(stages)
            note = "exact dynamic programme over node kinds"
            if one_f:
                note += " (1F1B memory charged for N stages: not proven)"
            elif not proven:
                note += f": time limit {time_limit_s:g} s reached"
            return make_plan(
                cost,
                "optimal",
                stages,
                time.perf_counter() - t0,
                lower_bound_s=v if proven else lb,
                objective=objective,
                proven_optimal=proven,
                mip_gap=0.0 if proven else None,
                note=note,
            )
    one_pass = cost.schedule.kind == "sequential" or cost.schedule.microbatches == 1
    if (
        objective == "step"
        and one_pass
        and uniform
        and not cost.relay
        and solver
        in (
            "auto",
            "dp",
        )
    ):
        dp2 = _SumDP(cost)
        if dp2.work <= SUM_DP_WORK_LIMIT:
            stages = dp2.solve()
            if stages is None or cost.step_time(stages) > h.predicted_step_time_s:
                stages = h.spec
            v = cost.step_time(stages)
            return make_plan(
                cost,
                "optimal",
                stages,
                time.perf_counter() - t0,
                lower_bound_s=v,
                objective=objective,
                proven_optimal=True,
                mip_gap=0.0,
                note="exact dynamic programme over node kinds and layers (one pass)",
            )
    why = _milp_ok(cost)
    if why is None and objective == "throughput" and solver == "auto":
        why = (
            f"the exact programme has {_PeriodDP(cost).num_states} node-kind states "
            f"(limit {DP_STATE_LIMIT}) and the MILP's bound is too weak for throughput"
        )
    if why is None:
        n_kinds = len(set(_kinds(cost)) - {-1})
        size = min(cost.num_nodes, cost.num_layers) * cost.num_layers * max(n_kinds, 1)
        if size > MILP_VARIABLE_LIMIT:
            why = f"the MILP would have {size} variables (limit {MILP_VARIABLE_LIMIT})"
    if why is not None:
        return make_plan(
            cost,
            "optimal",
            h.spec,
            time.perf_counter() - t0,
            lower_bound_s=lb,
            objective=objective,
            note=f"{why}: heuristic plan, not proven",
        )
    model = _SlotMilp(cost, objective)
    remaining = max(time_limit_s - (time.perf_counter() - t0), 0.1)
    res = model.solve(remaining, mip_rel_gap)
    dual = getattr(res, "mip_dual_bound", None)
    surrogate = objective == "step" and cost.schedule.kind == "1f1b"
    if dual is not None and np.isfinite(dual) and not surrogate:
        lb = max(lb, float(dual) + model.offset)
    gap = getattr(res, "mip_gap", None)
    gap = float(gap) if gap is not None and np.isfinite(gap) else None
    h_v = h.objective_value_s
    if res.x is not None:
        stages = model.to_stages(res.x)
        v = cost.objective(stages, objective)
        if res.status == 0 and not surrogate:
            # proven within mip_rel_gap; the heuristic may match it within that gap
            if h_v < v:
                stages, v = h.spec, h_v
            return make_plan(
                cost,
                "optimal",
                stages,
                time.perf_counter() - t0,
                lower_bound_s=min(lb, v),
                objective=objective,
                proven_optimal=True,
                mip_gap=gap,
            )
        if v <= h_v:
            note = (
                "MILP minimised GPipe's closed form as a surrogate for 1F1B"
                if surrogate
                else f"time limit {time_limit_s:g} s reached: MILP incumbent (beats heuristic)"
            )
        else:
            stages, note = h.spec, "heuristic beats the MILP's plan"
            if res.status != 0:
                note = f"time limit {time_limit_s:g} s reached: " + note
    else:
        stages = h.spec
        note = f"MILP found no solution in {time_limit_s:g} s ({res.message}): heuristic plan"
    return make_plan(
        cost,
        "optimal",
        stages,
        time.perf_counter() - t0,
        lower_bound_s=lb,
        objective=objective,
        proven_optimal=False,
        mip_gap=gap,
        note=note,
    )


def brute_force(cost: CostModel, objective: str = "step") -> Plan:
    """Exhaustive search over every plan (tiny instances only; for tests).

    Raises
    ------
    InfeasibleMemoryError
        If none fits memory.
    """
    t0 = time.perf_counter()
    best = _enumerate(cost, objective)
    if best is None:
        raise InfeasibleMemoryError(_infeasible_message(cost))
    return make_plan(
        cost,
        "brute_force",
        best,
        time.perf_counter() - t0,
        objective=objective,
        proven_optimal=True,
    )


def feasible_stages(cost: CostModel) -> list[Stage]:
    """Some plan that fits every node's memory (greedy fill by memory, largest first).

    Raises
    ------
    InfeasibleMemoryError
        With the layers that do not fit and memory needed against memory available.
    """
    filler = _Filler(cost)
    sizes: list[int | None] = [None]
    if cost.schedule.kind == "1f1b" and not cost.relay:  # shorter pipelines stash less
        sizes += list(range(1, min(cost.num_nodes, cost.num_layers) + 1))
    for num_stages in sizes:
        for order in _orders(cost):
            s = filler.fill(order, math.inf, num_stages=num_stages)
            if s is not None and cost.fits(s):
                return s
    raise InfeasibleMemoryError(_infeasible_message(cost))


feasible_bounds = feasible_stages  # former name


def partition(
    cost: CostModel,
    method: str,
    *,
    objective: str = "step",
    time_limit_s: float = 30.0,
    mip_rel_gap: float = 1e-6,
) -> Plan:
    """Partition by ``method`` (``even``, ``heuristic`` or ``optimal``).

    Raises
    ------
    ValueError
        On an unknown method or objective (lists the valid ones).
    InfeasibleMemoryError
        If the layers cannot fit the nodes' memory.
    """
    _check_objective(objective)
    if method == "even":
        return even(cost, objective)
    if method == "heuristic":
        return heuristic(cost, objective)
    if method == "optimal":
        return optimal(cost, objective, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap)
    raise ValueError(f"unknown allocation {method!r}: choose one of {', '.join(METHODS)}")
