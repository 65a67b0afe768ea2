"""Main job: ``python -m sky_flower.run [allocation=even|heuristic|optimal] [fleet=...]``.

``strategy=dpsgd|d2|dsgt|detag`` runs a decentralized strategy instead
(:mod:`sky_flower.jobs.decentralized`), ``strategy=hermes|bsp|asp|ssp`` Hermes or its
baselines (:mod:`sky_flower.jobs.hermes`); the default ``strategy=sky`` is the job below.

A Hydra app (``conf/config.yaml``; groups ``allocation``, ``fleet``, ``model``,
``dataset``) that starts Flower's simulation engine with one SuperNode per fleet node,
runs the Sky strategy (benchmark round, plan, split training) for ``num_rounds``
rounds, prints the plan and a per-round table, and writes into Hydra's output
directory: ``benchmark.json``, ``plan.json``, ``results.json`` and ``model.pt`` (the last
good global model's state dict).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from sky_flower.core.cost import Schedule
from sky_flower.core.partition import METHODS
from sky_flower.emulation.devices import expand_fleet
from sky_flower.pipeline.data import Split, load_split
from sky_flower.pipeline.models import build_model


def _conf_dir() -> str:
    here = Path(__file__).resolve().parent
    installed = here / "conf"  # pip install . puts conf/ here (see pyproject)
    return str(installed if (installed / "config.yaml").exists() else here.parent / "conf")


def simulation_cpus(cfg: DictConfig) -> tuple[int, float]:
    """``(CPUs of this machine, cfg.simulation.num_cpus_per_node)``.

    Raises
    ------
    ValueError
        If a node's CPU share is not in ``(0, CPUs]`` (Ray could not place a node).
    """
    cpus, per_node = os.cpu_count() or 1, float(cfg.simulation.num_cpus_per_node)
    if not 0 < per_node <= cpus:
        raise ValueError(
            f"simulation.num_cpus_per_node={per_node:g} must be in (0, {cpus}] (this machine "
            f"has {cpus} CPUs; Ray could not place a single node)"
        )
    return cpus, per_node


def direct_concurrency_check(num_nodes: int, cpus: int, per_node: float) -> None:
    """``transport=direct`` runs every stage of a round at the same time; the simulation
    engine runs ``floor(cpus / per_node)`` nodes at once. The planner may use every
    node, so all of them must fit.

    Raises
    ------
    ValueError
        If fewer than ``num_nodes`` simulated nodes can run at once.
    """
    slots = int(cpus / per_node + 1e-9)
    if slots < num_nodes:
        raise ValueError(
            f"transport=direct runs all stages of a round at once, but with "
            f"simulation.num_cpus_per_node={per_node:g} on {cpus} CPUs the simulation engine "
            f"runs only {slots} of the fleet's {num_nodes} nodes at a time: lower "
            f"simulation.num_cpus_per_node to <= {cpus / num_nodes:g}"
        )


def evaluate_fn_for(model_fn: Callable[[], torch.nn.Module], test: Split) -> Callable:
    """Server-side evaluation on the held-out test split: ``{"accuracy", "loss"}``."""
    from flwr.app import ArrayRecord, MetricRecord

    x, y = torch.from_numpy(test.x), torch.from_numpy(test.y)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = model_fn()
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            out = model(x)
            loss = float(torch.nn.functional.cross_entropy(out, y))
            acc = float((out.argmax(1) == y).float().mean())
        return MetricRecord({"accuracy": acc, "loss": loss})

    return evaluate


def write_results(
    out_dir: Path,
    allocation: str,
    fleet: str,
    rounds: list[dict],
    error: str | None,
    failed_rounds: list[dict] | None = None,
) -> dict[str, Any]:
    """Write ``results.json`` (also for a job refused before it started) and return it."""
    results = {
        "allocation": allocation,
        "fleet": fleet,
        "final_test_accuracy": next(
            (r["test_accuracy"] for r in reversed(rounds) if r.get("test_accuracy") is not None),
            None,
        ),  # of the last good round (a failed round keeps the previous global model)
        "rounds": rounds,
        "error": error,
        "failed_rounds": failed_rounds or [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def _one_log_stream() -> None:
    """Flower's logger prints to the console itself; also send its lines to the job's
    ``run.log`` (Hydra's file handler on the root logger) without printing them twice."""
    flwr_logger = logging.getLogger("flwr")
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:  # no Hydra logging (e.g. called from a test): leave Flower as it is
        return
    flwr_logger.propagate = False
    for handler in list(flwr_logger.handlers):  # a previous multirun job's file
        if isinstance(handler, logging.FileHandler) and handler not in files:
            flwr_logger.removeHandler(handler)
    for handler in files:
        if handler not in flwr_logger.handlers:
            flwr_logger.addHandler(handler)


def run_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Run the main job for ``cfg``; write JSON files to ``out_dir``; return results.

    Every setting is validated before Flower starts (unknown allocation, fleet keys,
    schedule, model), so bad input fails before any node is contacted.

    Raises
    ------
    ValueError
        On invalid configuration.
    sky_flower.strategies.sky.SkyNodeError
        If a node fails; ``results.json`` is still written with the rounds done.
    """
    from flwr.app import ArrayRecord, Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from sky_flower.sky.client import SkyClient, fleet_emulation, owner_data_fn
    from sky_flower.strategies.sky import SkyStrategy

    if _hermes(cfg):  # strategy=hermes|bsp|asp|ssp: sky_flower/jobs/hermes.py
        from sky_flower.jobs.hermes import run_hermes_job

        return run_hermes_job(cfg, out_dir)
    if _decentralized(cfg):  # strategy=dpsgd|d2|dsgt|detag: sky_flower/jobs/decentralized.py
        from sky_flower.jobs.decentralized import run_decentralized_job

        return run_decentralized_job(cfg, out_dir)
    method = str(cfg.allocation.method)
    if method not in METHODS:
        raise ValueError(f"unknown allocation {method!r}: choose one of {', '.join(METHODS)}")
    fleet = expand_fleet(OmegaConf.to_container(cfg.fleet, resolve=True))  # type: ignore[arg-type]
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    dataset = OmegaConf.to_container(cfg.dataset, resolve=True)
    assert isinstance(model_cfg, dict) and isinstance(dataset, dict)
    if model_cfg.get("planning_only"):  # e.g. bert_large: profiled from shapes, never built
        raise ValueError(
            f"model {model_cfg.get('name')!r} is for planning only (planning_only: true) and "
            "cannot be trained by sky_flower.run: use `python -m sky_flower.plan "
            f"model={model_cfg.get('name')}` instead"
        )
    model_fn = partial(build_model, model_cfg)
    model_fn()  # fail early on a bad model config
    schedule = Schedule(
        batch_size=int(cfg.schedule.batch_size),
        microbatches=int(cfg.schedule.microbatches),
        kind=str(cfg.schedule.kind),  # type: ignore[arg-type]
        transport=str(cfg.schedule.transport),  # type: ignore[arg-type]
        microbatches_per_message=int(cfg.schedule.get("microbatches_per_message", 0)),
    )
    cpus, per_node = simulation_cpus(cfg)
    if schedule.transport == "direct":
        direct_concurrency_check(len(fleet), cpus, per_node)
    if int(cfg.num_rounds) < 1:
        raise ValueError(f"num_rounds must be >= 1, got {cfg.num_rounds}")
    if not float(cfg.allocation.get("time_limit_s", 30.0)) > 0:
        raise ValueError(
            f"allocation.time_limit_s must be > 0 seconds, got {cfg.allocation.time_limit_s}"
        )
    max_nodes = int(cfg.simulation.get("max_nodes", 16))
    if len(fleet) > max_nodes:
        raise ValueError(
            f"the fleet has {len(fleet)} nodes; this job simulates every node in Flower's "
            f"simulation engine on {cpus} CPUs and benchmarks them one at a time, which "
            f"allows at most simulation.max_nodes={max_nodes}. Use a smaller fleet (e.g. "
            "fleet.nodes=8), preview large fleets with `python -m sky_flower.plan`, or "
            "raise simulation.max_nodes"
        )
    owners = [n for n in fleet if n.holds_data]
    train, test = load_split(dataset["name"], float(dataset["test_fraction"]), int(cfg.seed))
    smallest = len(train) // len(owners)  # np.array_split: the smallest partition
    if schedule.batch_size > smallest:
        raise ValueError(
            f"schedule.batch_size={schedule.batch_size} is larger than the data owner's "
            f"{smallest} training examples: lower schedule.batch_size"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    _one_log_stream()

    def write(name: str, payload: Any) -> None:
        (out_dir / name).write_text(json.dumps(payload, indent=2, default=str))

    def on_event(kind: str, payload: dict) -> None:
        if kind in ("benchmark", "plan"):
            write(f"{kind}.json", payload)

    strategy = SkyStrategy(
        model_fn=model_fn,
        input_shape=list(model_cfg["input_shape"]),
        allocation=method,
        schedule=schedule,
        optimizer=str(cfg.train.optimizer),
        lr=float(cfg.train.lr),
        local_epochs=float(cfg.train.local_epochs),
        steps_per_round=int(cfg.train.steps_per_round),
        node_order=[n.name for n in fleet],
        min_nodes=len(fleet),
        milp_time_limit_s=float(cfg.allocation.time_limit_s),
        benchmark_warmup=int(cfg.benchmark.warmup),
        benchmark_repeats=int(cfg.benchmark.repeats),
        echo_bytes=tuple(int(b) for b in cfg.benchmark.echo_bytes),  # type: ignore[arg-type]
        echo_repeats=int(cfg.benchmark.echo_repeats),
        echo_jitter_s=float(cfg.benchmark.echo_jitter_s),
        state_probe_bytes=int(cfg.benchmark.state_probe_mb * 2**20),
        message_timeout_s=float(cfg.message_timeout_s),
        max_failed_rounds=int(cfg.train.get("max_failed_rounds", 1)),
        direct_timeout_s=float(cfg.schedule.get("direct_timeout_s", 30.0)),
        direct_host=str(cfg.schedule.get("direct_host", "127.0.0.1")),
        direct_join_timeout_s=float(cfg.schedule.get("direct_join_timeout_s", 60.0)),
        seed=int(cfg.seed),
        on_event=on_event,
    )
    strategy.precheck(
        [n.name for n in fleet],
        [None if n.memory_mb is None else n.memory_mb * 2**20 for n in fleet],
    )
    evaluate = evaluate_fn_for(model_fn, test)
    torch.manual_seed(int(cfg.seed))
    initial = ArrayRecord(model_fn().state_dict())

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy.start(
            grid=grid, initial_arrays=initial, num_rounds=int(cfg.num_rounds), evaluate_fn=evaluate
        )

    client_app = SkyClient(
        model_fn=model_fn,
        load_data=owner_data_fn(
            fleet, dataset["name"], float(dataset["test_fraction"]), int(cfg.seed)
        ),
        emulation_fn=fleet_emulation(fleet),
    ).register(ClientApp())

    error: str | None = None
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=len(fleet),
            backend_config={
                "client_resources": {
                    "num_cpus": per_node,
                    "num_gpus": 0.0,
                },
                "init_args": {"num_cpus": cpus, "logging_level": "error"},
            },
        )
    except BaseException as err:  # noqa: BLE001 - recorded, then re-raised
        strategy.request_stop()  # the ServerApp thread may still be waiting on nodes
        cause = err.__cause__ or err
        error = f"{type(cause).__name__}: {cause}"
        raise
    finally:
        rounds = [
            {
                k: r.get(k)
                for k in (
                    "round",
                    "train_loss",
                    "test_accuracy",
                    "measured_step_time_s",
                    "predicted_step_time_s",
                    "train_accuracy",
                    "test_loss",
                    "steps",
                    "round_time_s",
                    "microbatches_per_message",
                    "stages",
                    "setup_s",
                    "error",
                )
            }
            for r in strategy.rounds
        ]
        results = write_results(
            out_dir, method, str(cfg.fleet.name), rounds, error, strategy.failed_rounds
        )
        if strategy.global_arrays is not None:  # last good global model
            torch.save(strategy.global_arrays.to_torch_state_dict(), out_dir / "model.pt")
    return results


def _decentralized(cfg: DictConfig) -> bool:
    """True for ``strategy=dpsgd|d2|dsgt|detag`` (see ``sky_flower.jobs.decentralized``)."""
    return str(OmegaConf.select(cfg, "strategy.name", default="sky")) != "sky" and not _hermes(cfg)


def _hermes(cfg: DictConfig) -> bool:
    """True for ``strategy=hermes|bsp|asp|ssp`` (see ``sky_flower.jobs.hermes``)."""
    from sky_flower.jobs.hermes import is_hermes

    return is_hermes(cfg)


@hydra.main(config_path=_conf_dir(), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point. A failed job exits 1; in a multirun it is recorded (its
    ``results.json`` carries the error) and the sweep goes on."""
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    if _hermes(cfg):
        from sky_flower.jobs.hermes import main_hermes

        return main_hermes(cfg, out_dir, hydra_cfg.mode == RunMode.MULTIRUN)
    if _decentralized(cfg):
        from sky_flower.jobs.decentralized import main_decentralized

        return main_decentralized(cfg, out_dir, hydra_cfg.mode == RunMode.MULTIRUN)
    log = logging.getLogger("sky_flower")
    try:
        results = run_job(cfg, out_dir)
    except Exception as err:  # noqa: BLE001
        cause = err.__cause__ or err
        log.error("run failed: %s (outputs in %s)", cause, out_dir)
        if not (out_dir / "results.json").exists():  # refused before it started
            error = f"{type(cause).__name__}: {cause}"
            write_results(
                out_dir, str(cfg.allocation.get("method")), str(cfg.fleet.get("name")), [], error
            )
        if hydra_cfg.mode == RunMode.MULTIRUN:
            return
        raise SystemExit(1) from None
    log.info(
        "[%s on %s]: final test accuracy %.4f; outputs in %s",
        results["allocation"],
        results["fleet"],
        results["final_test_accuracy"],
        out_dir,
    )


if __name__ == "__main__":
    main()
