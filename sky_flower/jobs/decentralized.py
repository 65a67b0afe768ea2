"""The decentralized job of the entry point: ``python -m sky_flower.run strategy=detag``.

Runs D-PSGD, D2, DSGT or DeTAG (``strategy=dpsgd|d2|dsgt|detag``; settings under
``strategy.*``, see ``conf/decentralized.yaml``) in Flower's simulation engine with one
SuperNode per node of the gossip matrix; each node holds its part of the digits train
split (sorted-shuffle heterogeneity ``strategy.homogeneity``) and computes gradients on
it, the server applies the gossip matrix and evaluates the averaged model on the held-out
test split. Writes ``results.json`` into the job's output directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from sky_flower.gossip.matrices import gossip_matrix
from sky_flower.gossip.training import FlatModel, node_splits
from sky_flower.jobs.common import (
    flat_model_start,
    log,
    number,
    one_log_stream,
    simulate,
    simulation_cpus,
    write_json,
)
from sky_flower.pipeline.data import load_split


def write_decentralized_results(
    out_dir: Path, cfg: DictConfig, network: dict | None, rounds: list[dict], error: str | None
) -> dict[str, Any]:
    """Write ``results.json`` (also for a job refused before it started) and return it."""
    s = cfg.strategy
    results = {
        "strategy": str(s.name),
        "topology": str(s.topology),
        "spectral_gap_setting": s.get("spectral_gap"),
        "lazy_mixing": s.get("lazy_mixing", False),
        "homogeneity": s.get("homogeneity"),
        "num_nodes": s.get("num_nodes"),
        "lr": s.get("lr"),
        "batch_size": s.get("batch_size"),
        "phase_rounds": s.get("phase_rounds"),  # DeTAG's R setting (0: by phase_rule)
        "phase_rule": s.get("phase_rule", "sqrt"),
        "detag_variant": s.get("detag_variant", "paper"),
        "network": network,
        "final_test_accuracy": rounds[-1].get("test_accuracy") if rounds else None,
        "final_loss": rounds[-1].get("loss") if rounds else None,
        "rounds": rounds,
        "error": error,
    }
    return write_json(out_dir / "results.json", results)


def check_detag_settings(s: DictConfig) -> None:
    """Refuse DeTAG's settings when bad, whichever strategy runs (so a typo is not
    silently ignored by D-PSGD and then used by a DeTAG run of the same sweep).

    Raises
    ------
    ValueError
        ``phase_rounds`` not an integer >= 0, an unknown ``phase_rule`` or ``detag_variant``,
        ``lazy_mixing`` not a boolean.
    """
    from sky_flower.gossip.algorithms import PHASE_RULES, DeTAG

    r = s.get("phase_rounds", 0)
    if isinstance(r, bool) or not isinstance(r, int | float) or r != int(r) or r < 0:
        raise ValueError(f"strategy.phase_rounds must be an integer >= 0 (0: automatic), got {r!r}")
    if s.get("phase_rule", "sqrt") not in PHASE_RULES:
        raise ValueError(
            f"strategy.phase_rule must be one of {PHASE_RULES}, got {s.get('phase_rule')!r}"
        )
    if not isinstance(s.get("lazy_mixing", False), bool):
        raise ValueError(
            f"strategy.lazy_mixing must be true or false, got {s.get('lazy_mixing')!r}"
        )
    variant = s.get("detag_variant", "paper")
    if variant not in DeTAG.VARIANTS:
        hint = " ('overlap' is now 'paper', the paper's Algorithm 2)" * (variant == "overlap")
        raise ValueError(
            f"strategy.detag_variant must be one of {DeTAG.VARIANTS}, got {variant!r}{hint}"
        )


def run_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Run the decentralized job for ``cfg``; write ``results.json``; return the results.

    ``results.json``: the settings, ``network`` (topology, nodes, lambda_2, lambda_min,
    spectral gap), ``rounds`` (one row per step: ``round`` = gossip rounds so far,
    ``loss`` = training loss of the averaged model over all nodes' data,
    ``node_loss``, ``test_accuracy`` / ``test_loss`` of the averaged model,
    ``consensus_distance``), ``final_test_accuracy``, ``final_loss``, ``error``.

    Raises
    ------
    ValueError
        On a bad setting (unknown strategy or topology, gap outside (0, 1], D2 with
        lambda_min <= -1/3, fewer than 2 nodes, ...), before Flower starts.
    sky_flower.strategies.decentralized.DecentralizedNodeError
        If a node fails; ``results.json`` is still written with the rounds done.
    """
    from flwr.clientapp import ClientApp

    from sky_flower.gossip.client import (
        DecentralizedClient,
        heterogeneous_data_fn,
    )
    from sky_flower.strategies.decentralized import STRATEGIES

    s = cfg.strategy
    name = str(s.name)
    if name not in STRATEGIES:
        raise ValueError(
            f"unknown decentralized strategy {name!r}: choose one of {list(STRATEGIES)}"
        )
    check_detag_settings(s)
    n, seed = int(s.num_nodes), int(cfg.seed)
    gap = None if s.spectral_gap is None else float(s.spectral_gap)
    gossip = gossip_matrix(
        str(s.topology),
        n,
        gap,
        edge_probability=float(s.edge_probability),
        seed=seed,
        lazy=bool(s.get("lazy_mixing", False)),
    )
    model = FlatModel(int(s.hidden_width))
    test_fraction = float(cfg.dataset.test_fraction)
    train, test = load_split("digits", test_fraction, seed)
    local = len(node_splits(train, n, float(s.homogeneity), seed)[0])
    if not 1 <= int(s.batch_size) <= local:
        raise ValueError(
            f"strategy.batch_size={s.batch_size} must be in [1, {local}] (examples per node)"
        )
    strategy = STRATEGIES[name](
        gossip=gossip,
        lr=float(s.lr),
        batch_size=int(s.batch_size),
        phase_rounds=int(s.phase_rounds),
        variant=str(s.get("detag_variant", "paper")),
        phase_rule=str(s.get("phase_rule", "sqrt")),
        seed=seed,
        message_timeout_s=float(cfg.failure.message_timeout_s),
    )
    steps_per = strategy.algorithm.rounds_per_step
    if int(s.rounds) < steps_per:
        raise ValueError(f"strategy.rounds={s.rounds} is shorter than one phase ({steps_per})")
    simulation_cpus(cfg)  # refuses a bad CPU share before anything starts

    start = flat_model_start(strategy, model, test, seed, int(s.rounds))

    def check() -> None:
        if len(strategy.rounds) < int(s.rounds) // steps_per + 1 or any(
            r["loss"] is None for r in strategy.rounds
        ):
            raise RuntimeError(
                f"the ServerApp stopped after {len(strategy.rounds) - 1} of "
                f"{int(s.rounds) // steps_per} steps (see the log above)"
            )

    def record(error: str | None) -> dict[str, Any]:
        rows = [{k: _float(v) for k, v in r.items()} for r in strategy.rounds]
        return write_decentralized_results(out_dir, cfg, gossip.describe(), rows, error)

    one_log_stream()
    load = heterogeneous_data_fn(n, float(s.homogeneity), test_fraction, seed)
    client_app = DecentralizedClient(model, load).register(ClientApp())
    log.info(
        "%s on %s (%d nodes, spectral gap %.4g, lambda_min %.4g), homogeneity %s%%",
        name,
        gossip.topology,
        n,
        gossip.spectral_gap,
        gossip.lambda_min,
        s.homogeneity,
    )
    return simulate(start, client_app, n, simulation_cpus(cfg), record, check=check)


def _float(v: Any) -> Any:  # noqa: ANN401 - a round row's value
    return float(v) if isinstance(v, np.floating) else v


def refused(cfg: DictConfig, out_dir: Path) -> Callable[[str], None]:
    """The ``results.json`` writer for a decentralized job refused before it started."""

    def write(error: str) -> None:
        write_decentralized_results(out_dir, cfg, None, [], error)

    return write


def summary(results: dict[str, Any]) -> str:
    """A finished decentralized job's outcome in one line."""
    head = f"[{results['strategy']}, {results['network']['topology']}, "
    return (
        f"{head}homogeneity {results['homogeneity']}%]: final loss "
        f"{number(results['final_loss'])}, test accuracy {number(results['final_test_accuracy'])}"
    )
