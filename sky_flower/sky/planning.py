"""Planning for a Sky run: the model's layer profiles, the pre-check, the plan (with the
other allocations' predictions for comparison), what it predicts per stage, the steps
in a round, and the :class:`sky_flower.sky.runner.Pipeline` a runner executes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import Any

from flwr.supercore import log
from torch import nn

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.federated import steps_in_round  # noqa: F401  (the rule lives in core)
from sky_flower.core.partition import METHODS, Plan, feasible_bounds, partition
from sky_flower.core.profile import LayerProfile, NodeProfile, profile_layers
from sky_flower.core.profile import default_optimizer_factory as _opt_factory
from sky_flower.pipeline.example import as_dtype
from sky_flower.sky.runner import Pipeline


def profile_model(
    model_fn: Callable[[], nn.Module],
    input_shape: Sequence[int],
    schedule: Schedule,
    optimizer: str,
    lr: float,
    input_dtype: str = "float32",
) -> list[LayerProfile]:
    """Per-layer FLOPs and bytes of the model at the schedule's micro-batch size, on an
    input of ``input_dtype`` (int64 for token ids)."""
    return profile_layers(
        model_fn(),
        list(input_shape),
        schedule.microbatch_size,
        _opt_factory(optimizer, lr),
        dtype=as_dtype(input_dtype),
    )


def precheck(
    layers: Sequence[LayerProfile],
    schedule: Schedule,
    allocation: str,
    names: Sequence[str],
    memory_caps: Sequence[float | None],
) -> None:
    """Fail before any node is contacted if the known memory caps (bytes; None =
    unknown) already make every plan infeasible, or ``even`` allocation meets a fleet
    with more nodes than the model has layers.

    Raises
    ------
    InfeasibleMemoryError, ValueError
        As :func:`sky_flower.core.partition.feasible_bounds`.
    """
    nodes = [
        NodeProfile(
            name=name,
            layer_fwd_s=(0.0,) * len(layers),
            layer_bwd_s=(0.0,) * len(layers),
            memory_bytes=int(cap) if cap is not None else 2**62,
        )
        for name, cap in zip(names, memory_caps, strict=True)
    ]
    feasible_bounds(CostModel(list(layers), nodes, schedule))
    if allocation == "even" and len(layers) < len(nodes):
        raise ValueError(
            f"even allocation needs at least one layer per node: the model has "
            f"{len(layers)} layers, the fleet {len(nodes)} nodes. Use "
            "allocation=heuristic or allocation=optimal, which may leave nodes idle."
        )


@dataclass(frozen=True)
class Planned:
    """A plan with its cost model, relay group size and (first plan only) the other
    allocations' predicted step times on the same benchmark (``None``: infeasible)."""

    plan: Plan
    cost: CostModel
    group_size: int
    alternatives: dict[str, float | None]

    def event(self) -> dict[str, Any]:
        """The ``("plan", ...)`` event's payload."""
        return {
            **self.plan.to_dict(),
            "alternatives": self.alternatives,
            "microbatches_per_message": self.group_size,
        }


def plan_spec(plan: Plan) -> list[tuple[int, int, int]]:
    """``(node index, first layer, last layer)`` of every stage."""
    return [(s.node_index, s.first_layer, s.last_layer) for s in plan.stages]


def make_plan(
    layers: Sequence[LayerProfile],
    nodes: Sequence[NodeProfile],
    schedule: Schedule,
    allocation: str,
    time_limit_s: float = 30.0,
    alternatives: bool = True,
) -> Planned:
    """Partition the profiled model over the profiled nodes (and log it).

    ``alternatives``: also solve the other allocations on this same benchmark (a fair
    comparison: separate runs measure their own, noisy, profiles); else only the
    configured one is listed.

    Raises
    ------
    ValueError
        If the configured allocation has no feasible plan (e.g. memory).
    """
    cost = CostModel(list(layers), list(nodes), schedule)
    plan = partition(cost, allocation, time_limit_s=time_limit_s)
    log(INFO, "Plan (%s):\n%s", allocation, plan.table())
    group = schedule.microbatches  # sequential: one group of all M micro-batches
    if schedule.kind != "sequential" and schedule.transport == "relay":
        group = cost.relay_group_size(cost.terms(plan_spec(plan)))
        log(
            INFO,
            "Pipelined relay (%s): %d micro-batch(es) per message, %d message group(s) per step",
            schedule.kind,
            group,
            schedule.microbatches // group,
        )
    alts: dict[str, float | None] = {allocation: plan.predicted_step_time_s}
    for method in METHODS if alternatives else ():
        try:
            other = plan if method == allocation else None
            other = other or partition(cost, method, time_limit_s=time_limit_s)
            alts[method] = other.predicted_step_time_s
        except ValueError:  # e.g. even does not fit memory
            alts[method] = None
    if alternatives:
        alts = {m: alts[m] for m in METHODS}
        log(
            INFO,
            "Predicted step time on this benchmark: %s",
            ", ".join(
                f"{m} {'infeasible' if t is None else f'{t:.4f} s'}" for m, t in alts.items()
            ),
        )
    return Planned(plan, cost, group, alts)


def stage_predictions(
    planned: Planned, handler_rate: Mapping[str, float] | None = None
) -> list[dict[str, Any]]:
    """Per stage and step, what the cost model predicts (seconds): ``compute_s``
    (forward + backward of the step's ``M`` micro-batches, recomputation, optimizer
    step and the node's emulated slowdown included), ``busy_s`` (time inside its
    message handlers: ``compute_s``, the payload time charged on the node, and
    rebuilding / saving the stage from / to ``context.state`` at ``handler_rate``
    s/byte per message; the emulated per-message link latency is not in it) and
    ``messages`` (Flower messages the stage handles per step on the relay)."""
    handler_rate = handler_rate or {}
    cost, plan = planned.cost, planned.plan
    t = cost.terms(plan_spec(plan))
    M, S = cost.schedule.microbatches, len(plan.stages)
    groups = M // planned.group_size
    out = []
    for k, st in enumerate(plan.stages):
        compute = M * float(t.fwd[k] + t.bwd[k])
        payload = 2 * M * float(t.node_link[k]) if t.node_link is not None else 0.0
        messages = groups * (1 if k == S - 1 else 2)
        state = float(cost.state_prefix[st.last_layer + 1] - cost.state_prefix[st.first_layer])
        handler = messages * handler_rate.get(st.node, 0.0) * state
        out.append(
            {
                "node": st.node,
                "compute_s": compute,
                "busy_s": compute + payload + handler,
                "messages": messages,
            }
        )
    return out


def pipeline(
    planned: Planned,
    nodes: Sequence[NodeProfile],
    node_ids: Mapping[str, int],
    handler_rate: Mapping[str, float] | None = None,
) -> Pipeline:
    """The :class:`Pipeline` a runner executes for ``planned`` (``nodes``: the profiled
    nodes by name; ``node_ids``: name -> Flower node id)."""
    by_name = {n.name: n for n in nodes}
    stages = [by_name[st.node] for st in planned.plan.stages]
    return Pipeline(
        plan=planned.plan,
        node_ids=tuple(node_ids[n.name] for n in stages),
        group_size=planned.group_size,
        predictions=tuple(stage_predictions(planned, handler_rate)),
        slowdowns=tuple(float(n.slowdown) for n in stages),
        links=tuple(
            (n.latency_s, 0.0 if n.bandwidth_bps == float("inf") else n.bandwidth_bps)
            for n in stages
        ),
    )
