"""The main job of the entry point: ``python -m sky_flower.run [allocation=...] [fleet=...]``.

Starts Flower's simulation engine with one SuperNode per fleet node, runs the Sky
strategy (benchmark round, plan, split training) for ``num_rounds`` rounds, prints the
plan and a per-round table, and writes into the job's output directory:
``benchmark.json``, ``plan.json``, ``results.json`` (:func:`sky_flower.jobs.common.
sky_results`) and ``model.pt`` (the last good global model's state dict). Its settings
are :class:`sky_flower.sky.settings.SkySettings` (``SkySettings.from_hydra``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from sky_flower.emulation.devices import check_fleet_devices, expand_fleet
from sky_flower.jobs.common import (
    SkyRecorder,
    model_and_data,
    number,
    one_log_stream,
    save_model,
    simulate,
    simulation_cpus,
    sky_results,
    untrained,
    write_json,
)
from sky_flower.pipeline.data import Split
from sky_flower.pipeline.lm import lm_cross_entropy, perplexity
from sky_flower.pipeline.objective import correct_count
from sky_flower.sky.settings import SkySettings


def simulation_gpus(devices: Mapping[str, str], gpus: int) -> float:
    """Ray GPUs per simulated node (Flower's nodes all ask for the same; Ray hides the
    GPUs from a node that asks for none): 0 unless a node's device (``devices``: name ->
    ``"cpu"`` / ``"cuda:N"``) is a GPU, else this machine's ``gpus`` shared evenly."""
    if gpus < 1 or not any(d.startswith("cuda") for d in devices.values()):
        return 0.0
    return min(1.0, gpus / max(len(devices), 1))


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


def evaluate_fn_for(
    model_fn: Callable[[], torch.nn.Module],
    test: Split,
    loss_fn: Callable[..., torch.Tensor] = torch.nn.functional.cross_entropy,
    metric_fn: Callable[..., int] = correct_count,
    chunk: int = 512,
    with_perplexity: bool | None = None,
    reduction: Any = None,  # noqa: ANN401 - a LossReduction (torch-free signature)
) -> Callable:
    """Server-side evaluation on the held-out test split: ``{"accuracy", "loss"}``, the
    objective's loss on the whole test set and its metric per label element
    (classification: the share of correct predictions), in eval mode, ``chunk`` samples
    at a time; ``with_perplexity``
    (default: when ``loss_fn`` is the language model's
    :func:`sky_flower.pipeline.lm.lm_cross_entropy`) also ``"perplexity"`` = exp(mean
    loss) (:func:`sky_flower.pipeline.lm.perplexity`). ``reduction`` (a
    :class:`sky_flower.pipeline.objective.LossReduction`, default ``mean``) says how
    the chunks' losses make the test set's: ``mean`` weighted by samples, ``sum``
    summed, ``weighted`` weighted by ``objective.weight`` of each chunk's labels; the
    loss reported is then the user's loss on the whole test set."""
    from flwr.app import ArrayRecord, MetricRecord

    from sky_flower.pipeline.sources import as_source, batches

    test = as_source(test)  # a Split, or a DataLoader's / datasets.Dataset's rows
    if with_perplexity is None:
        with_perplexity = loss_fn is lm_cross_entropy

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = model_fn()
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        loss, hits, total = 0.0, 0.0, 0.0
        kind = "mean" if reduction is None else reduction.kind
        with torch.no_grad():
            count = 0
            for xs, ys in batches(test, chunk):
                count += ys.numel()
                out = model(xs)
                if kind == "mean":
                    w = float(len(ys))
                elif kind == "sum":
                    w = 1.0
                else:
                    w = reduction.weight(ys)
                if w > 0:  # a chunk of padding only adds nothing (its mean is 0 / 0)
                    loss += float(loss_fn(out, ys)) * w
                total += w
                hits += float(metric_fn(out, ys))
        mean = loss if kind == "sum" else loss / total
        found = {"accuracy": hits / count, "loss": mean}
        if with_perplexity:
            found["perplexity"] = perplexity(mean)
        return MetricRecord(found)

    return evaluate


def _checked_inputs(cfg: DictConfig, settings: SkySettings) -> dict[str, Any]:
    """Everything the job needs from ``cfg``, checked before Flower starts.

    Raises
    ------
    ValueError
        On a planning-only or bad model, data set or objective
        (:func:`sky_flower.jobs.common.model_and_data`), a fleet the simulation cannot run
        (a node whose ``device`` asks for CUDA this machine lacks among them), a direct
        transport whose stages cannot all run at once, or a batch larger than the data
        owner's examples.
    """
    fleet = expand_fleet(OmegaConf.to_container(cfg.fleet, resolve=True))  # type: ignore[arg-type]
    devices = check_fleet_devices(fleet)  # a CUDA node on a machine without CUDA: refused here
    built = model_and_data(cfg, settings, settings.schedule.transport)
    schedule = settings.schedule_object()
    cpus, per_node = simulation_cpus(cfg)
    if schedule.transport == "direct":
        direct_concurrency_check(len(fleet), cpus, per_node)
    max_nodes = int(cfg.simulation.get("max_nodes", 16))
    if max_nodes < 1:
        raise ValueError(
            f"simulation.max_nodes={max_nodes}: the largest fleet this job simulates must "
            "be at least 1 node (default 16)"
        )
    if len(fleet) > max_nodes:
        raise ValueError(
            f"the fleet has {len(fleet)} nodes; this job simulates every node in Flower's "
            f"simulation engine on {cpus} CPUs and benchmarks them one at a time, which "
            f"allows at most simulation.max_nodes={max_nodes}. Use a fleet of at most "
            f"{max_nodes} nodes (another fleet file, or fleet.nodes=<n> where the fleet "
            "takes a size), preview large fleets with `python -m sky_flower.plan`, or "
            "raise simulation.max_nodes"
        )
    owners = [n for n in fleet if n.holds_data]
    train = built["train"]
    smallest = len(train) // len(owners)  # np.array_split: the smallest partition
    if schedule.batch_size > smallest:
        raise ValueError(
            f"schedule.batch_size={schedule.batch_size} is larger than the data owner's "
            f"{smallest} training examples: lower schedule.batch_size"
        )
    return {
        **built,
        "fleet": fleet,
        "cpus": cpus,
        "per_node": per_node,
        "gpus_per_node": simulation_gpus(devices, torch.cuda.device_count()),
    }


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
    from flwr.app import ArrayRecord
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid

    from sky_flower.sky.node.client import SkyClient, fleet_emulation, owner_data_fn
    from sky_flower.strategies.sky import EventCallback, SkyModel, SkyStrategy

    settings = SkySettings.from_hydra(cfg)
    inputs = _checked_inputs(cfg, settings)
    fleet, model_fn, dataset = inputs["fleet"], inputs["model_fn"], inputs["dataset"]
    out_dir.mkdir(parents=True, exist_ok=True)
    one_log_stream()

    def on_event(kind: str, payload: dict) -> None:
        if kind in ("benchmark", "plan"):
            write_json(out_dir / f"{kind}.json", payload)

    recorder = SkyRecorder(
        out_dir / "results.json", settings.allocation.method, str(cfg.fleet.name)
    )
    model = SkyModel.from_settings(
        model_fn, inputs["input_shape"], settings, input_dtype=inputs["input_dtype"]
    )
    strategy = SkyStrategy(
        model,
        settings,
        node_order=[n.name for n in fleet],
        min_nodes=len(fleet),
        hooks=[EventCallback(on_event), recorder],
        # the simulation engine's workers: the ClientApps it runs at once
        concurrent_clientapps=int(inputs["cpus"] / inputs["per_node"] + 1e-9),
    )
    strategy.precheck(
        [n.name for n in fleet],
        [None if n.memory_mb is None else n.memory_mb * 2**20 for n in fleet],
        holds_data=[n.holds_data for n in fleet],
    )
    evaluate = evaluate_fn_for(
        model_fn,
        inputs["test"],
        inputs["loss_fn"],
        inputs["metric_fn"],
        reduction=settings.objective.reduction_object(),
    )
    torch.manual_seed(settings.seed)
    initial = ArrayRecord(model_fn().state_dict())
    client_app = SkyClient(
        model_fn=model_fn,
        load_data=owner_data_fn(fleet, dataset, seed=settings.seed),
        emulation_fn=fleet_emulation(fleet),
    ).register(ClientApp())

    def start(grid: Grid) -> None:
        strategy.start(
            grid=grid,
            initial_arrays=initial,
            num_rounds=settings.num_rounds,
            evaluate_fn=evaluate,
        )

    return simulate(
        start,
        client_app,
        len(fleet),
        (inputs["cpus"], inputs["per_node"]),
        lambda error: write_outputs(out_dir, strategy, recorder, error),
        on_error=strategy.request_stop,  # the ServerApp thread may still be waiting on nodes
        gpus_per_node=inputs["gpus_per_node"],
    )


def write_outputs(
    out_dir: Path,
    strategy: Any,  # noqa: ANN401 - a SkyStrategy
    recorder: SkyRecorder,
    error: str | None,
) -> dict[str, Any]:
    """The job's last word: ``model.pt`` (the strategy's last good global model, if it
    has one) and ``results.json`` (``recorder``, with ``error`` or :func:`untrained`'s);
    returns the results. Also what the chaos test (``tests/test_chaos.py``) calls after
    an in-process run."""
    if strategy.global_arrays is not None:  # last good (finite) global model
        save_model(out_dir / "model.pt", strategy.global_arrays.to_torch_state_dict())
    return recorder.write(error or untrained(strategy.rounds), final=True)


def refused(cfg: DictConfig, out_dir: Path) -> Callable[[str], None]:
    """The ``results.json`` writer for a Sky job refused before it started."""

    def write(error: str) -> None:
        allocation, fleet = str(cfg.allocation.get("method")), str(cfg.fleet.get("name"))
        write_json(out_dir / "results.json", sky_results(allocation, fleet, [], error))

    return write


def summary(results: dict[str, Any]) -> str:
    """A finished Sky job's outcome in one line."""
    where = f"[{results['allocation']} on {results['fleet']}]"
    return f"{where}: final test accuracy {number(results['final_test_accuracy'])}"
