"""Sky: split-model training across heterogeneous Flower nodes, load-balanced.

Reproduces and improves on SkyComputing (Zhu, Li, You, "Sky Computing: Accelerating
Geo-distributed Computing in Federated Learning", arXiv 2202.11836): a benchmark round
measures every node on the model's own layers and times its link; the joint planner
(``even``, ``heuristic`` or ``optimal``, :func:`sky_flower.core.federated.plan_federation`)
gives every data owner its own pipeline (stage 0 on the owner, helpers after it, each
node a contiguous block of layers sized to what it can do); then every round all
pipelines train (:mod:`sky_flower.sky.rounds.federation`: a thread and runner each, pipelines
sharing a node one after another) and the global model is the FedAvg of their models,
weighted by samples trained. Each pipeline runs through a transport runner picked once
from ``schedule.transport``
(:data:`RUNNERS`): activations and gradients relayed through the server
(:mod:`sky_flower.sky.transport.relay`: one message group per step for ``sequential``, several in
flight for ``gpipe`` / ``1f1b``) or peer to peer in a ``torch.distributed.pipelining``
schedule whose rendezvous the server hands out (:mod:`sky_flower.sky.transport.direct`); the
server reassembles each owner's model from its stages. A failed pipeline drops out of
its round's average; a round in which every pipeline failed is recorded; either way the
nodes whose own fault it was (silence, an error or malformed reply; never a data owner)
are dropped and the model is re-planned, while non-finite values computed from finite
inputs are the training's: the run says it diverged (naming the learning rate and the
round) and drops nobody, or sets one suspect helper aside for a round
(:mod:`sky_flower.sky.rounds.blame`, :mod:`sky_flower.sky.rounds.recovery`); a failed round's next
round starts from the last good global model.

This module holds only the Flower ``Strategy``: wait -> benchmark -> plan -> rounds ->
evaluate -> recover. Benchmark round: :mod:`sky_flower.sky.planning.benchmark`; planning:
:mod:`sky_flower.sky.planning.planning`; reports: :mod:`sky_flower.sky.rounds.report`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log
from torch import nn

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.example import dtype_name
from sky_flower.core.partition import Plan
from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.flower.exchange import Exchange, NodeLedger
from sky_flower.flower.strategy import ServerSideEvaluation
from sky_flower.pipeline.objective import LossReduction, correct_count, ref
from sky_flower.sky.planning import planning
from sky_flower.sky.planning.benchmark import (
    Link,
    benchmark_event,
    benchmark_table,
    wait_for_nodes,
)
from sky_flower.sky.planning.planning import PipelineRun
from sky_flower.sky.planning.replan import ReplanConfig
from sky_flower.sky.protocol import ARRAYS
from sky_flower.sky.rounds import federation, report
from sky_flower.sky.rounds.joins import NodeJoins
from sky_flower.sky.rounds.recovery import RoundRecovery
from sky_flower.sky.rounds.replan_hook import RoundReplanning
from sky_flower.sky.transport.deadlines import Deadlines
from sky_flower.sky.transport.direct import DirectRunner, kinds_label
from sky_flower.sky.transport.guard import RoundGuard
from sky_flower.sky.transport.relay import RelayRunner
from sky_flower.sky.transport.runner import (
    Pipeline,
    Runner,
    RunSettings,
    SkyNodeError,
    merge_weights,
)
from sky_flower.sky.transport.stream import StreamRunner

PLAINTEXT = (  # logged when transport=direct
    "activations, gradients and weights travel between the stage nodes in plaintext (gloo "
    "has no encryption), whatever protects the SuperLink: use it on a trusted network only"
)
RUNNERS: dict[str, type[Runner]] = {  # transport -> runner, picked once
    "relay": RelayRunner,
    "direct": DirectRunner,
    "stream": StreamRunner,
}

__all__ = ["RUNNERS", "SkyNodeError", "SkyStrategy"]


class SkyStrategy(RoundReplanning, NodeJoins, RoundRecovery, ServerSideEvaluation, Strategy):
    """Split-model training with a benchmark round and a load-balanced layer plan.

    Parameters
    ----------
    model_fn : Callable[[], nn.Sequential]
        Builds the model as an ordered list of layers (the same function the nodes use).
    input_shape : Sequence[int]
        Shape of one input sample, without the batch dimension.
    allocation : str (default: "heuristic")
        ``even``, ``heuristic`` or ``optimal`` (see :mod:`sky_flower.core.partition`).
    schedule : Schedule (default: Schedule())
        Batch size, micro-batches (``schedule.microbatches``), schedule kind, transport.
    optimizer : str (default: "adam")
        Optimizer every stage uses (``adam``, ``sgd``, ``sgd_momentum``).
    lr : float (default: 1e-4)
        Learning rate.
    local_epochs : float (default: 1.0)
        Passes over the data owner's data per round (steps = epochs x examples / batch).
    steps_per_round : int (default: 0)
        If > 0, overrides ``local_epochs``.
    node_order : Sequence[str] (default: ())
        Pipeline order by node name (fleet order); the first data owner is always
        stage 0. Nodes not listed follow in name order.
    min_nodes : int (default: 2)
        Wait for this many connected nodes before the benchmark round (set it to your
        fleet's size: nodes that connect later are not in the plan); ``0``: every node
        that connects within ``node_wait_s`` (a federation without a fleet file).
    milp_time_limit_s : float (default: 30.0)
        Time limit of the ``optimal`` MILP.
    benchmark_warmup, benchmark_repeats, echo_bytes, echo_repeats, echo_jitter_s, \
    state_probe_bytes : (default: 2, 3, (1 KiB, 4 MiB), 3, 0.1, 16 MiB)
        The benchmark round's settings, as
        :class:`sky_flower.sky.planning.benchmark.BenchmarkSettings` documents them (the
        simulation job's defaults; a ``flwr run``'s run config defaults to 7 repeats,
        7 echoes and a 64 MiB probe: ``sky_flower.sky.settings``).
    message_timeout_s, deadlines : float, Deadlines (default: 120.0, ``Deadlines()``)
        Per-phase message deadlines (:mod:`sky_flower.sky.transport.deadlines`), none below
        ``message_timeout_s``; a node past its deadline fails the round, by name.
    max_failed_rounds : int (default: 2)
        A round that fails (a node errs, stalls or replies malformed) is recorded with
        its error (``rounds`` and ``failed_rounds``); the nodes whose own fault it was
        are dropped (the data owner cannot be) and the model is re-planned on the others
        from the benchmark round's profiles, and the next round starts from the last
        good global model. Non-finite replies are judged by
        :func:`sky_flower.sky.rounds.blame.judge`: the training diverged (nobody is dropped) or
        one helper is set aside for a round. This many consecutive failed rounds end
        the run with :class:`SkyNodeError` (``TrainingDiverged`` of
        :mod:`sky_flower.sky.rounds.recovery` when the last one diverged; 1: the first failed
        round does).
    divergence_factor : float (default: 0.0, off)
        ``>= 1``: fail a round whose training loss exceeds this x the best so far.
    direct_timeout_s, direct_host, direct_join_timeout_s : (default: 30.0, \
    "127.0.0.1", 60.0)
        ``transport=direct``: bound (s) on every peer operation (a stage that fails or
        stalls ends the round for all within about this time); the address of the
        round's TCPStore, hosted by the server (reachable from every stage node); bound
        (s) on the stages joining a round.
    stream_host, stream_bind, stream_tls, stream_max_frame_mb, stream_timeout_s : \
(default: "127.0.0.1", "127.0.0.1", True, 256.0, 30.0)
        ``transport=stream`` (:mod:`sky_flower.sky.transport.stream`): the endpoint's address as
        the stages dial it, its interface; TLS (a fresh, pinned certificate); frame cap
        (MiB); bound (s) on a stage owing a reply or connecting.
    seed : int (default: 0)
        Seeds the data owner's batch order.
    on_event : Callable[[str, dict], None], optional
        Called with ``("benchmark", ...)``, ``("plan", ...)``, ``("round", ...)`` so a
        caller can save or print them.
    poll_interval_s : float (default: 0.002)
        Pause (s) between two polls for replies (raise it where each poll is an RPC to a
        SuperLink). Also settable as an attribute before :meth:`start`.
    node_wait_s : float (default: 300.0)
        Wait this long for ``min_nodes``, then plan with the nodes connected.
    loss_fn : Callable (default: torch.nn.functional.cross_entropy)
        ``loss(output, labels) -> scalar tensor`` of a micro-batch, reduced as
        ``loss_reduction`` declares.
    loss_reduction : {"mean", "sum", "weighted"} (default: "mean")
        How ``loss_fn`` reduces over a micro-batch's samples (a mean, a sum, or a mean
        over ``loss_weight_fn(labels)``, e.g. the tokens not ignored): each
        micro-batch's loss is scaled by it once, before its backward, so that split
        training equals the unsplit model trained on ``loss_fn`` of the whole batch
        (:class:`sky_flower.pipeline.objective.LossReduction`).
    bn_policy : {"average", "local"} (default: "average")
        BatchNorm across data owners: averaged like every entry, or ``local`` (FedBN,
        arXiv 2102.07623): each owner's BatchNorm parameters and statistics kept as its
        own between rounds (:class:`sky_flower.sky.rounds.federation.LocalBatchNorm`).
    loss_weight_fn : Callable, optional
        ``loss_reduction="weighted"`` only: ``weight(labels) -> number``, what the loss
        averages over (e.g. :func:`sky_flower.pipeline.lm.token_count`).
    metric_fn : Callable (default: sky_flower.pipeline.objective.correct_count)
        ``metric(output, labels) -> int``, summed over the round as ``correct``
        (``train_accuracy`` = correct / samples). Both travel to the nodes by reference
        (module-level functions importable there).
    link_cache : dict[int, tuple[float, float, float]], optional
        Node id -> relay link timed by an earlier benchmark round on the same grid (not
        timed again; filled as links are timed).
    input_dtype : str (default: "float32")
        Dtype of the model's input (``"int64"`` for a language model's token ids): the
        profile, the benchmark and the ``direct`` stage 0 build their probes of it.
    replan, optimizer_state : ReplanConfig (default: off), str (default: "round")
        Online re-planning and optimizer state across rounds
        (:mod:`sky_flower.sky.planning.replan`).
    """

    def __init__(  # noqa: PLR0913
        self,
        model_fn: Callable[[], nn.Module],
        input_shape: Sequence[int],
        allocation: str = "heuristic",
        schedule: Schedule | None = None,
        optimizer: str = "adam",
        lr: float = 1e-4,
        local_epochs: float = 1.0,
        steps_per_round: int = 0,
        node_order: Sequence[str] = (),
        min_nodes: int = 2,
        milp_time_limit_s: float = 30.0,
        benchmark_warmup: int = 2,
        benchmark_repeats: int = 3,
        echo_bytes: tuple[int, int] = (1024, 4 * 1024 * 1024),
        echo_repeats: int = 3,
        echo_jitter_s: float = 0.1,
        state_probe_bytes: int = 16 * 1024 * 1024,
        message_timeout_s: float = 120.0,
        max_failed_rounds: int = 2,
        direct_timeout_s: float = 30.0,
        direct_host: str = "127.0.0.1",
        direct_join_timeout_s: float = 60.0,
        stream_host: str = "127.0.0.1",
        stream_bind: str = "127.0.0.1",
        stream_tls: bool = True,
        stream_max_frame_mb: float = 256.0,
        stream_timeout_s: float = 30.0,
        seed: int = 0,
        on_event: Callable[[str, dict], None] | None = None,
        poll_interval_s: float = 0.002,
        node_wait_s: float = 300.0,
        loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy,
        metric_fn: Callable[..., int] = correct_count,
        loss_reduction: str = "mean",
        loss_weight_fn: Callable[..., Any] | None = None,
        bn_policy: str = "average",
        link_cache: dict[int, Link] | None = None,
        input_dtype: str = "float32",
        divergence_factor: float = 0.0,
        deadlines: Deadlines = Deadlines(),  # noqa: B008 - frozen
        replan: ReplanConfig = ReplanConfig(),  # noqa: B008 - frozen
        optimizer_state: str = "round",
    ) -> None:
        planning.check_settings(
            allocation, optimizer, lr, local_epochs, steps_per_round, max_failed_rounds
        )
        ref(loss_fn), ref(metric_fn)  # must travel to the nodes by name
        LossReduction(loss_reduction, loss_weight_fn)  # refuses a bad pair
        if loss_weight_fn is not None:
            ref(loss_weight_fn)
        self.loss_reduction, self.loss_weight_fn = loss_reduction, loss_weight_fn
        if bn_policy not in federation.BN_POLICIES:
            raise ValueError(
                f"bn_policy (train.bn_policy) must be one of {', '.join(federation.BN_POLICIES)}"
                f", got {bn_policy!r}"
            )
        self.bn_policy = bn_policy
        if not direct_timeout_s > 0:
            raise ValueError(f"direct_timeout_s must be > 0 (got {direct_timeout_s})")
        if len(echo_bytes) != 2 or not 0 < echo_bytes[0] < echo_bytes[1]:
            raise ValueError(
                f"echo_bytes (benchmark.echo_bytes) must be two payload sizes in bytes, "
                f"0 < small < large, e.g. [1024, 4194304]; got {list(echo_bytes)}"
            )
        self.schedule = schedule or Schedule()
        self.runner_cls = RUNNERS[self.schedule.transport]
        self.runner_cls.check_schedule(self.schedule)
        self.model_fn, self.input_shape = model_fn, [int(s) for s in input_shape]
        self.input_dtype = dtype_name(input_dtype)  # refuses an unknown dtype
        self.allocation, self.optimizer, self.lr, self.seed = allocation, optimizer, lr, seed
        self.local_epochs, self.steps_per_round = local_epochs, steps_per_round
        self.node_order, self.min_nodes = list(node_order), min_nodes
        self.milp_time_limit_s = milp_time_limit_s
        self.benchmark_warmup, self.benchmark_repeats = benchmark_warmup, benchmark_repeats
        self.echo_bytes, self.echo_repeats = echo_bytes, echo_repeats
        self.echo_jitter_s, self.state_probe_bytes = echo_jitter_s, state_probe_bytes
        self.message_timeout_s, self.max_failed_rounds = message_timeout_s, max_failed_rounds
        self.guard = RoundGuard(divergence_factor)  # finite rounds; divergence if set
        self.direct_timeout_s, self.direct_host = direct_timeout_s, direct_host
        self.direct_join_timeout_s = direct_join_timeout_s
        self.stream = {  # RunSettings' stream_* fields
            "stream_host": stream_host,
            "stream_bind": stream_bind,
            "stream_tls": stream_tls,
            "stream_max_frame_bytes": int(stream_max_frame_mb * 2**20),
            "stream_timeout_s": stream_timeout_s,
        }
        self.poll_interval_s, self.node_wait_s = poll_interval_s, node_wait_s
        self.loss_fn, self.metric_fn, self.link_cache = loss_fn, metric_fn, link_cache
        self.on_event = on_event or (lambda kind, payload: None)
        self.layer_profiles: list[LayerProfile] = []
        self.node_profiles: list[NodeProfile] = []
        self.num_examples = 0
        self.plan: Plan | None = None
        self.cost: CostModel | None = None
        self.pipeline: Pipeline | None = None  # the first owner's (self.runs: all)
        self.federated: planning.FederatedPlanned | None = None
        self.runs: list[PipelineRun] = []
        self.samples: dict[str, int] = {}  # data owner -> examples
        self.group_size = self.schedule.microbatches  # micro-batches per relay message
        self.rounds: list[dict[str, Any]] = []
        self.failed_rounds: list[dict[str, Any]] = []
        self.global_arrays: ArrayRecord | None = None  # last good global model
        self._names: dict[int, str] = {}  # node id -> name
        self._ids: dict[str, int] = {}  # name -> node id
        self._handler_rate: dict[str, float] = {}
        self._stop = threading.Event()
        self.deadlines, self._ledger = deadlines, NodeLedger()
        self.init_replan(replan, optimizer_state)
        self.init_recovery()

    # -- settings shared with the benchmark and the runners -----------------------------
    def request_stop(self) -> None:
        """Make the running strategy stop at its next poll (raises ``SkyNodeError``)."""
        self._stop.set()

    def run_settings(self) -> RunSettings:
        """The settings every runner (and the benchmark's exchange) uses, read now (so
        that attributes set after construction, e.g. ``poll_interval_s``, count)."""
        return RunSettings(
            model_fn=self.model_fn,
            input_shape=tuple(self.input_shape),
            schedule=self.schedule,
            optimizer=self.optimizer,
            lr=self.lr,
            seed=self.seed,
            num_layers=len(self.profile_model()),
            message_timeout_s=self.message_timeout_s,
            poll_interval_s=self.poll_interval_s,
            direct_timeout_s=self.direct_timeout_s,
            direct_host=self.direct_host,
            direct_join_timeout_s=self.direct_join_timeout_s,
            **self.stream,
            input_dtype=self.input_dtype,
            loss_fn=self.loss_fn,
            metric_fn=self.metric_fn,
            loss_reduction=self.loss_reduction,
            loss_weight_fn=self.loss_weight_fn,
            stop=self._stop,
            describe=self._names.get,
            deadlines=self.deadlines,
            ledger=self._ledger,
            optimizer_store=self.optimizer_store,
        )

    def runner(self) -> Runner:
        """A fresh runner of the configured transport (one per pipeline)."""
        return self.runner_cls(self.run_settings())

    # -- wait, benchmark, plan ---------------------------------------------------------
    def wait_for_nodes(self, grid: Grid, timeout: float) -> list[int]:
        """Block until ``min_nodes`` nodes are connected, at most ``timeout`` s
        (:func:`sky_flower.sky.planning.benchmark.wait_for_nodes`).

        Raises
        ------
        SkyNodeError
            If no node is connected after ``timeout`` seconds, or the run is stopped.
        """
        return wait_for_nodes(grid, self.min_nodes, timeout, self._stop)

    def profile_model(self) -> list[LayerProfile]:
        """Per-layer FLOPs and bytes of the model (computed once, on the server)."""
        if not self.layer_profiles:
            args = (self.model_fn, self.input_shape, self.schedule, self.optimizer, self.lr)
            self.layer_profiles = planning.profile_model(*args, self.input_dtype)
        return self.layer_profiles

    def precheck(
        self, names: Sequence[str], memory_caps: Sequence[float | None], owners: int | None = None
    ) -> None:
        """Refuse, before any node is contacted, a fleet whose known memory caps make
        every plan infeasible, or ``even`` with a pipeline longer than the model
        (``owners``: data owners, where known; :func:`sky_flower.sky.planning.planning.precheck`).

        Raises
        ------
        InfeasibleMemoryError, ValueError
            As :func:`sky_flower.sky.planning.planning.precheck`.
        """
        planning.precheck(
            self.profile_model(), self.schedule, self.allocation, names, memory_caps, owners
        )

    def benchmark(self, grid: Grid, node_ids: list[int]) -> list[NodeProfile]:
        """Run the benchmark round (:class:`sky_flower.sky.planning.benchmark.BenchmarkRound`); a
        node whose reply is an error is left out with a warning.

        Raises
        ------
        SkyNodeError
            If no data owner answered.
        """
        found = self.benchmark_round(grid).run(node_ids, self.node_order)
        self.remember_benchmark(grid, found)  # sky_flower.sky.rounds.joins
        self.on_event("benchmark", benchmark_event(self.layer_profiles, found))
        return self.node_profiles

    def benchmark_table(self, emulation: dict[str, str] | None = None) -> str:
        """The benchmark round's results as a text table."""
        return benchmark_table(self.node_profiles, emulation)

    def make_plan(self, alternatives: bool = True) -> Plan:
        """Plan one pipeline per data owner over the profiled nodes
        (:func:`sky_flower.sky.planning.planning.make_federated_plan`; ``alternatives``: also
        predict the other allocations on this benchmark, for the ``plan`` event).
        Returns the first owner's pipeline plan (``self.plans`` holds them all)."""
        fed = planning.make_federated_plan(
            self.layer_profiles,
            self.node_profiles,
            self.samples,
            self.schedule,
            self.allocation,
            local_epochs=self.local_epochs,
            steps_per_round=self.steps_per_round,
            time_limit_s=self.milp_time_limit_s,
            alternatives=alternatives,
        )
        self.install_plan(fed)  # sky_flower.sky.rounds.replan_hook.RoundReplanning
        return self.plan

    @property
    def plans(self) -> list[Plan]:
        """Every data owner's pipeline plan, in pipeline order."""
        return [r.pipeline.plan for r in self.runs]

    def stage_predictions(self) -> list[dict[str, Any]]:
        """Per stage and step, what the cost model predicts
        (:func:`sky_flower.sky.planning.planning.stage_predictions`)."""
        assert self.pipeline is not None, "run the benchmark round and make_plan() first"
        return list(self.pipeline.predictions)

    def steps_in_round(self) -> int:
        """Training steps per round."""
        return planning.steps_in_round(
            self.steps_per_round, self.local_epochs, self.num_examples, self.schedule.batch_size
        )

    # -- Flower's Strategy interface ---------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``train.sky_setup`` message per stage (the relay's round set-up)."""
        assert self.pipeline is not None, "run the benchmark round and make_plan() first"
        runner = RelayRunner(self.run_settings())
        return runner.setup_messages(self.pipeline, arrays, server_round)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Reassemble the global model from the stages' weight replies (every layer
        exactly once, else ``SkyNodeError``)."""
        ex = Exchange(None, 1.0, describe=self._names.get, error_cls=SkyNodeError)  # type: ignore[arg-type]
        expected = set(self.model_fn().state_dict().keys())
        return merge_weights(list(replies), ex, expected, ARRAYS), None

    def summary(self) -> None:
        """Log the strategy's settings."""
        s = self.schedule
        log(INFO, "\t├── Allocation: %s", self.allocation)
        log(
            INFO,
            "\t├── Schedule: batch %d, %d micro-batch(es), %s, transport %s",
            s.batch_size,
            s.microbatches,
            s.kind,
            s.transport,
        )
        log(INFO, "\t└── Optimizer: %s (lr %g) on every stage", self.optimizer, self.lr)
        if s.transport == "direct":  # the stages' own links: no TLS there
            log(WARNING, "transport=direct: %s", PLAINTEXT)

    # -- the whole run -----------------------------------------------------------------
    def start(  # noqa: PLR0913
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Benchmark round, plan, then ``num_rounds`` rounds of split training.

        A round in which a node fails is recorded in ``self.rounds`` with its error
        (naming the node) and the next round starts from the last good global model;
        ``max_failed_rounds`` consecutive failures end the run with
        :class:`SkyNodeError`. The returned arrays are the last good global model.
        """
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        self.summary()
        local_bn = None  # train.bn_policy=local: refused up front for a model without BN
        if self.bn_policy == "local":
            local_bn = federation.LocalBatchNorm(federation.batchnorm_keys(self.model_fn()))
        t_start = time.time()
        self.benchmark(grid, self.wait_for_nodes(grid, timeout=min(timeout, self.node_wait_s)))
        self.make_plan()
        for run in self.runs:
            self.runner().check_plan(run.pipeline)
        result = Result(arrays=initial_arrays)
        self._evaluate(0, initial_arrays, evaluate_fn, result, {})
        self.global_arrays = initial_arrays
        report.log_round_header()
        failures = 0  # consecutive failed rounds
        for rnd in range(1, num_rounds + 1):
            self.note_returns(rnd, self.replan_cfg.mode)  # replan.mode=off: reported only
            row, new = federation.federated_round(
                grid, self.runs, self.runner, self.global_arrays, rnd, self.guard, local_bn
            )
            if new is None:
                failures += 1
                self._failed(rnd, row, failures)
                continue
            failures = 0
            self.round_trained(rnd)  # helpers set aside before it: their own fault
            result.arrays = self.global_arrays = new
            result.train_metrics_clientapp[rnd] = MetricRecord(
                {"train_loss": row["train_loss"], "train_accuracy": row["train_accuracy"]}
            )
            self._evaluate(rnd, self.global_arrays, evaluate_fn, result, row)
            self.rounds.append(row)
            report.log_round_line(row)
            report.log_stage_report(row, kinds_label(self.runner_cls, self.runs, self.schedule))
            report.log_pipelines(row)
            self.on_event("round", row)
            if row["failed_pipelines"]:
                self.partial_failure(rnd, row)  # sky_flower.sky.rounds.recovery
            self.replan_after(rnd, row, num_rounds)  # sky_flower.sky.rounds.replan_hook
        log(INFO, "Sky strategy finished in %.1f s", time.time() - t_start)
        self.log_final_summary(result)
        return result

    @staticmethod
    def _evaluate(
        rnd: int,
        arrays: ArrayRecord,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
        result: Result,
        row: dict[str, Any],
    ) -> None:
        """Server-side evaluation of round ``rnd``'s model into ``result`` and ``row``."""
        res = evaluate_fn(rnd, arrays) if evaluate_fn else None
        if rnd == 0 and evaluate_fn:
            log(INFO, "Initial global evaluation: %s", res)
        if res is not None:
            result.evaluate_metrics_serverapp[rnd] = res
            row.update({f"test_{k}": float(v) for k, v in res.items()})  # type: ignore[arg-type]

    def log_final_summary(self, result: Result) -> None:
        """Log the plan and the final results (:func:`sky_flower.sky.rounds.report.log_final`)."""
        report.log_final(self.plans, self.allocation, result)
