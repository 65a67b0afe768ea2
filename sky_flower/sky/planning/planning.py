"""Planning for a Sky run: the model's layer profiles, the pre-check, the plan (with the
other allocations' predictions for comparison), what it predicts per stage, the steps
in a round, the :class:`sky_flower.sky.transport.runner.Pipeline` a runner executes and
the :class:`PipelineRun` a federated round runs (:mod:`sky_flower.sky.rounds.federation`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from logging import INFO
from typing import Any

from flwr.common import GRPC_MAX_MESSAGE_LENGTH
from flwr.supercore import log
from torch import nn

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.example import as_dtype
from sky_flower.core.federated import (
    FederatedPlan,
    OwnerPipeline,
    plan_federation,
    steps_in_round,  # noqa: F401  (the rule lives in core)
)
from sky_flower.core.partition import METHODS, InfeasibleMemoryError, Plan, feasible_bounds
from sky_flower.core.profile import LayerProfile, NodeProfile, profile_layers
from sky_flower.core.profile import default_optimizer_factory as _opt_factory
from sky_flower.core.schedule import MILP_TIME_LIMIT_S, choose_schedule, predict
from sky_flower.sky.transport.runner import Pipeline


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


# the even pre-check tries every ranking of the owners by samples (which the benchmark
# round tells) up to this many owners (5! = 120 even plans, milliseconds)
EVEN_PRECHECK_MAX_OWNERS = 5


def precheck(
    layers: Sequence[LayerProfile],
    schedule: Schedule,
    allocation: str,
    names: Sequence[str],
    memory_caps: Sequence[float | None],
    holds_data: Sequence[bool] | None = None,
) -> None:
    """Fail before any node is contacted if the known memory caps (bytes; None =
    unknown) already make every plan infeasible, or (``holds_data``: which of ``names``
    own data, where known) ``even`` allocation, which deals the helpers round-robin over
    the owners, meets a pipeline with more nodes than the model has layers, or its
    equal cuts overflow a memory cap whatever the owners' sample counts (up to
    :data:`EVEN_PRECHECK_MAX_OWNERS` owners; the benchmark round tells the counts,
    which decide which helpers join which owner).

    Raises
    ------
    InfeasibleMemoryError, ValueError
        As :func:`sky_flower.core.partition.feasible_bounds`; ``even`` that fits no
        ranking of the owners: the error of the first ranking (naming the node).
    StageStateTooLargeError
        On the relay, if one layer's weights, gradients and optimizer state alone exceed
        Flower's :data:`CONTEXT_LIMIT_BYTES` (no relay plan can hold it).
    """
    for lp in layers if schedule.transport == "relay" else ():
        size = lp.static_bytes
        if size > CONTEXT_LIMIT_BYTES:
            raise StageStateTooLargeError(
                f"layer {lp.name} alone would keep {size / GIB:.2f} GiB (weights, gradients, "
                f"optimizer state) in a relay node's context.state, over Flower's limit of "
                f"{CONTEXT_LIMIT_BYTES} bytes: no relay plan can hold it. Use transport=direct, "
                "which keeps stage state out of context.state"
            )
    if not names:  # no fleet file: nothing is known before the benchmark round
        return
    nodes = [
        NodeProfile(
            name=name,
            layer_fwd_s=(0.0,) * len(layers),
            layer_bwd_s=(0.0,) * len(layers),
            memory_bytes=int(cap) if cap is not None else 2**62,
        )
        for name, cap in zip(names, memory_caps, strict=True)
    ]
    feasible_bounds(CostModel(list(layers), nodes, schedule.for_search()))
    owners = sum(holds_data) if holds_data is not None else 0
    if allocation == "even" and owners:
        largest = 1 + math.ceil((len(nodes) - owners) / owners)  # owner + its helpers
        if len(layers) < largest:
            raise ValueError(
                f"even allocation needs at least one layer per node: the model has "
                f"{len(layers)} layers, the fleet {len(nodes)} nodes with {owners} data "
                f"owner(s), so a pipeline of {largest} nodes. Use allocation=heuristic or "
                "allocation=optimal, which may leave nodes idle."
            )
        _precheck_even(layers, schedule, nodes, holds_data)


def _precheck_even(
    layers: Sequence[LayerProfile],
    schedule: Schedule,
    nodes: Sequence[NodeProfile],
    holds_data: Sequence[bool],
) -> None:
    """Raise ``even``'s memory error if every ranking of the owners by samples (the
    round-robin that deals the helpers follows it) overflows a memory cap."""
    nodes = [replace(n, holds_data=h) for n, h in zip(nodes, holds_data, strict=True)]
    owner_names = [n.name for n in nodes if n.holds_data]
    if len(owner_names) > EVEN_PRECHECK_MAX_OWNERS:
        return
    base = 1000 * schedule.batch_size  # enough samples for a step; only the order matters
    first: InfeasibleMemoryError | None = None
    for ranking in itertools.permutations(owner_names):
        samples = {name: base * (len(ranking) - r) for r, name in enumerate(ranking)}
        try:
            plan_federation(layers, nodes, samples, schedule.for_search(), "even")
        except InfeasibleMemoryError as e:
            first = first or e
            continue
        return  # fits at least one ranking: the benchmark round decides
    assert first is not None
    raise InfeasibleMemoryError(
        f"allocation=even cannot fit the fleet's memory caps whatever the data owners' "
        f"sample counts (checked before the benchmark round): {first}"
    ) from None


@dataclass(frozen=True)
class Planned:
    """One pipeline's plan with its cost model and relay group size."""

    plan: Plan
    cost: CostModel
    group_size: int


# -- Flower's size limit on a relay stage's context.state ---------------------------------
#: Bytes a node's whole ``context.state`` may take: Flower serialises it into one
#: protobuf message with every message the node handles (``context_to_proto``), and
#: protobuf refuses a message over 2 GiB - 1 ("Value out of range"); in deployment it
#: also crosses between SuperNode and ClientApp process as one gRPC message, capped at
#: ``flwr.common.GRPC_MAX_MESSAGE_LENGTH`` (2 GiB - 1 too).
CONTEXT_LIMIT_BYTES = GRPC_MAX_MESSAGE_LENGTH
GIB = 1024**3


class StageStateTooLargeError(ValueError):
    """A relay stage's ``context.state`` would exceed :data:`CONTEXT_LIMIT_BYTES`."""


def relay_state_bytes(
    cost: CostModel, first: int, last: int, is_first: bool, is_last: bool
) -> float:
    """Peak bytes of a relay stage's ``context.state`` holding layers ``first..last``:
    its weights, the gradients accumulated over a step and its optimizer state
    (``2 * param_bytes + optimizer_state_bytes``, plus ``frozen_bytes`` of frozen
    weights: :attr:`LayerProfile.static_bytes`), and during a step the step's ``B``
    samples of stashed input (not on the last stage) and the replies kept for a repeat
    (:mod:`sky_flower.sky.node.stage_state`: its outputs, not on the last stage; its input
    gradients, not on stage 0). Buffers (BatchNorm statistics) are not in the layer
    profile and not counted."""
    B = cost.schedule.batch_size
    act_in = B * float(cost.layers[first].act_in_bytes)
    act_out = B * float(cost.layers[last].act_out_bytes)
    static = float(cost.static_prefix[last + 1] - cost.static_prefix[first])
    return static + (0.0 if is_last else act_in + act_out) + (0.0 if is_first else act_in)


def check_state_limit(
    planned: Sequence[Planned], owners: Sequence[str], limit: int = CONTEXT_LIMIT_BYTES
) -> None:
    """Refuse a relay plan with a stage whose ``context.state`` would exceed ``limit``
    bytes (:func:`relay_state_bytes`); the direct transport keeps stage state out of
    ``context.state``, so its plans pass.

    Raises
    ------
    StageStateTooLargeError
        Naming the first such stage (pipeline owner, stage, node, layers), its size and
        the limit.
    """
    for owner, pl in zip(owners, planned, strict=True):
        if pl.cost.schedule.transport != "relay":
            return
        S = len(pl.plan.stages)
        for k, st in enumerate(pl.plan.stages):
            size = relay_state_bytes(pl.cost, st.first_layer, st.last_layer, k == 0, k == S - 1)
            if size > limit:
                raise StageStateTooLargeError(
                    f"stage {k} of {owner}'s pipeline (node {st.node}, layers "
                    f"{st.first_layer}-{st.last_layer}) would keep {size / GIB:.2f} GiB "
                    f"({size:.0f} bytes: weights, gradients, optimizer state and one step's "
                    f"activations) in its node's context.state, over Flower's limit of "
                    f"{limit} bytes ({limit / GIB:.2f} GiB: protobuf's message limit on "
                    "context_to_proto, and GRPC_MAX_MESSAGE_LENGTH in deployment). Use "
                    "transport=direct, which keeps stage state out of context.state, or "
                    "spread these layers over more nodes"
                )


def plan_spec(plan: Plan) -> list[tuple[int, int, int]]:
    """``(node index, first layer, last layer)`` of every stage."""
    return [(s.node_index, s.first_layer, s.last_layer) for s in plan.stages]


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
    chunked = "chunk_layers" in plan.schedule  # a rank's chunks: chosen_schedule's sum
    for k, st in enumerate(plan.stages):
        compute = M * (st.compute_s if chunked else float(t.fwd[k] + t.bwd[k]))
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


def session_setup_s(planned: Planned) -> float:
    """Predicted seconds of a ``stream`` stage session's set-up for ``planned``: the
    slowest stage's, ``max_k (setup_i + W_k / bw_i)`` (node ``i`` of stage ``k``: its
    measured Flower round trip :attr:`NodeProfile.setup_s`, s; ``W_k`` the stage's
    weight bytes; ``bw_i`` the node's bandwidth, bytes/s;
    :meth:`sky_flower.core.cost.CostModel.session_setup_s`). 0 on another transport, or
    when a stage's node has no measured set-up (not predicted)."""
    cost = planned.cost
    return cost.session_setup_s(plan_spec(planned.plan)) if cost.stream else 0.0


def pipeline(
    planned: Planned,
    nodes: Sequence[NodeProfile],
    node_ids: Mapping[str, int],
    handler_rate: Mapping[str, float] | None = None,
) -> Pipeline:
    """The :class:`Pipeline` a runner executes for ``planned`` (``nodes``: the profiled
    nodes by name; ``node_ids``: name -> Flower node id). On ``stream``, its
    ``setup_s`` is a stage session's predicted set-up (:func:`session_setup_s`), charged
    once, to the round that sets the session up
    (:func:`sky_flower.sky.rounds.federation.round_row`); 0 on the other transports.
    """
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
        devices=tuple((n.host, n.device) for n in stages),
        setup_s=session_setup_s(planned),
    )


# -- one pipeline per data owner ----------------------------------------------------------
@dataclass(frozen=True)
class FederatedPlanned:
    """A federated plan (one pipeline per data owner), each pipeline's
    :class:`Planned`, and the other allocations' predictions on the same benchmark
    (``alternatives``: slowest pipeline's step time; ``alternative_rounds``: round
    time; ``None``: infeasible)."""

    fplan: FederatedPlan
    planned: tuple[Planned, ...]
    alternatives: dict[str, float | None]
    alternative_rounds: dict[str, float | None]

    def to_dict(self) -> dict[str, Any]:
        """``plan.json``'s content (the ``on_plan`` event's): one ``pipelines`` row per pipeline;
        the top-level keys of a one-pipeline plan (``stages``...) are the first
        pipeline's, ``predicted_step_time_s`` the slowest pipeline's, ``idle_nodes``
        the helpers in no pipeline."""
        f = self.fplan
        rows = [
            {
                "owner": p.owner,
                "samples": p.samples,
                "steps": p.steps,
                "after": list(p.after),
                "predicted_start_s": p.start_s,
                "predicted_time_s": p.time_s,
                "predicted_setup_s": session_setup_s(pl),  # stream: once per session
                "microbatches_per_message": pl.group_size,
                **pl.plan.to_dict(),  # the schedule it runs (auto: the one picked)
            }
            for p, pl in zip(f.pipelines, self.planned, strict=True)
        ]
        return {
            **self.planned[0].plan.to_dict(),
            "method": f.method,
            "predicted_step_time_s": max(p.plan.predicted_step_time_s for p in self.planned),
            "alternatives": self.alternatives,
            "alternative_round_times_s": self.alternative_rounds,
            "microbatches_per_message": self.planned[0].group_size,
            "round_time_s": f.round_time_s,
            "fedavg_round_time_s": f.fedavg_round_time_s,
            "round_lower_bound_s": f.lower_bound_s,
            "owner_bounds_s": dict(f.owner_bounds_s),
            "idle_helpers": list(f.idle_helpers),
            "idle_nodes": list(f.idle_helpers),  # nodes in no pipeline
            "federated_note": f.note,
            "pipelines": rows,
        }


def owner_planned(
    op: OwnerPipeline,
    layers: Sequence[LayerProfile],
    nodes: Sequence[NodeProfile],
    schedule: Schedule,
) -> Planned:
    """Owner pipeline ``op`` as a :class:`Planned`: its plan with node indices into its
    own stages' nodes (whatever indexing the planner used), their cost model and the
    relay group size."""
    by_name = {n.name: n for n in nodes}
    group = [by_name[st.node] for st in op.plan.stages]
    stages = [replace(st, node_index=k) for k, st in enumerate(op.plan.stages)]
    plan = replace(op.plan, stages=stages)
    cost = CostModel(list(layers), group, schedule)
    if schedule.kind != schedule.search_kind:  # chunked kinds, auto: played, picked
        plan, cost = chosen_schedule(plan, cost)
    size = schedule.microbatches
    if schedule.kind != "sequential" and schedule.transport in ("relay", "stream"):
        size = cost.relay_group_size(cost.terms(plan_spec(plan)))  # stream: per frame
    return Planned(plan, cost, size)


def chosen_schedule(plan: Plan, cost: CostModel) -> tuple[Plan, CostModel]:
    """A plan searched with :attr:`Schedule.search_kind`, predicted with its real kind
    (``auto``: the direct kind with the least predicted step,
    :func:`sky_flower.core.schedule.choose_schedule`): the plan's predicted step and
    per-stage memory and compute (each rank's chunks), its ``schedule`` record
    (``kind``, ``chunks``, the chunks' layers, ``predicted_step_by_kind_s`` for
    ``auto``) and the cost model of that kind.

    Raises
    ------
    ValueError
        If the kind cannot run the plan (e.g. fewer layers than chunks).
    """
    spec = plan_spec(plan)
    sched = cost.schedule
    table = None
    if sched.kind == "auto":
        best, table = choose_schedule(cost, spec, chunks=sched.chunks)
    else:
        best = predict(cost, spec, sched.kind, sched.chunks)
    cost = CostModel(cost.layers, cost.nodes, replace(sched, kind=best.kind, chunks=best.chunks))
    record = {**plan.schedule, "kind": best.kind, "chunks": best.chunks}
    record["chunk_layers"] = [[a, b] for _, a, b in best.chunk_layers]
    record["predicted_bubble_share"] = best.bubble_share
    if table is not None:
        record["predicted_step_by_kind_s"] = table
    S, parts = len(plan.stages), best.chunk_layers
    compute = [0.0] * S  # a rank's chunks' forward + backward per micro-batch
    for c, (i, a, b) in enumerate(parts):
        compute[c % S] += cost.stage_fwd(i, a, b) + cost.stage_bwd(i, a, b, c == len(parts) - 1)
    stages = [
        replace(st, memory_bytes=m, compute_s=t)
        for st, m, t in zip(plan.stages, best.memory_bytes, compute, strict=True)
    ]
    plan = replace(plan, stages=stages, predicted_step_time_s=best.step_time_s, schedule=record)
    return plan, cost


def make_federated_plan(  # noqa: PLR0913
    layers: Sequence[LayerProfile],
    nodes: Sequence[NodeProfile],
    samples: Mapping[str, int],
    schedule: Schedule,
    allocation: str,
    *,
    local_epochs: float = 1.0,
    steps_per_round: int = 0,
    time_limit_s: float = MILP_TIME_LIMIT_S,
    alternatives: bool = True,
    log_tables: bool = True,
) -> FederatedPlanned:
    """One pipeline per data owner (:func:`sky_flower.core.federated.plan_federation`),
    logged unless ``log_tables`` is false (a re-planning candidate is logged only if
    taken); ``alternatives``: also plan the other allocations on this benchmark.

    Raises
    ------
    ValueError
        If the configured allocation has no feasible plan (e.g. memory:
        ``InfeasibleMemoryError`` names the owner), or a relay stage's state is over
        Flower's size limit (:class:`StageStateTooLargeError`).
    """

    def solve(method: str) -> FederatedPlan:
        return plan_federation(
            list(layers),
            list(nodes),
            samples,
            schedule.for_search(),
            method,
            local_epochs=local_epochs,
            steps_per_round=steps_per_round,
            time_limit_s=time_limit_s,
        )

    fplan = solve(allocation)
    planned = tuple(owner_planned(p, layers, nodes, schedule) for p in fplan.pipelines)
    if log_tables:
        log_plan_tables(fplan, planned, allocation)
    check_state_limit(planned, [p.owner for p in fplan.pipelines])  # before any training
    steps = {allocation: max(p.plan.predicted_step_time_s for p in fplan.pipelines)}
    rounds: dict[str, float | None] = {allocation: fplan.round_time_s}
    for method in METHODS if alternatives else ():
        if method == allocation:
            continue
        try:
            other = solve(method)
            owners = [p.owner for p in other.pipelines]
            check_state_limit(
                [owner_planned(p, layers, nodes, schedule) for p in other.pipelines], owners
            )
            steps[method] = max(p.plan.predicted_step_time_s for p in other.pipelines)
            rounds[method] = other.round_time_s
        except ValueError:  # e.g. even does not fit memory, or a relay stage Flower's limit
            steps[method], rounds[method] = None, None
    if alternatives:
        steps, rounds = {m: steps[m] for m in METHODS}, {m: rounds[m] for m in METHODS}
        log(
            INFO,
            "Predicted round time on this benchmark: %s (FedAvg: %s)",
            ", ".join(
                f"{m} {'infeasible' if t is None else f'{t:.3f} s'}" for m, t in rounds.items()
            ),
            "infeasible"
            if fplan.fedavg_round_time_s is None
            else f"{fplan.fedavg_round_time_s:.3f} s",
        )
    return FederatedPlanned(fplan, planned, steps, rounds)


def log_plan_tables(fplan: FederatedPlan, planned: tuple[Planned, ...], allocation: str) -> None:
    """Log the federated plan's table (on ``stream``, then each pipeline's predicted
    stage-session set-up: :func:`setup_lines`) and each pipeline's stage table."""
    text = "\n".join([fplan.table(), *setup_lines(fplan, planned)])
    log(INFO, "Federated plan (%s), one pipeline per data owner:\n%s", allocation, text)
    for p, pl in zip(fplan.pipelines, planned, strict=True):
        log(INFO, "Pipeline of %s (%s):\n%s", p.owner, allocation, pl.plan.table())


def setup_lines(fplan: FederatedPlan, planned: Sequence[Planned]) -> list[str]:
    """The predicted stage-session set-up of each pipeline (:func:`session_setup_s`, s),
    as lines under the federated plan's table; none where nothing is predicted (a
    transport other than ``stream``)."""
    setups = [session_setup_s(pl) for pl in planned]
    if not any(setups):
        return []
    return [
        "predicted stage-session set-up (stream; once per session, in the round that "
        "sets it up, not in the round times above):",
        *(
            f"  {p.owner:<12} {t:.3f} s" if t > 0 else f"  {p.owner:<12} not predicted"
            for p, t in zip(fplan.pipelines, setups, strict=True)
        ),
    ]


@dataclass(frozen=True)
class PipelineRun:
    """One owner's pipeline as a round runs it.

    Attributes
    ----------
    owner : str
        The data owner (stage 0).
    samples : int
        The owner's training samples.
    steps : int
        Training steps this pipeline runs per round.
    pipeline : Pipeline
        What the runner executes.
    after : tuple[int, ...]
        Indices of the pipelines that must finish before this one starts.
    start_s, time_s : float
        Predicted start (seconds from the round's start) and duration.
    """

    owner: str
    samples: int
    steps: int
    pipeline: Pipeline
    after: tuple[int, ...] = ()
    start_s: float = 0.0
    time_s: float = 0.0


def pipeline_runs(
    fp: FederatedPlanned,
    nodes: Sequence[NodeProfile],
    node_ids: Mapping[str, int],
    handler_rate: Mapping[str, float] | None = None,
) -> list[PipelineRun]:
    """What a federated round runs: one :class:`PipelineRun` per owner pipeline."""
    return [
        PipelineRun(
            owner=p.owner,
            samples=p.samples,
            steps=p.steps,
            pipeline=pipeline(pl, nodes, node_ids, handler_rate),
            after=tuple(p.after),
            start_s=p.start_s,
            time_s=p.time_s,
        )
        for p, pl in zip(fp.fplan.pipelines, fp.planned, strict=True)
    ]
