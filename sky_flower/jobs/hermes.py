"""The Hermes job of the entry point: ``python -m sky_flower.run strategy=hermes``.

Runs Hermes or a baseline (``strategy=hermes|bsp|asp|ssp``; settings under
``strategy.*``, see ``conf/hermes.yaml``) in Flower's simulation engine with one SuperNode
per fleet node (default ``fleet=skycomputing8``: SkyComputing's slowdowns 1-6 on 8
workers). Every worker holds a data partition of digits (data-parallel); the server keeps
a validation split (Hermes' aggregation losses) and the held-out test split (reported
accuracy only). Writes into the job's output directory, like the main job:
``benchmark.json`` (Hermes' benchmark round; baselines have none), ``plan.json`` (each
worker's share and batch, the target round time), ``results.json`` and ``model.pt``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from sky_flower.emulation.devices import expand_fleet
from sky_flower.gossip.training import FlatModel
from sky_flower.hermes.core import validate_settings
from sky_flower.hermes.server import check_profile_settings
from sky_flower.jobs.common import (
    flat_model_start,
    log,
    one_log_stream,
    save_model,
    simulate,
    write_json,
)
from sky_flower.pipeline.data import load_split

NAMES = ("hermes", "bsp", "asp", "ssp")


def is_hermes(cfg: DictConfig) -> bool:
    """True for ``strategy=hermes|bsp|asp|ssp``."""
    return str(OmegaConf.select(cfg, "strategy.name", default="sky")) in NAMES


#: Flower versions whose simulation engine ``concurrent_messages`` was checked against.
PATCHED_FLOWER = ("1.42",)


def flower_pool_unpatchable() -> str | None:
    """Why ``concurrent_messages`` cannot widen the installed Flower's worker pool, or None.

    Flower 1.42 has no setting for the number of messages its simulation engine handles at
    once (``run_api`` in ``flwr.server.superlink.fleet.vce.vce_api`` starts its workers in a
    bare ``ThreadPoolExecutor()``; ``backend_config`` sizes only the Ray actors). The patch
    depends on that line, so it is applied only to a Flower version listed in
    :data:`PATCHED_FLOWER` whose ``run_api`` still has it; ``tests/test_flower_internals.py``
    fails loudly when an upgrade changes either.
    """
    import inspect

    import flwr
    from flwr.server.superlink.fleet.vce import vce_api

    version = str(flwr.__version__)
    if not version.startswith(tuple(v + "." for v in PATCHED_FLOWER)):
        return f"Flower {version} is not one of the checked versions {PATCHED_FLOWER}"
    if "ThreadPoolExecutor()" not in inspect.getsource(vce_api.run_api):
        return f"Flower {version}'s vce_api.run_api no longer starts a bare ThreadPoolExecutor()"
    return None


@contextmanager
def concurrent_messages(n: int) -> Iterator[None]:
    """Let Flower's simulation engine handle ``n`` messages at once.

    Flower 1.42's engine runs its message workers in a ``ThreadPoolExecutor()`` with the
    default size, ``cpu_count + 4``: 6 on a 2-core machine, so 2 of 8 emulated workers
    would always wait for a free thread however many Ray actors there are. Flower has no
    setting for it, so the emulated workers (which mostly sleep) get a pool widened to
    ``n`` for the duration of the job
    (``flwr.server.superlink.fleet.vce.vce_api.ThreadPoolExecutor``, restored after).
    On a Flower version the patch was not checked against (:func:`flower_pool_unpatchable`)
    nothing is patched and a warning says that workers beyond the default pool will queue.
    """
    from flwr.server.superlink.fleet.vce import vce_api

    reason = flower_pool_unpatchable()
    default = min(32, (os.cpu_count() or 1) + 4)
    if reason is not None:
        if n > default:
            log.warning("%s: %d of %d workers may queue for a thread", reason, n - default, n)
        yield
        return
    original = vce_api.ThreadPoolExecutor
    vce_api.ThreadPoolExecutor = partial(original, max_workers=max(n, default))  # type: ignore[misc]
    try:
        yield
    finally:
        vce_api.ThreadPoolExecutor = original  # type: ignore[misc]


def run_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:  # noqa: PLR0915
    """Run Hermes or a baseline for ``cfg``; write the output files; return the results.

    ``results.json``: ``strategy``, ``fleet``, ``target_accuracy``, ``time_to_target_s``
    (server wall time to the first global model at or above the target; null if never),
    ``wall_time_s``, ``final_test_accuracy``, ``updates_sent`` (per worker),
    ``updates_sent_total``, ``minor_rounds`` (per worker), ``ready_s`` (the readiness
    barrier before the clock starts), Hermes' ``straggler_events`` and ``searches`` per
    worker, ``workers`` (slowdown, share,
    batch, rounds, updates sent, minor rounds, median round time), ``timeline`` (one row
    per change of the global model: ``time_s``, ``test_accuracy``, ``test_loss``,
    ``updates_applied``, ``worker_rounds``, ``event``), ``removals`` and
    ``rejected_updates`` (``worker``, ``name``, ``round``, ``reason``, ``time_s``:
    :mod:`sky_flower.hermes.membership`), ``settings``, ``error``.

    Raises
    ------
    ValueError
        On a bad setting (gate threshold > 0, window < 2, beta outside (0, 1), staleness
        < 0, target accuracy outside (0, 1], batch larger than a share, ...), before
        Flower starts.
    sky_flower.strategies.hermes.HermesNodeError
        If a worker fails; ``results.json`` is still written.
    """
    from flwr.clientapp import ClientApp

    from sky_flower.hermes.client import HermesClient, NominalDevice, hermes_data
    from sky_flower.sky.node.client import fleet_emulation
    from sky_flower.strategies.hermes import STRATEGIES

    s = cfg.strategy
    name = str(s.name)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {list(STRATEGIES)}")
    validate_settings(
        window=int(s.window),
        threshold=float(s.threshold),
        patience=int(s.patience),
        relax=float(s.relax),
        staleness=int(s.staleness),
        target_accuracy=float(s.target_accuracy),
    )
    batches = s.profile_batches
    check_profile_settings(
        OmegaConf.to_object(batches) if OmegaConf.is_config(batches) else batches,
        s.profile_repeats,
    )
    fleet = expand_fleet(OmegaConf.to_container(cfg.fleet, resolve=True))  # type: ignore[arg-type]
    n, seed = len(fleet), int(cfg.seed)
    if n < 2:
        raise ValueError(f"data-parallel training needs at least 2 workers, got {n}")
    test_fraction = float(cfg.dataset.test_fraction)
    train, test = load_split(str(cfg.dataset.name), test_fraction, seed)
    layout = hermes_data(
        train, n, seed, float(s.server_val_fraction), worker_val_size=int(s.worker_val_size)
    )
    model = FlatModel(int(s.hidden_width))
    cpus = os.cpu_count() or 1
    per_worker = float(s.num_cpus_per_worker or cpus / n)
    if not 0 < per_worker <= cpus:
        raise ValueError(f"strategy.num_cpus_per_worker={per_worker:g} must be in (0, {cpus}]")
    device = NominalDevice(float(s.device.overhead_ms) / 1e3, float(s.device.per_sample_ms) / 1e3)
    if device.overhead_s < 0 or device.per_sample_s < 0:
        raise ValueError("strategy.device times must be >= 0")

    strategy = _strategy(cfg, model, layout, n)

    start = flat_model_start(strategy, model, test, seed, int(s.max_rounds))

    def check() -> None:
        if not strategy.timeline or not hasattr(strategy, "wall_time_s"):
            raise RuntimeError("the ServerApp stopped before the run ended (see the log above)")

    out_dir.mkdir(parents=True, exist_ok=True)
    one_log_stream()
    client_app = HermesClient(model, lambda: layout, n, fleet_emulation(fleet), device).register(
        ClientApp()
    )
    log.info(
        "%s on %s: %d workers, slowdowns %s, pool %d, target accuracy %.3f",
        name,
        cfg.fleet.name,
        n,
        [f.slowdown for f in fleet],
        len(layout.pool),
        float(s.target_accuracy),
    )
    return simulate(
        start,
        client_app,
        n,
        (cpus, per_worker),
        partial(_write_outputs, out_dir, cfg, strategy, fleet, model),
        check=check,
        engine=partial(concurrent_messages, n),
    )


def _strategy(cfg: DictConfig, model: FlatModel, layout: Any, n: int) -> Any:  # noqa: ANN401
    """The Hermes or baseline strategy of ``cfg.strategy`` for ``n`` workers."""
    from sky_flower.strategies.hermes import STRATEGIES, HermesStrategy

    s = cfg.strategy

    def val_loss(vec: np.ndarray) -> float:
        return model.evaluate(vec, layout.server_val)["loss"]

    common: dict[str, Any] = {
        "model": model,
        "num_workers": n,
        "pool_size": len(layout.pool),
        "lr": float(s.lr),
        "batch_size": int(s.batch_size),
        "target_accuracy": float(s.target_accuracy),
        "stop_at_target": bool(s.stop_at_target),
        "max_time_s": float(s.max_time_s),
        "staleness": int(s.staleness),
        "seed": int(cfg.seed),
        "message_timeout_s": float(cfg.failure.message_timeout_s),
        "min_live_workers": s.get("min_live_workers"),
        "staleness_policy": str(s.get("staleness_policy", "discard")),
    }
    if str(s.name) != "hermes":
        return STRATEGIES[str(s.name)](**common)
    return HermesStrategy(
        **common,
        val_loss_fn=val_loss,
        window=int(s.window),
        threshold=float(s.threshold),
        patience=int(s.patience),
        relax=float(s.relax),
        step_model=str(s.get("step_model", "training")),
        profile_batches=tuple(int(b) for b in s.profile_batches),
        profile_repeats=int(s.profile_repeats),
        batch_range=(int(s.batch_range[0]), int(s.batch_range[1])),
        min_data=int(s.min_data),
        straggler_tolerance=float(s.straggler_tolerance),
    )


def _write_outputs(
    out_dir: Path,
    cfg: DictConfig,
    strategy: Any,  # noqa: ANN401 - a Hermes or baseline strategy
    fleet: list,
    model: FlatModel,
    error: str | None,
) -> dict[str, Any]:
    """Write ``results.json``, ``benchmark.json``, ``plan.json`` and ``model.pt``."""
    from sky_flower.strategies.hermes import HermesStrategy

    name, n = str(cfg.strategy.name), len(fleet)
    results = write_json(out_dir / "results.json", _results(cfg, strategy, fleet, error))
    write_json(
        out_dir / "benchmark.json",
        strategy.benchmark or {"note": f"{name}: no benchmark round"},
    )
    plan = {
        "strategy": name,
        "target_round_s": getattr(strategy, "target_s", None),
        "workers": [
            {"worker": w, "data": strategy.data[w], "batch": strategy.batch[w]} for w in range(n)
        ],
    }
    if isinstance(strategy, HermesStrategy):
        for row, sizes, k in zip(plan["workers"], strategy.sizes, strategy.searches):  # noqa: B905
            row.update({"predicted_round_s": sizes.predicted_s, "searches": k})
    write_json(out_dir / "plan.json", plan)
    if strategy.global_vec is not None:
        params = model.params(torch.as_tensor(strategy.global_vec, dtype=torch.float32))
        save_model(out_dir / "model.pt", params)  # only ever a finite model
    return results


def _results(cfg: DictConfig, strategy: Any, fleet: list, error: str | None) -> dict[str, Any]:
    s = cfg.strategy
    timeline = strategy.timeline
    return {
        "strategy": str(s.name),
        "fleet": str(cfg.fleet.name),
        "slowdowns": [f.slowdown for f in fleet],
        "target_accuracy": float(s.target_accuracy),
        "time_to_target_s": strategy.time_to_target_s,
        "wall_time_s": getattr(strategy, "wall_time_s", None),
        "final_test_accuracy": timeline[-1].get("test_accuracy") if timeline else None,
        "updates_sent": list(strategy.updates_sent),
        "updates_sent_total": int(sum(strategy.updates_sent)),
        "bytes_sent": int(sum(strategy.updates_sent)) * 4 * int(strategy.model.dim),  # float32
        "minor_rounds": list(strategy.minor_rounds),
        "workers": strategy.worker_rows(),
        "ready_s": getattr(strategy, "ready_s", None),
        "straggler_events": list(getattr(strategy, "straggler_events", [])),
        "searches": list(getattr(strategy, "searches", [])),
        "timeline": timeline,
        "removals": list(strategy.members.removals),  # workers removed: worker, round, reason
        "rejected_updates": list(strategy.members.rejected),  # non-finite updates discarded
        "settings": OmegaConf.to_container(s, resolve=True),
        "error": error,
    }


def refused(cfg: DictConfig, out_dir: Path) -> Callable[[str], None]:
    """The ``results.json`` writer for a Hermes job refused before it started."""

    def write(error: str) -> None:
        write_json(out_dir / "results.json", {"strategy": str(cfg.strategy.name), "error": error})

    return write


def summary(results: dict[str, Any]) -> str:
    """A finished Hermes job's outcome in one line."""
    t = results["time_to_target_s"]
    reached = "never" if t is None else f"{t:.1f}"
    return (
        f"[{results['strategy']}]: test accuracy {results['final_test_accuracy']} reached "
        f"{results['target_accuracy']:.3f} at {reached} s; "
        f"{results['updates_sent_total']} updates sent"
    )
