"""Load-balanced layer partitioner: ``even``, ``heuristic``, ``optimal`` (pure, no Flower).

Layer profiles + node profiles + schedule in (a :class:`~sky_flower.cost.CostModel`), a
:class:`Plan` out. Nodes keep their configured order (the data owner is stage 0) and
every node holds one contiguous block of at least one layer. All three methods are
scored by the same :meth:`CostModel.step_time`, the time of the schedule that runs,
transfers included.

* ``even``: equal layer counts (the first ``L mod N`` nodes take one more).
* ``heuristic``: SkyComputing's two stages (Zhu, Li, You, "Sky Computing", arXiv
  2202.11836, Sec. 3.3): pre-allocate layers in proportion to node speed and repair
  it until every node fits its memory; then move boundary layers between neighbouring
  stages, in **both** directions, while the predicted step time improves. The search
  also starts from ``even`` when that fits, so it is never worse than ``even``.
* ``optimal``: a mixed-integer program solved by HiGHS through
  :func:`scipy.optimize.milp`; binary ``x[i, j]`` = layer j on node i, contiguity in
  node order via cumulative sums, per-stage send/receive indicators for the transfers,
  memory rows per node, and for GPipe an epigraph variable for the slowest stage.

Every plan carries a lower bound: the LP relaxation of that same program (and, for
``optimal``, HiGHS's dual bound if tighter).

Example
-------
>>> plan = partition(cost_model, "heuristic")   # doctest: +SKIP
>>> print(plan.table())                          # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from sky_flower.cost import CostModel

METHODS = ("even", "heuristic", "optimal")
MIB = 1024 * 1024


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
        ``even``, ``heuristic`` or ``optimal``.
    stages : list of StagePlan
        In pipeline order; stage 0 is the data owner.
    predicted_step_time_s : float
        :meth:`CostModel.step_time` of this assignment (seconds per step).
    lower_bound_s : float
        A lower bound on the step time of any valid assignment (seconds).
    solve_time_s : float
        Wall time the method took (seconds).
    proven_optimal : bool
        True only when the MILP proved optimality (within ``mip_gap``).
    mip_gap : float or None
        Relative gap reported by HiGHS (``optimal`` only).
    note : str
        What happened (fallbacks, time limits).
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

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """``(first_layer, last_layer)`` per stage."""
        return [(s.first_layer, s.last_layer) for s in self.stages]

    def to_dict(self) -> dict:
        """JSON form (``plan.json``)."""
        return {
            "method": self.method,
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
            "predicted_step_time_s": self.predicted_step_time_s,
            "lower_bound_s": self.lower_bound_s,
            "solve_time_s": self.solve_time_s,
            "proven_optimal": self.proven_optimal,
            "mip_gap": self.mip_gap,
            "note": self.note,
            "schedule": self.schedule,
        }

    def table(self) -> str:
        """The plan as a text table (stage, node, layers, compute s, transfer s, memory MiB)."""
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
            f"{self.method}: predicted step {self.predicted_step_time_s:.4f} s, lower bound "
            f"{self.lower_bound_s:.4f} s, solved in {self.solve_time_s * 1e3:.1f} ms"
            f"{', proven optimal' if self.proven_optimal else ''}{gap}"
        )
        if self.note:
            rows.append(f"note: {self.note}")
        return "\n".join(rows)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def make_plan(
    cost: CostModel,
    method: str,
    bounds: Sequence[tuple[int, int]],
    solve_time_s: float,
    lower_bound_s: float | None = None,
    **extra: object,
) -> Plan:
    """Build a :class:`Plan` for ``bounds`` scored by ``cost``."""
    cost.check_bounds(bounds)
    stages = [
        StagePlan(
            node=cost.nodes[i].name,
            node_index=i,
            first_layer=a,
            last_layer=b,
            compute_s=cost.stage_compute(i, a, b),
            transfer_s=cost.stage_transfer(i, a, b),
            memory_bytes=cost.stage_memory(a, b),
            memory_capacity_bytes=float(cost.capacity[i]),
        )
        for i, (a, b) in enumerate(bounds)
    ]
    sched = cost.schedule
    return Plan(
        method=method,
        stages=stages,
        predicted_step_time_s=cost.step_time(bounds),
        lower_bound_s=lower_bound(cost) if lower_bound_s is None else lower_bound_s,
        solve_time_s=solve_time_s,
        schedule={
            "batch_size": sched.batch_size,
            "microbatches": sched.microbatches,
            "kind": sched.kind,
            "transport": sched.transport,
        },
        **extra,  # type: ignore[arg-type]
    )


def _cuts_to_bounds(cuts: Sequence[int], num_layers: int) -> list[tuple[int, int]]:
    """Stages from ``cuts`` (the last layer of every stage but the last)."""
    return _counts_to_bounds(
        [c - p for p, c in zip([-1, *cuts], [*cuts, num_layers - 1], strict=True)]
    )


def _even_bounds(num_layers: int, num_nodes: int) -> list[tuple[int, int]]:
    """Equal layer counts; the first ``L mod N`` stages take one more."""
    L, N = num_layers, num_nodes
    return _counts_to_bounds([L // N + (1 if i < L % N else 0) for i in range(N)])


def _counts_to_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c - 1))
        start += c
    return bounds


def _check_sizes(cost: CostModel) -> None:
    if cost.num_layers < cost.num_nodes:
        raise ValueError(
            f"the model has {cost.num_layers} layers but the fleet has {cost.num_nodes} "
            "nodes and every node holds at least one layer: use a fleet with at most "
            f"{cost.num_layers} nodes or split the model into more layers"
        )


def feasible_bounds(cost: CostModel) -> list[tuple[int, int]]:
    """Some assignment that fits every node's memory (in node order, >= 1 layer each).

    Dynamic programme over (node, first layer); O(N L^2) worst case.

    Raises
    ------
    InfeasibleMemoryError
        With the layers that do not fit and memory needed against memory available.
    """
    _check_sizes(cost)
    L, N = cost.num_layers, cost.num_nodes
    # parent[i][a] = start of node i-1 when node i can start at layer a
    parent: list[dict[int, int]] = [dict() for _ in range(N + 1)]
    parent[0][0] = -1
    for i in range(N):
        for a in sorted(parent[i]):
            last_allowed = L - (N - i)  # leave one layer for every later node
            for b in range(a, last_allowed + 1):
                if cost.stage_memory(a, b) > cost.capacity[i]:
                    break
                parent[i + 1].setdefault(b + 1, a)
    if L not in parent[N]:
        raise InfeasibleMemoryError(_infeasible_message(cost))
    bounds: list[tuple[int, int]] = []
    end = L
    for i in range(N, 0, -1):
        a = parent[i][end]
        bounds.append((a, end - 1))
        end = a
    return bounds[::-1]


def _infeasible_message(cost: CostModel) -> str:
    L = cost.num_layers
    cap_max = float(cost.capacity.max())
    too_big = [j for j in range(L) if cost.memory[j] > cap_max]
    if too_big:
        layers = ", ".join(
            f"layer {j} ({cost.layers[j].name}) needs {cost.memory[j] / MIB:.1f} MiB"
            for j in too_big
        )
        return (
            f"infeasible memory budget: {layers}, but the largest node has "
            f"{cap_max / MIB:.1f} MiB. Give a node more memory, shrink the layer or split it."
        )
    need, have = float(cost.memory.sum()), float(cost.capacity.sum())
    # Greedy fill in node order shows where the layers run out of room.
    start = 0
    for i in range(cost.num_nodes):
        end = start
        while end < L and cost.stage_memory(start, end) <= cost.capacity[i]:
            end += 1
        start = end
    left = f"layers {start}..{L - 1}" if start < L else "no layers"
    left_mb = cost.stage_memory(start, L - 1) / MIB if start < L else 0.0
    caps = ", ".join(
        f"{n.name}={c / MIB:.1f}" for n, c in zip(cost.nodes, cost.capacity, strict=True)
    )
    return (
        f"infeasible memory budget: the model needs {need / MIB:.1f} MiB (params, grads, "
        f"optimizer state, activations for batch {cost.schedule.batch_size}) against "
        f"{have / MIB:.1f} MiB available ({caps} MiB). Filling nodes in order leaves {left} "
        f"({left_mb:.1f} MiB) without room (each node needs at least one layer). Add "
        "memory, add nodes, or lower the batch size."
    )


# --------------------------------------------------------------------------------------
# even
# --------------------------------------------------------------------------------------
def even(cost: CostModel) -> Plan:
    """Equal layer counts in configured node order.

    Raises
    ------
    InfeasibleMemoryError
        If a node cannot hold its equal share (names the node and the numbers).
    ValueError
        If there are fewer layers than nodes.
    """
    t0 = time.perf_counter()
    _check_sizes(cost)
    bounds = _even_bounds(cost.num_layers, cost.num_nodes)
    for i, (a, b) in enumerate(bounds):
        need = cost.stage_memory(a, b)
        if need > cost.capacity[i]:
            raise InfeasibleMemoryError(
                f"even allocation puts layers {a}..{b} on node {cost.nodes[i].name!r}: "
                f"{need / MIB:.1f} MiB needed, {cost.capacity[i] / MIB:.1f} MiB available. "
                "Use allocation=heuristic or allocation=optimal, which respect memory."
            )
    return make_plan(cost, "even", bounds, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------
# heuristic
# --------------------------------------------------------------------------------------
def _speed_proportional(cost: CostModel) -> list[tuple[int, int]]:
    """SkyComputing's pre-allocation: layer work shared in proportion to node speed."""
    L, N = cost.num_layers, cost.num_nodes
    speed = 1.0 / np.maximum(cost.compute.sum(axis=1), 1e-12)
    share = np.cumsum(speed / speed.sum())
    work = cost.compute.mean(axis=0)
    cum = np.cumsum(work) / max(work.sum(), 1e-12)
    counts, start = [], 0
    for i in range(N):
        if i == N - 1:
            end = L
        else:
            end = int(np.searchsorted(cum, share[i] - 1e-12)) + 1
            end = min(max(end, start + 1), L - (N - 1 - i))
        counts.append(end - start)
        start = end
    return _counts_to_bounds(counts)


def _repair_memory(cost: CostModel, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Move boundary layers off over-full stages onto neighbours with room."""
    cuts = [b for _, b in bounds[:-1]]  # last layer of stages 0..N-2
    N = cost.num_nodes

    def over(i: int) -> bool:
        a = 0 if i == 0 else cuts[i - 1] + 1
        b = cost.num_layers - 1 if i == N - 1 else cuts[i]
        return cost.stage_memory(a, b) > cost.capacity[i]

    for _ in range(cost.num_layers * N):
        changed = False
        for i in range(N):
            if not over(i):
                continue
            a = 0 if i == 0 else cuts[i - 1] + 1
            b = cost.num_layers - 1 if i == N - 1 else cuts[i]
            if i < N - 1 and b > a:
                cuts[i] -= 1  # give last layer to the next stage
                changed = True
            elif i > 0 and b > a:
                cuts[i - 1] += 1  # give first layer to the previous stage
                changed = True
        if not changed:
            break
    return _cuts_to_bounds(cuts, cost.num_layers)


def _local_search(cost: CostModel, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Move one boundary layer at a time, either way, while the step time improves."""
    N, L = cost.num_nodes, cost.num_layers
    cuts = [b for _, b in bounds[:-1]]

    def stage_bounds(i: int, c: list[int]) -> tuple[int, int]:
        return (0 if i == 0 else c[i - 1] + 1, L - 1 if i == N - 1 else c[i])

    times = [cost.stage_time(i, *stage_bounds(i, cuts)) for i in range(N)]

    def key(ts: list[float]) -> tuple:
        return (
            round(cost.combine(ts), 12),
            tuple(sorted((round(t, 12) for t in ts), reverse=True)),
        )

    best_key = key(times)
    for _ in range(4 * L * N + 10):
        best_move = None
        for k in range(N - 1):  # boundary between stage k and k+1
            for delta in (-1, +1):  # -1: stage k gives its last layer away; +1: takes one
                trial = cuts.copy()
                trial[k] += delta
                ak, bk = stage_bounds(k, trial)
                a1, b1 = stage_bounds(k + 1, trial)
                if bk < ak or b1 < a1:
                    continue
                if cost.stage_memory(ak, bk) > cost.capacity[k]:
                    continue
                if cost.stage_memory(a1, b1) > cost.capacity[k + 1]:
                    continue
                ts = times.copy()
                ts[k] = cost.stage_time(k, ak, bk)
                ts[k + 1] = cost.stage_time(k + 1, a1, b1)
                kk = key(ts)
                if kk < best_key:
                    best_key, best_move = kk, (trial, ts)
        if best_move is None:
            break
        cuts, times = best_move
    return [stage_bounds(i, cuts) for i in range(N)]


def heuristic(cost: CostModel) -> Plan:
    """SkyComputing-style two-stage heuristic with moves in both directions.

    Stage 1 pre-allocates by speed and repairs memory; stage 2 moves boundary layers
    between neighbours while :meth:`CostModel.step_time` improves. Also searched from
    ``even`` when ``even`` fits; the better result is returned.

    Raises
    ------
    InfeasibleMemoryError
        If no assignment fits memory.
    """
    t0 = time.perf_counter()
    fallback = feasible_bounds(cost)
    starts = []
    pre = _repair_memory(cost, _speed_proportional(cost))
    starts.append(pre if cost.fits(pre) else fallback)
    ev = _even_bounds(cost.num_layers, cost.num_nodes)
    if cost.fits(ev):
        starts.append(ev)
    best = min((_local_search(cost, s) for s in starts), key=cost.step_time)
    return make_plan(cost, "heuristic", best, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------
# optimal (MILP)
# --------------------------------------------------------------------------------------
class _Milp:
    """The partition MILP in cumulative form: O(N L) variables and constraints.

    Binary ``y[i, j] = 1`` iff layer ``j`` sits on a node ``<= i`` (``i < N - 1``; by
    convention ``y[-1, .] = 0`` and ``y[N-1, .] = 1``). Then

    * ``x[i, j] = y[i, j] - y[i-1, j]``: layer j on node i;
    * contiguity in node order: ``y[i, j] >= y[i, j+1]`` and ``y[i, j] >= y[i-1, j]``;
    * node i's last layer is j (and it is not the last stage) iff the cut between nodes
      ``<= i`` and ``> i`` falls after j: ``send[i, j] = y[i, j] - y[i, j+1]``;
    * node i's first layer is ``j > 0`` iff ``recv[i, j] = y[i-1, j-1] - y[i-1, j]``
      (every node holds >= 1 layer, so cuts and stage boundaries coincide).

    Stage times are linear in ``y``; the objective is their sum (sequential) or sum +
    ``(M - 1) z`` with ``z >= stage_i`` (GPipe). The last variable is ``z``.
    """

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        N, L = cost.num_nodes, cost.num_layers
        self.N, self.L = N, L
        ny = (N - 1) * L
        self.nvar = ny + 1
        Z = ny
        gpipe = cost.schedule.kind == "gpipe"
        M = cost.schedule.microbatches
        per_layer = cost.compute + cost.state

        def term(row: dict[int, float], i: int, j: int, v: float) -> float:
            """Add ``v * y[i, j]`` to ``row``; return the constant part."""
            if i < 0 or v == 0.0:
                return 0.0
            if i >= N - 1:
                return v
            k = i * L + j
            row[k] = row.get(k, 0.0) + v
            return 0.0

        # stage-time rows: coefficients on y and constant offsets
        stage_rows: list[tuple[dict[int, float], float]] = []
        for i in range(N):
            row: dict[int, float] = {}
            const = float(cost.fixed[i])
            for j in range(L):
                const += term(row, i, j, float(per_layer[i, j]))
                const += term(row, i - 1, j, -float(per_layer[i, j]))
                if i < N - 1 and j < L - 1:
                    const += term(row, i, j, float(cost.send[i, j]))
                    const += term(row, i, j + 1, -float(cost.send[i, j]))
                if j > 0:
                    const += term(row, i - 1, j - 1, float(cost.recv[i, j]))
                    const += term(row, i - 1, j, -float(cost.recv[i, j]))
            stage_rows.append((row, const))
        c = np.zeros(self.nvar)
        self.offset = 0.0
        for row, const in stage_rows:
            for k, v in row.items():
                c[k] += v
            self.offset += const
        if gpipe:
            c[Z] = M - 1
        self.c = c

        rows: list[tuple[dict[int, float], float, float]] = []
        for i in range(N - 1):
            for j in range(L - 1):  # y[i, j] >= y[i, j+1]
                rows.append(({i * L + j: 1.0, i * L + j + 1: -1.0}, 0.0, np.inf))
            if i > 0:
                for j in range(L):  # y[i, j] >= y[i-1, j]
                    rows.append(({i * L + j: 1.0, (i - 1) * L + j: -1.0}, 0.0, np.inf))
        for i in range(N):  # at least one layer; memory
            count: dict[int, float] = {}
            mem: dict[int, float] = {}
            c_count = c_mem = 0.0
            for j in range(L):
                c_count += term(count, i, j, 1.0) + term(count, i - 1, j, -1.0)
                m = float(cost.memory[j])
                c_mem += term(mem, i, j, m) + term(mem, i - 1, j, -m)
            rows.append((count, 1.0 - c_count, np.inf))
            rows.append((mem, -np.inf, float(cost.capacity[i]) - c_mem))
        if gpipe:  # z >= stage time
            for row, const in stage_rows:
                zrow = {k: -v for k, v in row.items()}
                zrow[Z] = 1.0
                rows.append((zrow, const, np.inf))
        A = lil_matrix((len(rows), self.nvar))
        lb, ub = np.empty(len(rows)), np.empty(len(rows))
        for r, (row, lo, hi) in enumerate(rows):
            for k, v in row.items():
                A[r, k] = v
            lb[r], ub[r] = lo, hi
        self.constraints = LinearConstraint(A.tocsr(), lb, ub)
        upper = np.ones(self.nvar)
        upper[Z] = np.inf
        self.bounds = Bounds(np.zeros(self.nvar), upper)
        self.integrality = np.ones(self.nvar)
        self.integrality[Z] = 0

    def solve(self, relax: bool, time_limit_s: float, mip_rel_gap: float):  # noqa: ANN201
        """Run HiGHS (``relax``: the LP relaxation); ``res.fun + offset`` is step time."""
        return milp(
            self.c,
            constraints=self.constraints,
            integrality=np.zeros(self.nvar) if relax else self.integrality,
            bounds=self.bounds,
            options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False},
        )

    def to_bounds(self, y: np.ndarray) -> list[tuple[int, int]]:
        """Stage bounds from a (near-)integral solution."""
        ybin = np.round(y[: (self.N - 1) * self.L]).reshape(self.N - 1, self.L)
        node_of = (1 - ybin).sum(axis=0).astype(int)  # node index of each layer
        return [
            (int(np.flatnonzero(node_of == i).min()), int(np.flatnonzero(node_of == i).max()))
            for i in range(self.N)
        ]


def lower_bound(cost: CostModel, time_limit_s: float = 10.0) -> float:
    """LP-relaxation lower bound on the step time of any valid assignment (seconds).

    Memory is part of the relaxation, so an infeasible instance may give ``inf``.
    """
    if cost.num_nodes == 1:
        return cost.step_time([(0, cost.num_layers - 1)])
    model = _Milp(cost)
    res = model.solve(relax=True, time_limit_s=time_limit_s, mip_rel_gap=0.0)
    if res.x is None:
        return float("inf") if res.status == 2 else 0.0
    return float(res.fun) + model.offset


def optimal(cost: CostModel, time_limit_s: float = 30.0, mip_rel_gap: float = 1e-6) -> Plan:
    """Minimum predicted step time by MILP (HiGHS via ``scipy.optimize.milp``).

    Parameters
    ----------
    time_limit_s : float
        HiGHS time limit (seconds).
    mip_rel_gap : float
        Relative gap at which HiGHS may stop and call the solution optimal.

    Returns
    -------
    Plan
        ``proven_optimal`` is True when HiGHS proved optimality within ``mip_rel_gap``.
        Otherwise the better of the incumbent and the heuristic, with a note.

    Raises
    ------
    InfeasibleMemoryError
        If no assignment fits memory.
    """
    t0 = time.perf_counter()
    only = feasible_bounds(cost)  # raises a clear error before any solving
    if cost.num_nodes == 1:  # one plan only
        return make_plan(cost, "optimal", only, time.perf_counter() - t0, proven_optimal=True)
    model = _Milp(cost)
    lp = model.solve(relax=True, time_limit_s=time_limit_s, mip_rel_gap=0.0)
    lb = float(lp.fun) + model.offset if lp.x is not None else 0.0
    remaining = max(time_limit_s - (time.perf_counter() - t0), 0.1)
    res = model.solve(relax=False, time_limit_s=remaining, mip_rel_gap=mip_rel_gap)
    dual = getattr(res, "mip_dual_bound", None)
    if dual is not None and np.isfinite(dual):
        lb = max(lb, float(dual) + model.offset)
    gap = getattr(res, "mip_gap", None)
    gap = float(gap) if gap is not None and np.isfinite(gap) else None
    if res.status == 0 and res.x is not None:
        bounds = model.to_bounds(res.x)
        return make_plan(
            cost,
            "optimal",
            bounds,
            time.perf_counter() - t0,
            lower_bound_s=min(lb, cost.step_time(bounds)),
            proven_optimal=True,
            mip_gap=gap,
        )
    h = heuristic(cost)
    if res.x is not None:
        bounds = model.to_bounds(res.x)
        if cost.step_time(bounds) <= h.predicted_step_time_s:
            note = f"time limit {time_limit_s:g} s reached: MILP incumbent (beats heuristic)"
        else:
            bounds, note = (
                h.bounds,
                (f"time limit {time_limit_s:g} s reached: heuristic beats the MILP incumbent"),
            )
    else:
        bounds = h.bounds
        note = f"MILP found no solution in {time_limit_s:g} s ({res.message}): heuristic plan"
    return make_plan(
        cost,
        "optimal",
        bounds,
        time.perf_counter() - t0,
        lower_bound_s=lb,
        proven_optimal=False,
        mip_gap=gap,
        note=note,
    )


def brute_force(cost: CostModel) -> Plan:
    """Exhaustive search over all in-order contiguous assignments (tiny instances only).

    Raises
    ------
    InfeasibleMemoryError
        If none fits memory.
    """
    from itertools import combinations

    t0 = time.perf_counter()
    _check_sizes(cost)
    L, N = cost.num_layers, cost.num_nodes
    best, best_t = None, float("inf")
    for cuts in combinations(range(L - 1), N - 1):  # cut after these layers
        bounds = _cuts_to_bounds(cuts, L)
        if not cost.fits(bounds):
            continue
        t = cost.step_time(bounds)
        if t < best_t:
            best, best_t = bounds, t
    if best is None:
        raise InfeasibleMemoryError(_infeasible_message(cost))
    return make_plan(cost, "brute_force", best, time.perf_counter() - t0, proven_optimal=True)


def partition(
    cost: CostModel,
    method: str,
    *,
    time_limit_s: float = 30.0,
    mip_rel_gap: float = 1e-6,
) -> Plan:
    """Partition by ``method`` (``even``, ``heuristic`` or ``optimal``).

    Raises
    ------
    ValueError
        On an unknown method (lists the valid ones).
    InfeasibleMemoryError
        If the layers cannot fit the nodes' memory.
    """
    if method == "even":
        return even(cost)
    if method == "heuristic":
        return heuristic(cost)
    if method == "optimal":
        return optimal(cost, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap)
    raise ValueError(f"unknown allocation {method!r}: choose one of {', '.join(METHODS)}")
