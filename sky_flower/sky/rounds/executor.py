"""The Sky strategy's round executor: every data owner's pipeline through the transport
runner picked once from ``schedule.transport``, then FedAvg across the pipelines
(:func:`sky_flower.sky.rounds.federation.federated_round`); and the server-side
evaluator of the global model. Parts of :class:`sky_flower.strategies.sky.SkyStrategy`,
each built from the settings and testable alone."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from sky_flower.flower.exchange import NodeLedger
from sky_flower.pipeline.stage import frozen_keys
from sky_flower.sky.model import SkyModel
from sky_flower.sky.planning.benchmark import LinkTiming
from sky_flower.sky.rounds import federation
from sky_flower.sky.rounds.records import RoundResult
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.deadlines import deadline
from sky_flower.sky.transport.direct import DirectRunner
from sky_flower.sky.transport.guard import RoundGuard
from sky_flower.sky.transport.relay import RelayRunner
from sky_flower.sky.transport.runner import Runner, RunSettings
from sky_flower.sky.transport.stream import StreamRunner

RUNNERS: dict[str, type[Runner]] = {  # transport -> runner, picked once
    "relay": RelayRunner,
    "direct": DirectRunner,
    "stream": StreamRunner,
}


class RoundExecutor:
    """Runs a round of every pipeline it is given and averages their models.

    Parameters
    ----------
    model : SkyModel
        The model and its objective (every runner's).
    settings : SkySettings
        ``schedule`` (the transport picks the runner class), ``train``, ``failure``
        (message timeout, divergence factor), ``deadlines``, ``direct``, ``stream``,
        ``messaging``, ``seed``, ``train.bn_policy``.
    optimizer_store : OptimizerStore or None
        ``train.optimizer_state=keep``: the pipelines' optimizer states between rounds
        (:mod:`sky_flower.sky.migration`).
    capacity : int or None
        How many ClientApps the runtime runs at once (the simulation engine's workers;
        ``None``: no bound), the stage sessions' bound
        (:class:`sky_flower.sky.transport.session.StreamSessions`).

    Raises
    ------
    ValueError
        If the transport cannot run the schedule (``check_schedule``), or
        ``train.bn_policy=local`` with a model without BatchNorm.
    """

    def __init__(
        self,
        model: SkyModel,
        settings: SkySettings,
        optimizer_store: Any = None,  # noqa: ANN401 - sky_flower.sky.migration.OptimizerStore
        capacity: int | None = None,
    ) -> None:
        self.model, self.settings = model, settings
        self.schedule = schedule = settings.schedule_object()
        self.runner_cls = RUNNERS[schedule.transport]
        self.runner_cls.check_schedule(schedule)
        self.optimizer_store = optimizer_store
        self.guard = RoundGuard(settings.failure.divergence_factor)
        self.stop = threading.Event()
        self.ledger = NodeLedger()
        self.local_bn = None  # train.bn_policy=local: refused up front for a model without BN
        whole = model.model_fn()
        if settings.train.bn_policy == "local":
            self.local_bn = federation.LocalBatchNorm(federation.batchnorm_keys(whole))
        # its frozen parameters (requires_grad=False): FedAvg keeps the global model's
        self.frozen = frozen_keys(whole)
        # transport=stream or direct: stage sessions that live across rounds (one per
        # pipeline)
        self.sessions = None
        self.sessions_fit = True  # the plan's stages fit the runtime (StreamSessions.usable)
        if schedule.transport in ("stream", "direct") and settings.stream.sessions:
            from sky_flower.sky.transport.session import StreamSessions

            self.sessions = StreamSessions(  # a SuperNode runs one message at a time
                settings.stream.session_max_s,
                deadline(settings.deadlines, "collect", settings.failure.message_timeout_s)
                + settings.stream.timeout_s,
            )
            if capacity is not None:  # the simulation engine's workers
                self.sessions.in_engine(capacity)

    def run_settings(self, num_layers: int, names: Mapping[int, str]) -> RunSettings:
        """The settings every runner (and the benchmark's exchange) uses: the model's
        ``num_layers``, errors naming nodes by ``names`` (node id -> name)."""
        m = self.model
        return RunSettings(
            model_fn=m.model_fn,
            input_shape=tuple(m.input_shape),
            num_layers=num_layers,
            settings=self.settings,
            input_dtype=m.input_dtype,
            loss_fn=m.loss_fn,
            metric_fn=m.metric_fn,
            loss_reduction=m.reduction.kind,
            loss_weight_fn=m.reduction.weight_fn,
            stop=self.stop,
            describe=names.get,
            ledger=self.ledger,
            optimizer_store=self.optimizer_store,
            sessions=self.sessions if self.sessions_fit else None,
        )

    def close(self) -> None:
        """End the run's stage sessions (their endpoints, ports and threads); the
        strategy calls it when the run ends, however it ends."""
        if self.sessions is not None:
            self.sessions.close_all()

    def bound_by_runtime(self, workers: int | None) -> None:
        """Bound the stage sessions by ``workers``, the ClientApps the runtime runs at
        once as the benchmark round found them (:attr:`sky_flower.sky.planning.
        benchmark.BenchmarkResult.runtime_workers`: Flower's simulation runtime under
        ``flwr run``, whose size the ServerApp is not told), as ``capacity`` does where
        it was not given; ``None`` or 0 (a deployment): nothing changes."""
        if workers and self.sessions is not None and self.sessions.capacity is None:
            self.sessions.in_engine(workers)

    def check_plan(self, pipeline: Any, run: RunSettings) -> None:  # noqa: ANN401 - a Pipeline
        """Raise ``ValueError`` if the transport cannot run ``pipeline``: its own
        check, and (``stream`` in Flower's simulation engine) a pipeline with more
        stages than the engine runs ClientApps at once (every stage of a pipeline runs
        at the same time, with or without sessions: such a round could only fail)."""
        self.runner_cls(run).check_plan(pipeline)
        capacity = None if self.sessions is None else self.sessions.capacity
        if capacity is not None and pipeline.num_stages > capacity:
            raise ValueError(
                f"transport={self.schedule.transport} runs every stage of a pipeline at once, "
                "but the plan's "
                f"pipeline of {pipeline.plan.stages[0].node} has {pipeline.num_stages} "
                f"stages and the simulation engine runs only {capacity} ClientApps at "
                "once: lower simulation.num_cpus_per_node (flwr run: the federation's "
                "options.backend.client-resources.num-cpus; CPUs / it is the engine's "
                "workers), or use transport=relay"
            )

    def link_timing(self, run: RunSettings) -> LinkTiming:
        """How the benchmark round times links for this transport."""
        cls = self.runner_cls
        stream = run.stream_endpoint() if cls.label == "stream" else None
        return LinkTiming(peer_links=cls.peer_links, calibrate=cls.calibrate, stream=stream)

    def run(
        self,
        grid: Grid,
        runs: Sequence[Any],
        arrays: ArrayRecord,
        server_round: int,
        run: RunSettings,
    ) -> RoundResult:
        """Round ``server_round`` of the pipelines ``runs`` (the plan's
        :class:`sky_flower.sky.planning.planning.PipelineRun`, one per data owner) from
        the global model ``arrays``, every runner on ``run``
        (:func:`sky_flower.sky.rounds.federation.federated_round`): the round's record,
        the new global model and, when it failed, why (:class:`RoundResult`). Stage
        sessions of data owners no longer planned end first."""
        if self.sessions is not None:
            self.sessions.retain(
                {r.pipeline.plan.stages[0].node: tuple(r.pipeline.node_ids) for r in runs}
            )
            self.sessions.plan([r.pipeline.node_ids for r in runs])
            stages = sum(r.pipeline.num_stages for r in runs)
            fit = self.sessions.usable(stages)
            if not fit and self.sessions_fit:
                log(
                    WARNING,
                    "stage sessions hold one ClientApp per stage of every pipeline "
                    "(%d here) for the whole run, but the simulation engine runs %s at once: "
                    "this plan sets its stages up every round instead (lower "
                    "simulation.num_cpus_per_node, under flwr run the federation's "
                    "options.backend.client-resources.num-cpus, or run it deployed)",
                    stages,
                    self.sessions.capacity,
                )
            if not fit:
                self.sessions.close_all()
            self.sessions_fit = fit
            run = dataclasses.replace(run, sessions=self.sessions if fit else None)
        return federation.federated_round(
            grid,
            runs,
            lambda: self.runner_cls(run),
            arrays,
            server_round,
            self.guard,
            self.local_bn,
            self.frozen,
        )


class Evaluator:
    """Server-side evaluation of the global model (``start(evaluate_fn=...)``): no
    evaluation message goes to the nodes.

    Parameters
    ----------
    evaluate_fn : callable or None
        ``(server_round, arrays) -> MetricRecord | None``, Flower's ``evaluate_fn``.
    """

    def __init__(
        self, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None
    ) -> None:
        self.evaluate_fn = evaluate_fn

    def evaluate(
        self, server_round: int, arrays: ArrayRecord, result: Result
    ) -> dict[str, float] | None:
        """Evaluate round ``server_round``'s model (0: the initial one) into ``result``;
        its metrics (``None``: not evaluated)."""
        if self.evaluate_fn is None:
            return None
        res = self.evaluate_fn(server_round, arrays)
        if server_round == 0:
            log(INFO, "Initial global evaluation: %s", res)
        if res is None:
            return None
        result.evaluate_metrics_serverapp[server_round] = res
        return {k: float(v) for k, v in res.items()}  # type: ignore[arg-type]
