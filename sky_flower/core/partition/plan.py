"""Plans and the helpers every partitioning method shares (pure, no Flower).

A plan is a list of stages ``(node, first layer, last layer)`` scored by one
:class:`~sky_flower.core.cost.CostModel`. This module holds the result types
(:class:`StagePlan`, :class:`Plan`), :func:`make_plan` (stages in, scored plan out),
:class:`InfeasibleMemoryError` with the message that names what does not fit, and the
small helpers of the solvers: configured order, equal split, node kinds (nodes with
identical profiles are interchangeable, which the exact solvers exploit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sky_flower import tables
from sky_flower.core.cost import CostModel, Stage

OBJECTIVES = ("step", "throughput")
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
        Relative gap ``(objective - lower_bound_s) / objective`` of this plan to the
        proven bound (``optimal``: 0 when proven by a programme; by MILP, the bound is
        HiGHS's), ``None`` where no method bounds it.
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
        cells = [
            (
                k,
                s.node,
                f"{s.first_layer}-{s.last_layer}",
                f"{s.compute_s:.4f}",
                f"{s.transfer_s:.4f}",
                f"{s.memory_bytes / MIB:.1f}/{s.memory_capacity_bytes / MIB:.0f}",
            )
            for k, s in enumerate(self.stages)
        ]
        head = ("stage", "node", "layers", "compute s", "transfer s", "memory MiB")
        rows = [tables.text(head, cells, align="rl", sep="  ", rule=True)]
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
    if S == 1:
        alone = (
            "one node: nothing is split, the data owner trains the whole model"
            if cost.num_nodes == 1
            else "one stage: nothing is split, the data owner trains the whole model"
        )
        extra["note"] = f"{alone}; {extra['note']}" if extra.get("note") else alone
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
