"""The planner job behind ``python -m sky_flower.plan`` (:mod:`sky_flower.plan`, the
Hydra entry point): plan without training.

A Hydra app (``conf/plan.yaml``; the training job's groups ``allocation``, ``fleet``,
``model``) that builds the planning problem from the config, partitions it, prints the
plan table and a one-line summary, and writes into Hydra's output directory:

* ``plan.json``: :meth:`Plan.to_dict` plus ``problem`` (model, fleet, entries, nodes,
  where node times came from) and ``alternatives`` (the other allocations' predicted
  step time, period, lower bound and solve time; only with ``plan.compare_methods=true``,
  else null);
* ``plan.txt``: the plan table;
* ``plan_row.json``: the job's row of a sweep (:mod:`sky_flower.plan_sweep` collects them
  into ``plan_sweep.csv`` and ``plan_sweep.png``), written for failed jobs too.

No Flower is involved. Node times come from, in order:

* a fleet with a node count and ``flops_per_s`` (``fleet=skycomputing``):
  :func:`sky_flower.core.fleets.synthetic_node_profiles` (FLOPs / rate x (1 + slowdown));
* any other fleet: the fleet's emulation. Each layer is timed once on this host
  (:func:`sky_flower.core.profile.time_layers`) and node ``i`` takes ``1 + slowdown_i`` times
  that; memory is ``memory_mb`` (else what psutil reports as available), latency and
  bandwidth are the fleet's. A model that cannot be built (``planning_only``, e.g.
  ``bert_large``) needs ``+fleet.flops_per_s=...`` here instead of host timing.

Node latency here is the fleet's emulated latency only: Flower's per-message costs
(polling tick, ``context.state`` shipping) are measured by the training job's benchmark
round, so ``schedule.transport=relay`` predictions are lower than the training job's.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from sky_flower.core.bert import bert_layer_profiles
from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.example import as_dtype
from sky_flower.core.fleets import (
    SKYCOMPUTING_SEED,
    skycomputing_slowdowns,
    synthetic_node_profiles,
)
from sky_flower.core.partition import METHODS, OBJECTIVES, InfeasibleMemoryError, Plan, partition
from sky_flower.core.profile import (
    LayerProfile,
    NodeProfile,
    default_optimizer_factory,
    profile_layers,
    time_layers,
)
from sky_flower.emulation.devices import expand_fleet
from sky_flower.jobs.common import write_json  # strictly valid JSON (NaN/inf: null)
from sky_flower.pipeline.models import build_model
from sky_flower.sky.settings import SkySettings

MIB = 2**20
ROW_FILE = "plan_row.json"
MAX_PLAN_NODES = 10_000  # nodes in a planned fleet
MAX_TIMED_MICROBATCH = 8192  # samples per micro-batch when profiling a built model here
log = logging.getLogger("sky_flower.plan")


# --------------------------------------------------------------------------------------
# config -> planning problem
# --------------------------------------------------------------------------------------
def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def check_config(cfg: DictConfig) -> SkySettings:
    """Refuse settings the planner cannot use, before any work: the plan's objective
    here, every other setting as every entry point reads them
    (:meth:`SkySettings.from_hydra`: allocation and its time limit, the schedule, the
    optimizer, the benchmark's timing, the seed).

    Returns
    -------
    SkySettings
        The config's settings.

    Raises
    ------
    ValueError
        On an unknown objective, or a setting ``from_hydra`` refuses (an unknown
        allocation, a non-positive time limit, micro-batches that do not divide the
        batch, a kind the transport cannot run, in the training job's words).
    """
    if str(cfg.objective) not in OBJECTIVES:
        raise ValueError(f"unknown objective {cfg.objective!r}: use one of {', '.join(OBJECTIVES)}")
    return SkySettings.from_hydra(cfg)


def _model_layers(
    model_cfg: dict, schedule: Schedule, optimizer: str
) -> tuple[list[LayerProfile], nn.Sequential | None]:
    """Layer profiles of the configured model, and the model if it can be built."""
    name = str(model_cfg.get("name") or model_cfg.get("_target_"))
    if name.startswith("bert"):
        kwargs = {k: v for k, v in model_cfg.items() if k not in ("name", "planning_only")}
        try:
            return bert_layer_profiles(**kwargs, optimizer=optimizer), None
        except TypeError as err:
            raise ValueError(f"bad model config for {name}: {err}") from err
    if model_cfg.get("planning_only"):
        raise ValueError(f"model {name!r} is planning_only but the planner cannot profile it")
    if schedule.microbatch_size > MAX_TIMED_MICROBATCH:
        raise ValueError(
            f"micro-batches of {schedule.microbatch_size} samples are too large to profile "
            f"on this host (at most {MAX_TIMED_MICROBATCH}): lower schedule.batch_size or "
            "raise schedule.microbatches"
        )
    model = build_model(model_cfg)
    if "input_shape" not in model_cfg:
        raise ValueError(
            f"model {name!r} needs input_shape (one sample's shape) to be profiled: the "
            "planner has no data to take it from (the training job does). Set it, e.g. "
            "+model.input_shape=[64]"
        )
    layers = profile_layers(
        model,
        input_shape=list(model_cfg["input_shape"]),
        microbatch_size=schedule.microbatch_size,
        make_optimizer=default_optimizer_factory(optimizer),
        dtype=as_dtype(model_cfg.get("input_dtype")),
    )
    return layers, model


def _fleet_nodes(
    cfg: DictConfig,
    settings: SkySettings,
    fleet_cfg: dict,
    layers: list[LayerProfile],
    model: nn.Sequential | None,
    schedule: Schedule,
) -> tuple[list[NodeProfile], str]:
    """Node profiles of the configured fleet, and where their times came from."""
    nodes = fleet_cfg.get("nodes")
    mb = schedule.microbatch_size
    rate = fleet_cfg.get("flops_per_s")
    if rate is not None and (not float(rate) > 0 or math.isinf(float(rate))):
        raise ValueError(f"fleet.flops_per_s must be a positive finite rate, got {rate}")
    if isinstance(nodes, int) and not isinstance(nodes, bool) and rate is not None:
        if not 1 <= nodes <= MAX_PLAN_NODES:
            raise ValueError(
                f"fleet.nodes must be in [1, {MAX_PLAN_NODES}], got {nodes} (the planner "
                "keeps per-node arrays of every layer's time)"
            )
        if fleet_cfg.get("memory_mb") is None:
            raise ValueError("fleet.memory_mb must be set (MiB per node) to plan this fleet")
        bandwidth = fleet_cfg.get("bandwidth_mb_s")
        seed = int(fleet_cfg.get("seed", SKYCOMPUTING_SEED))
        profiles = synthetic_node_profiles(
            layers,
            skycomputing_slowdowns(nodes, seed),
            microbatch_size=mb,
            flops_per_s=float(rate),
            memory_bytes=int(float(fleet_cfg["memory_mb"]) * MIB),
            latency_s=float(fleet_cfg.get("latency_ms") or 0.0) / 1000.0,
            bandwidth_bps=math.inf if bandwidth is None else float(bandwidth) * 1e6,
        )
        return profiles, f"flops_per_s={float(rate):g}"
    fleet = expand_fleet({k: v for k, v in fleet_cfg.items() if k != "flops_per_s"})
    if rate is not None:  # a nominal rate beats host timing when the fleet gives one
        fwd = [lp.fwd_flops * mb / float(rate) for lp in layers]
        bwd = [lp.bwd_flops * mb / float(rate) for lp in layers]
        source = f"flops_per_s={float(rate):g}"
    elif model is not None:
        input_shape = list(cfg.model.input_shape)
        fwd, bwd = time_layers(
            model,
            input_shape,
            mb,
            warmup=settings.benchmark.warmup,
            repeats=settings.benchmark.repeats,
            dtype=as_dtype(cfg.model.get("input_dtype")),
        )
        source = "host timing x (1 + slowdown)"
    else:
        raise ValueError(
            f"model {cfg.model.name!r} is profiled from shapes, not built, so it cannot be "
            f"timed on this host for fleet {fleet_cfg.get('name')!r}: give the fleet a "
            "nominal rate, e.g. +fleet.flops_per_s=1e12, or use fleet=skycomputing"
        )
    profiles = [
        NodeProfile(
            name=e.name,
            layer_fwd_s=tuple(t * (1.0 + e.slowdown) for t in fwd),
            layer_bwd_s=tuple(t * (1.0 + e.slowdown) for t in bwd),
            memory_bytes=e.memory_bytes(),
            latency_s=e.latency_ms / 1000.0,
            bandwidth_bps=math.inf if not e.bandwidth_mb_s else e.bandwidth_mb_s * 1e6,
            holds_data=e.holds_data,
            slowdown=e.slowdown,
        )
        for e in fleet
    ]
    return profiles, source


def build_planning_problem(
    cfg: DictConfig,
) -> tuple[list[LayerProfile], list[NodeProfile], Schedule]:
    """Turn a planner config (``conf/plan.yaml`` composed) into a planning problem.

    Parameters
    ----------
    cfg : DictConfig
        Needs ``model``, ``fleet``, ``schedule``; optionally ``train.optimizer``
        (default adam), ``seed`` and ``benchmark.warmup`` / ``benchmark.repeats`` (host
        timing).

    Returns
    -------
    (layers, nodes, schedule)
        Layer profiles in model order (``bert*`` models from
        :func:`sky_flower.core.bert.bert_layer_profiles`, others built with
        :func:`sky_flower.pipeline.models.build_model` and profiled), node profiles in fleet order
        (see the module docstring for where their times come from) and the schedule.

    Raises
    ------
    ValueError
        On a bad schedule (micro-batches not dividing the batch, unknown kind), model
        or fleet config.
    """
    layers, nodes, schedule, _ = _build(cfg, SkySettings.from_hydra(cfg))
    return layers, nodes, schedule


def _build(
    cfg: DictConfig, settings: SkySettings
) -> tuple[list[LayerProfile], list[NodeProfile], Schedule, str]:
    """:func:`build_planning_problem` plus where the node times came from."""
    schedule = settings.schedule_object()
    model_cfg, fleet_cfg = _plain(cfg.model), _plain(cfg.fleet)
    assert isinstance(model_cfg, dict) and isinstance(fleet_cfg, dict)
    torch.manual_seed(settings.seed)  # each job alike, whatever ran before it
    layers, model = _model_layers(model_cfg, schedule, settings.train.optimizer)
    nodes, source = _fleet_nodes(cfg, settings, fleet_cfg, layers, model, schedule)
    return layers, nodes, schedule, source


# --------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------
def _fleet_size(fleet_cfg: Any) -> int | None:
    nodes = fleet_cfg.get("nodes") if isinstance(fleet_cfg, dict) else None
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        return nodes
    return len(nodes) if isinstance(nodes, list) else None


def _base_row(cfg: DictConfig) -> dict[str, Any]:
    """The sweep row's config columns (read defensively: the config may be bad)."""
    model, fleet = _plain(cfg.get("model")) or {}, _plain(cfg.get("fleet")) or {}
    sched = _plain(cfg.get("schedule")) or {}
    return {
        "model": model.get("name") or model.get("_target_"),
        "fleet": fleet.get("name"),
        "nodes": _fleet_size(fleet),
        "num_layers": model.get("num_layers", model.get("hidden_layers")),
        "entries": None,
        "allocation": (_plain(cfg.get("allocation")) or {}).get("method"),
        "objective": cfg.get("objective"),
        "microbatches": sched.get("microbatches"),
        "kind": sched.get("kind"),
        "transport": sched.get("transport"),
        "predicted_step_time_s": None,
        "period_s": None,
        "lower_bound_s": None,
        "ratio_to_lower_bound": None,
        "solve_time_s": None,
        "proven_optimal": None,
        "idle_nodes": None,
        "status": "error",
        "error": None,
    }


def _summary(plan: Plan) -> dict[str, Any]:
    return {
        "predicted_step_time_s": plan.predicted_step_time_s,
        "period_s": plan.period_s,
        "lower_bound_s": plan.lower_bound_s,
        "ratio_to_lower_bound": (
            plan.objective_value_s / plan.lower_bound_s if plan.lower_bound_s > 0 else None
        ),
        "solve_time_s": plan.solve_time_s,
        "proven_optimal": plan.proven_optimal,
    }


def plan_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Plan ``cfg``; write ``plan.json``, ``plan.txt`` and ``plan_row.json`` to ``out_dir``.

    ``plan_row.json`` is written whatever happens, with ``status`` ``ok``,
    ``infeasible`` (no split fits memory), ``refused`` (the method does not apply, e.g.
    ``even`` with more nodes than layers) or ``error`` (bad config), and the message.

    Returns
    -------
    dict
        ``plan`` (plan.json's contents) and ``row`` (the sweep row).

    Raises
    ------
    InfeasibleMemoryError
        If no split fits the nodes' memory.
    ValueError
        On a bad config (before any profiling or solving) or a method that does not apply.
    """
    row = _base_row(cfg)
    try:
        settings = check_config(cfg)  # cheap checks before profiling
        layers, nodes, schedule, source = _build(cfg, settings)
        row["entries"], row["nodes"] = len(layers), len(nodes)
        cost = CostModel(layers, nodes, schedule)
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"
        write_json(out_dir / ROW_FILE, row)
        raise
    method, objective = settings.allocation.method, str(cfg.objective)
    limit = settings.allocation.time_limit_s
    try:
        plan = partition(cost, method, objective=objective, time_limit_s=limit)
    except ValueError as err:
        row["status"] = "infeasible" if isinstance(err, InfeasibleMemoryError) else "refused"
        row["error"] = f"{type(err).__name__}: {err}"
        write_json(out_dir / ROW_FILE, row)
        raise
    alternatives: dict[str, Any] | None = None
    if bool(cfg.get("plan", {}).get("compare_methods", False)):
        alternatives = {}
        for other in METHODS:
            if other == method:
                continue
            try:
                alt = partition(cost, other, objective=objective, time_limit_s=limit)
                alternatives[other] = {**_summary(alt), "note": alt.note, "error": None}
            except ValueError as err:
                alternatives[other] = {"error": f"{type(err).__name__}: {err}"}
    payload = plan.to_dict()
    payload["problem"] = {
        "model": row["model"],
        "fleet": row["fleet"],
        "num_layers": row["num_layers"],
        "entries": len(layers),
        "layer_names": [lp.name for lp in layers],
        "nodes": [n.name for n in nodes],
        "slowdowns": [n.slowdown for n in nodes],
        "node_times_from": source,
        "time_limit_s": limit,
    }
    payload["alternatives"] = alternatives
    steps = settings.train.steps_per_round
    payload["pipelines"] = federated_preview(layers, nodes, schedule, method, limit, steps)
    row.update(_summary(plan), idle_nodes=len(plan.idle_nodes), status="ok")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "plan.json", payload)
    (out_dir / "plan.txt").write_text(plan.table() + "\n")
    write_json(out_dir / ROW_FILE, row)
    return {"plan": payload, "row": row, "table": plan.table()}


def federated_preview(  # noqa: PLR0913
    layers: list[LayerProfile],
    nodes: list[NodeProfile],
    schedule: Schedule,
    method: str,
    limit: float,
    steps: int = 0,
) -> list[dict[str, Any]] | None:
    """With two or more data owners, the training job plans one pipeline per owner
    (FedAvg across, :func:`sky_flower.core.federated.plan_federation`), not the single
    pipeline above: plan that too and log it. Every owner is given equal data (the job
    takes each owner's real sample count from its benchmark round), with ``steps``
    (``train.steps_per_round``) steps when it is > 0. None with one data owner.

    Returns
    -------
    list of dict or None
        One ``{"owner", "stages": [[node, first, last], ...], "predicted_step_time_s"}``
        per pipeline.
    """
    from sky_flower.core.federated import plan_federation

    owners = [n.name for n in nodes if n.holds_data]
    if len(owners) < 2:
        return None
    fplan = plan_federation(
        layers,
        nodes,
        dict.fromkeys(owners, 1000),
        schedule,
        method,
        steps_per_round=steps or 1,
        time_limit_s=limit,
    )
    log.info(
        "%d data owners: the training job runs one pipeline per owner (FedAvg across), "
        "planned here with equal data per owner:\n%s",
        len(owners),
        fplan.table(),
    )
    return [
        {
            "owner": p.owner,
            "stages": [[st.node, st.first_layer, st.last_layer] for st in p.plan.stages],
            "predicted_step_time_s": p.plan.predicted_step_time_s,
        }
        for p in fplan.pipelines
    ]


def summary_line(row: dict[str, Any]) -> str:
    """One line: method, problem size, predicted step, period, bound ratio, solve time."""
    ratio = row["ratio_to_lower_bound"]
    return (
        f"[{row['allocation']}, {row['objective']}: {row['model']} ({row['entries']} entries) "
        f"on {row['fleet']} ({row['nodes']} nodes)]: predicted step "
        f"{row['predicted_step_time_s']:.4f} s, period {row['period_s']:.4f} s/micro-batch, "
        + (f"{ratio:.3f}x the lower bound, " if ratio is not None else "")
        + f"solved in {row['solve_time_s']:.2f} s"
        + (", proven optimal" if row["proven_optimal"] else "")
        + (f", {row['idle_nodes']} idle" if row["idle_nodes"] else "")
    )
