"""What every job shares: the Hydra config directory, the simulation engine's CPUs,
one log stream, result files as JSON, error recording and the entry point's outcome
handling (:func:`main_job`); and :class:`SkyRecorder`, which writes a Sky run's
``results.json`` under Hydra and under ``flwr run`` alike (no Flower import here).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig

from sky_flower.sky.rounds.hooks import RoundEnd, RunEnd, RunRecords, SkyHooks
from sky_flower.sky.rounds.records import FailedRound, JoinRecord, RoundRecord
from sky_flower.sky.settings import hydra_defaults

if TYPE_CHECKING:
    from sky_flower.sky.planning.replan import ReplanRecord

log = logging.getLogger("sky_flower")

# the keys of a Sky round row kept in results.json (SkyStrategy.rounds has more)
ROUND_KEYS = (
    "round",
    "train_loss",
    "test_accuracy",
    "measured_step_time_s",
    "predicted_step_time_s",
    "train_accuracy",
    "test_loss",
    "test_perplexity",
    "steps",
    "round_time_s",
    "microbatches_per_message",
    "stages",
    "setup_s",
    "error",
    "samples_trained",  # federated rounds (sky_flower.sky.rounds.federation.round_row)
    "predicted_round_time_s",
    "pipelines",
    "failed_pipelines",
    "weights_sent_bytes",  # frozen parameters stay home (sky_flower.sky.rounds.records)
    "full_weights_bytes",
    "flower_messages",  # stream: Flower messages a round cost, its stage session's round
    "session_round",
    "predicted_setup_s",  # and the session set-up predicted (setup_s: measured)
)


def conf_dir() -> str:
    """The Hydra config directory: the installed ``sky_flower/conf``, else the checkout's
    ``conf/``; ready to compose: the settings' defaults are registered in Hydra's
    ConfigStore as ``sky_base`` (:func:`sky_flower.sky.settings.hydra_defaults`), the
    first entry of ``conf/config.yaml``'s defaults list. Whatever composes
    ``conf/config.yaml`` (an entry point, a test) takes the directory from here."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="sky_base", node=hydra_defaults())
    here = Path(__file__).resolve().parent.parent
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


def backend_config(cpus: int, per_node: float, gpus_per_node: float = 0.0) -> dict[str, Any]:
    """``run_simulation``'s backend config: ``per_node`` CPUs (of ``cpus``) and
    ``gpus_per_node`` GPUs (:func:`simulation_gpus`) per node."""
    return {
        "client_resources": {"num_cpus": per_node, "num_gpus": gpus_per_node},
        "init_args": {"num_cpus": cpus, "logging_level": "error"},
    }


def simulate(
    start: Callable[[Any], None],
    client_app: Any,  # noqa: ANN401 - flwr.clientapp.ClientApp
    num_supernodes: int,
    cpus_per_node: tuple[int, float],
    record: Callable[[str | None], dict[str, Any]],
    check: Callable[[], None] = lambda: None,
    on_error: Callable[[], None] = lambda: None,
    engine: Callable[[], AbstractContextManager] = nullcontext,
    gpus_per_node: float = 0.0,
) -> dict[str, Any]:
    """Run ``start(grid)`` as the ServerApp and ``client_app`` on ``num_supernodes``
    nodes in Flower's simulation engine; return ``record(error)``, which also runs when
    the run fails (with the error's description) before the error is re-raised. When
    ``start`` raises (the strategy gave up), the messages still in flight are abandoned
    (:class:`sky_flower.flower.shutdown.AbandonableEngine`), so the engine stops within
    seconds instead of when the slowest node finishes.

    Parameters
    ----------
    start : callable
        ``(grid) -> None``: the strategy's run.
    client_app : ClientApp
        The nodes' app.
    num_supernodes : int
        Simulated nodes.
    cpus_per_node : (int, float)
        CPUs of this machine and each node's share (:func:`simulation_cpus`).
    record : callable
        ``(error or None) -> results``: writes the job's files.
    check : callable
        Called after the engine returns; raises if the run did not end (the ServerApp's
        own error stays in the engine's log).
    on_error : callable
        Called first on a failure (e.g. to stop a ServerApp still waiting on nodes).
    engine : callable
        A context manager around the engine (e.g. a wider message thread pool).
    gpus_per_node : float
        Ray GPUs per node (:func:`simulation_gpus`).

    Raises
    ------
    BaseException
        Whatever the engine or ``check`` raised, after ``record``.
    """
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from sky_flower.flower.quiet import quiet_third_party
    from sky_flower.flower.shutdown import AbandonableEngine, signals_interrupt

    server_app = ServerApp()
    nodes = AbandonableEngine()

    @server_app.main()
    def main(grid: Any, context: Any) -> None:  # noqa: ANN401 - Flower's Grid, Context
        try:
            start(grid)
        except BaseException:  # the strategy gave up: its in-flight messages are abandoned
            nodes.abandon()
            raise

    error: str | None = None
    quiet_third_party()  # sky_flower.flower.quiet

    def interrupted() -> None:
        """Ctrl-C, SIGTERM: the strategy is told first (it blames no node), the messages
        in flight are abandoned (a stage session holds its ClientApp for the whole run),
        then KeyboardInterrupt stops the engine."""
        on_error()
        nodes.abandon()

    try:
        with signals_interrupt(interrupted), engine(), nodes.tracking():
            run_simulation(
                server_app=server_app,
                client_app=client_app,
                num_supernodes=num_supernodes,
                backend_config=backend_config(*cpus_per_node, gpus_per_node),
            )
        check()
    except BaseException as err:  # noqa: BLE001 - recorded, then re-raised
        on_error()
        error = describe_error(err)
        raise
    finally:
        results = record(error)
    return results


def plain(v: Any) -> Any:  # noqa: ANN401 - any JSON-bound value
    """A JSON-serialisable form of ``v`` (numpy scalars as Python numbers, else ``str``)."""
    if isinstance(v, np.generic):
        return v.item()
    return str(v)


def write_json(path: Path, payload: Any) -> Any:  # noqa: ANN401 - a JSON-able payload
    """Write ``payload`` as indented, strictly valid JSON to ``path`` (parents created);
    return what was written.

    Every non-finite float (``NaN``, ``inf``: not JSON) is written as ``null``
    (:func:`sky_flower.flower.finite.json_safe`); a dict payload then gets a top-level
    ``"nonfinite"`` list of the JSON paths replaced (e.g. ``"rounds[1].test_loss"``).
    """
    from sky_flower.flower.finite import json_safe  # imports Flower: not at module level

    clean, replaced = json_safe(payload)
    if replaced and isinstance(clean, dict):
        clean["nonfinite"] = replaced
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean, indent=2, default=plain, allow_nan=False))
    return clean


def save_model(path: Path, state: Mapping[str, Any]) -> bool:
    """Save the state dict ``state`` (tensors) to ``path`` (``model.pt``) only if every
    tensor is finite: ``model.pt`` is only ever a finite model. Returns whether it was
    written; a non-finite model is not (a warning names its tensors) and an older
    ``model.pt`` at ``path`` is left as it is (the last finite model written there).
    """
    import torch

    from sky_flower.flower.finite import nonfinite_names

    bad = nonfinite_names(state)
    if bad:
        log.warning("%s not written: the model holds NaN or inf in %s", path, ", ".join(bad[:8]))
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in state.items()}, path)
    return True


def shown_error(err: BaseException) -> BaseException:
    """The error a user should read: ``err`` itself for a refused setting (a
    ``ValueError`` that names the key, even when raised from Python's own conversion
    error), else its cause (what the simulation engine wrapped), else ``err``."""
    return err if isinstance(err, ValueError) else (err.__cause__ or err)


INTERRUPTED = "run interrupted (Ctrl-C or SIGTERM)"


def describe_error(err: BaseException) -> str:
    """``"Type: message"`` of :func:`shown_error` (what ``results.json`` records);
    ``"KeyboardInterrupt: run interrupted (Ctrl-C or SIGTERM)"`` for an interrupt (a
    ``SystemExit`` too: Flower's simulation runtime turns SIGTERM into one)."""
    shown = shown_error(err)
    if isinstance(shown, KeyboardInterrupt | SystemExit):
        return f"{type(shown).__name__}: {INTERRUPTED}"
    return f"{type(shown).__name__}: {shown}"


def one_log_stream() -> None:
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


def main_job(
    run: Callable[[DictConfig, Path], dict[str, Any]],
    refused: Callable[[str], None],
    summary: Callable[[dict[str, Any]], str],
    cfg: DictConfig,
    out_dir: Path,
    multirun: bool,
) -> None:
    """What the entry point does with a job: ``run(cfg, out_dir)``, then log its
    ``summary`` line. A failed job is logged; one refused before it wrote ``results.json``
    gets one through ``refused(error)``; it exits 1 (in a multirun it is recorded and
    the sweep goes on). A job that returns results with an ``error`` (a Sky run whose
    every round failed) exits 1 too.

    Raises
    ------
    SystemExit
        With status 1 when the job failed outside a multirun; 130 when it was
        interrupted (Ctrl-C, SIGTERM), in a multirun too.
    """
    try:
        results = run(cfg, out_dir)
    except (KeyboardInterrupt, SystemExit):  # results.json has the rounds so far
        log.error("%s: the rounds so far are in %s", INTERRUPTED, out_dir)
        raise SystemExit(130) from None  # a multirun stops too: the user stopped it
    except Exception as err:  # noqa: BLE001
        log.error("run failed: %s (outputs in %s)", shown_error(err), out_dir)
        if not (out_dir / "results.json").exists():  # refused before it started
            refused(describe_error(err))
        if multirun:
            return
        raise SystemExit(1) from None
    log.info("%s; outputs in %s", summary(results), out_dir)
    if results.get("error"):  # it ran to its end but trained nothing (every round failed)
        log.error("run failed: %s (outputs in %s)", results["error"], out_dir)
        if not multirun:
            raise SystemExit(1)


def number(v: float | None, digits: int = 4) -> str:
    """``v`` with ``digits`` decimals, ``-`` for ``None`` (a summary line's figure)."""
    return "-" if v is None else f"{v:.{digits}f}"


def sky_results(
    allocation: str,
    fleet: str,
    rounds: Sequence[RoundRecord],
    error: str | None,
    failed_rounds: Sequence[FailedRound] = (),
    initial_test_accuracy: float | None = None,
    completed: bool = False,
    replans: Sequence[ReplanRecord] = (),
    joins: Sequence[JoinRecord] = (),
) -> dict[str, Any]:
    """The ``results.json`` of a Sky run (Hydra job and ``flwr run``), written from the
    records' :meth:`to_dict` alone.

    ``rounds`` are the strategy's round records (only :data:`ROUND_KEYS` are kept);
    ``final_test_accuracy`` is the last good round's (a failed round keeps the previous
    global model); ``initial_test_accuracy`` the untrained model's (round 0);
    ``completed`` whether every round ran and the run has no ``error`` (one whose
    rounds all failed trained nothing: not completed); ``replans`` the online re-plans
    (:mod:`sky_flower.sky.planning.replan`: after which round, why, gain, migration, plans);
    ``joins`` the nodes admitted mid-run (:mod:`sky_flower.sky.rounds.joins`: ``round``,
    ``node``, ``node_id``).
    """
    rows = [{k: r.get(k) for k in ROUND_KEYS} for r in (r.to_dict() for r in rounds)]
    return {
        "allocation": allocation,
        "fleet": fleet,
        "initial_test_accuracy": initial_test_accuracy,
        "final_test_accuracy": next(
            (r["test_accuracy"] for r in reversed(rows) if r.get("test_accuracy") is not None),
            None,
        ),
        "rounds": rows,
        "error": error,
        "failed_rounds": [r.to_dict() for r in failed_rounds],
        "replans": [r.to_dict() for r in replans],
        "joins": [r.to_dict() for r in joins],
        "completed": completed,
    }


def untrained(rounds: Sequence[RoundRecord]) -> str | None:
    """The error of a run whose rounds all failed (None if one trained or none ran):
    such a run trained nothing, whatever ``max_failed_rounds`` let it go on to."""
    if not rounds or any(r.error is None for r in rounds):
        return None
    return f"no round trained ({len(rounds)} failed); the last: {rounds[-1].error}"


class SkyRecorder(SkyHooks):
    """Keeps a Sky run's ``results.json`` at ``path`` up to date: a hook
    (:class:`sky_flower.sky.rounds.hooks.SkyHooks`) of a ``SkyStrategy``, writing from
    the records its events hand it.

    The file is rewritten after every round, records the initial evaluation (round 0 of
    ``evaluate_fn``), and at the end of the run whether it completed or the error that
    ended it. Subscribe it with ``SkyStrategy(..., hooks=[recorder])`` or
    :meth:`attach`.

    Parameters
    ----------
    path : Path
        The ``results.json`` to write.
    allocation, fleet : str
        Recorded as they are.
    """

    def __init__(self, path: Path, allocation: str, fleet: str) -> None:
        self.path, self.allocation, self.fleet = Path(path), allocation, fleet
        self.records = RunRecords()
        self.initial_test_accuracy: float | None = None
        self.completed = False
        # the job's last word was written (:meth:`write` with ``final``): a strategy
        # thread that ends after it (it was stopped) does not overwrite it
        self.closed = False

    def attach(self, strategy: Any) -> Any:  # noqa: ANN401 - a SkyStrategy
        """Subscribe to ``strategy`` (:meth:`SkyStrategy.subscribe`) and return it."""
        strategy.subscribe(self)
        return strategy

    def on_evaluate(self, server_round: int, metrics: dict[str, float]) -> None:
        """Keep the initial model's test accuracy (round 0)."""
        if server_round == 0 and "accuracy" in metrics:
            self.initial_test_accuracy = float(metrics["accuracy"])

    def on_round(self, event: RoundEnd) -> None:
        """Rewrite the file with the round."""
        if self.closed:
            return
        self.records = event.records
        self.write()

    def on_end(self, event: RunEnd) -> None:
        """Write the outcome: completed, or the error that ended the run."""
        if self.closed:
            return
        self.records = event.records
        if event.error is not None:
            self.write(describe_error(event.error))
            return
        self.completed = True
        self.write()

    def write(self, error: str | None = None, final: bool = False) -> dict[str, Any]:
        """Write the results so far (with ``error`` if the run failed) and return them;
        ``final``: the job's last word (what ended the run as the job saw it, e.g. the
        simulation engine's crash), which later events do not overwrite."""
        self.closed = self.closed or final
        r = self.records
        if error is None and self.completed:
            error = untrained(r.rounds)  # ran to its end but trained nothing
        results = sky_results(
            self.allocation,
            self.fleet,
            r.rounds,
            error,
            r.failed_rounds,
            self.initial_test_accuracy,
            self.completed and not error,  # e.g. "no round trained": not completed
            r.replans,
            r.joins,
        )
        return write_json(self.path, results)


def model_and_data(cfg: DictConfig, settings: Any, transport: str) -> dict[str, Any]:  # noqa: ANN401
    """The job's model, data and objective from ``cfg.model``, ``cfg.dataset`` and
    ``settings.objective`` (a :class:`sky_flower.sky.settings.SkySettings`), checked
    together before Flower starts: the model builds, the data loads, the samples have
    the model's ``input_shape`` (taken from the data when the config has none), every
    float feature and label of both splits is finite, and the loss and metric run on the
    model's output for the first two samples and those holding the smallest and largest
    label (or token id) of each whole split (:mod:`sky_flower.pipeline.inputs`).

    Returns
    -------
    dict
        ``model_cfg``, ``dataset`` (plain dicts), ``model_fn`` (``() -> nn.Module``),
        ``train``, ``test`` (Splits), ``input_shape`` (list of int), ``input_dtype``
        (``model.input_dtype``, else the data's), ``loss_fn``,
        ``metric_fn``.

    Raises
    ------
    ValueError
        Naming the key: a planning-only model, a bad ``model._target_`` or
        ``dataset._target_``, samples of another shape than ``model.input_shape``, a
        layer split training cannot run (:func:`sky_flower.core.profile.check_layers`
        names it), non-finite features or labels (naming the data set and split), labels
        outside the model's output width (naming both), a loss or metric that fails on
        the model's output, or
        (``transport=direct``) labels of a dtype the direct engine cannot send.
    """
    import copy
    from functools import partial

    import torch
    from omegaconf import OmegaConf

    from sky_flower.core.profile import check_layers
    from sky_flower.pipeline.data import load_dataset
    from sky_flower.pipeline.inputs import check_finite_data, label_range_error, probe_rows
    from sky_flower.pipeline.models import build_model
    from sky_flower.pipeline.objective import check_objective
    from sky_flower.pipeline.sources import probe_split

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    dataset = OmegaConf.to_container(cfg.dataset, resolve=True)
    assert isinstance(model_cfg, dict) and isinstance(dataset, dict)
    name = model_cfg.get("name", model_cfg.get("_target_"))
    if model_cfg.get("planning_only"):  # e.g. bert_large: profiled from shapes, never built
        raise ValueError(
            f"model {name!r} is for planning only (planning_only: true) and cannot be "
            f"trained by sky_flower.run: use `python -m sky_flower.plan model={name}` instead"
        )
    model_fn = partial(build_model, model_cfg)
    model = model_fn()  # fail early on a bad model config
    train, test = load_dataset(dataset, settings.seed)
    # a source not in memory (a DataLoader, a datasets.Dataset) is checked on a sample
    probe_train, probe_test = probe_split(train), probe_split(test)
    sample = list(probe_train.x.shape[1:])
    input_shape = [int(v) for v in model_cfg.get("input_shape", sample)]
    if input_shape != sample:
        raise ValueError(
            f"model.input_shape={input_shape} but dataset {dataset.get('name')!r} has samples "
            f"of shape {sample}: set model.input_shape={sample} or choose the matching dataset"
        )
    loss_fn, metric_fn = settings.objective.functions()
    mb = settings.schedule.batch_size // max(1, settings.schedule.microbatches)
    check_layers(copy.deepcopy(model), torch.as_tensor(probe_train.x[:2]), mb)  # names the layer
    data_name = str(dataset.get("name") or dataset.get("_target_"))
    reduction = settings.objective.reduction_object()
    for split, which in ((probe_train, "training"), (probe_test, "test")):
        check_finite_data(split, data_name, which)  # NaN / inf features: refused by name
        rows = probe_rows(split)  # the first two and the extreme labels of the whole split
        x, y = torch.as_tensor(split.x[rows]), torch.as_tensor(split.y[rows])
        try:
            check_objective(model, x, y, loss_fn, metric_fn, reduction=reduction)
        except ValueError as err:
            with torch.no_grad():
                width = int(copy.deepcopy(model).train()(x).shape[-1])
            what = label_range_error(split.y, width, data_name, str(name))
            if what:  # say which labels and which width, not "Target 6 is out of bounds"
                raise ValueError(f"{what} ({which} split; {err})") from err
            raise
    from sky_flower.pipeline.engine import LABEL_DTYPES

    y = torch.as_tensor(probe_train.y[:1])
    if transport == "direct" and y.dtype not in LABEL_DTYPES:
        raise ValueError(
            f"transport=direct sends labels of dtype {', '.join(map(str, LABEL_DTYPES))} to "
            f"the last stage; dataset {dataset.get('name')!r} has {y.dtype} labels: convert "
            "them in the dataset's loader or use transport=relay"
        )
    return {
        "model_cfg": model_cfg,
        "dataset": dataset,
        "model_fn": model_fn,
        "train": train,
        "test": test,
        "input_shape": input_shape,
        "input_dtype": str(model_cfg.get("input_dtype") or probe_train.x.dtype),
        "loss_fn": loss_fn,
        "metric_fn": metric_fn,
    }


def flat_model_start(
    strategy: Any,  # noqa: ANN401 - a Hermes or decentralized strategy
    model: Any,  # noqa: ANN401 - a sky_flower.gossip.training.FlatModel
    test: Any,  # noqa: ANN401 - the held-out Split
    seed: int,
    num_rounds: int,
) -> Callable[[Any], None]:
    """The ServerApp body of a job whose model is one flat vector (Hermes and the
    decentralized strategies): ``strategy.start`` from ``model.initial(seed)`` under key
    ``"x"``, the global model evaluated on ``test`` (accuracy, loss) every round."""
    from flwr.app import ArrayRecord, MetricRecord

    from sky_flower.flower.vectors import vector_record

    def evaluate(step: int, arrays: ArrayRecord) -> MetricRecord:
        res = model.evaluate(arrays["x"].numpy(), test)
        return MetricRecord({"accuracy": res["accuracy"], "loss": res["loss"]})

    x0 = model.initial(seed)

    def start(grid: Any) -> None:  # noqa: ANN401 - flwr.serverapp.Grid
        strategy.start(
            grid=grid,
            initial_arrays=vector_record("x", x0),
            num_rounds=num_rounds,
            evaluate_fn=evaluate,
        )

    return start
