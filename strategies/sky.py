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

This module holds only the Flower ``Strategy`` and its loop, which calls named parts
that return values (:meth:`SkyStrategy._run`): a benchmarker
(:class:`sky_flower.sky.rounds.joins.Benchmarker`: the benchmark round and mid-run
joins), a planner (:class:`sky_flower.sky.rounds.planner.Planner`: plan and re-plan), a
round executor (:class:`sky_flower.sky.rounds.executor.RoundExecutor`: pipelines,
runners, FedAvg), a failure policy (:class:`sky_flower.sky.rounds.recovery.Recovery`)
and an evaluator (:class:`sky_flower.sky.rounds.executor.Evaluator`). The loop is the
only writer of the run's :class:`sky_flower.sky.rounds.state.RunState`; observers
subscribe through :class:`sky_flower.sky.rounds.hooks.SkyHooks` and get typed events.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from sky_flower.core.cost import CostModel
from sky_flower.core.partition import Plan
from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.flower.strategy import ServerSideEvaluation
from sky_flower.pipeline.graph import ModuleKeys
from sky_flower.sky.model import SkyModel
from sky_flower.sky.planning import planning
from sky_flower.sky.planning.benchmark import Link, wait_for_nodes
from sky_flower.sky.planning.replan import ReplanRecord
from sky_flower.sky.rounds import report
from sky_flower.sky.rounds.blame import Verdict, diverged_text
from sky_flower.sky.rounds.executor import RUNNERS, Evaluator, RoundExecutor
from sky_flower.sky.rounds.hooks import (
    BenchmarkEnd,
    EventCallback,
    HookList,
    PlanInstalled,
    RoundEnd,
    RunEnd,
    RunRecords,
    RunStart,
    SkyHooks,
)
from sky_flower.sky.rounds.joins import Benchmarker, Fleet, Joined
from sky_flower.sky.rounds.planner import Planner
from sky_flower.sky.rounds.records import (
    FailedRound,
    JoinRecord,
    RoundFailure,
    RoundRecord,
    pipelines_failure,
)
from sky_flower.sky.rounds.recovery import Recovery
from sky_flower.sky.rounds.state import RunState
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.direct import kinds_label
from sky_flower.sky.transport.runner import (
    Pipeline,
    Runner,
    RunSettings,
    SkyNodeError,
)

PLAINTEXT = (  # logged when transport=direct
    "activations, gradients and weights travel between the stage nodes in plaintext (gloo "
    "has no encryption), whatever protects the SuperLink: use it on a trusted network only"
)

__all__ = ["RUNNERS", "EventCallback", "SkyHooks", "SkyModel", "SkyNodeError", "SkyStrategy"]


# the old constructor's keywords that are not settings, and where they went
_MOVED = {
    "model_fn": "SkyModel(model_fn, input_shape)",
    "input_shape": "SkyModel(model_fn, input_shape)",
    "input_dtype": "SkyModel(..., input_dtype=...)",
    "loss_fn": "SkyModel(..., loss_fn=...)",
    "metric_fn": "SkyModel(..., metric_fn=...)",
    "loss_reduction": "SkyModel(..., reduction=LossReduction(...))",
    "loss_weight_fn": "SkyModel(..., reduction=LossReduction('weighted', fn))",
    "on_event": "hooks=[EventCallback(on_event)]",
    "schedule": "SkySettings().replace({'schedule.batch_size': ..., 'schedule.kind': ...})",
    "deadlines": "SkySettings().replace({'deadlines.setup_s': ..., ...})",
    "replan": "SkySettings().replace({'replan.mode': ..., ...})",
    "state_probe_bytes": "SkySettings().replace({'benchmark.state_probe_mb': ...})",
}


def migration_hint(removed: dict[str, Any]) -> str:
    """The error for keywords of ``SkyStrategy``'s old constructor: where each went
    (a ``SkyModel`` field, a hook, or a setting's Hydra path for ``SkySettings.replace``)."""
    from sky_flower.sky.settings import settings_fields

    by_name: dict[str, str] = {}
    for s in settings_fields():
        if s.hydra:
            by_name.setdefault(s.field.name, s.path)
            by_name.setdefault(s.path.replace(".", "_"), s.path)  # e.g. stream_timeout_s
    by_name |= {"allocation": "allocation.method", "milp_time_limit_s": "allocation.time_limit_s"}
    by_name |= {"fleet": "fleet.name"}
    lines = []
    for key in removed:
        if key in _MOVED:
            lines.append(f"{key}: {_MOVED[key]}")
        elif key in by_name:
            lines.append(f"{key}: SkySettings().replace({{'{by_name[key]}': ...}})")
        else:
            lines.append(f"{key}: not a SkyStrategy argument")
    return (
        f"SkyStrategy takes (model, settings, *, node_order, min_nodes, hooks, link_cache) "
        f"since issue 29; unexpected keyword(s) {', '.join(sorted(removed))}. Where they "
        f"went: " + "; ".join(lines)
    )


class SkyStrategy(Strategy):
    """Split-model training with a benchmark round and a load-balanced layer plan.

    Parameters
    ----------
    model : SkyModel
        What is trained: ``model_fn``, one sample's shape and dtype, the loss (and how
        it reduces over a micro-batch) and the metric (:class:`sky_flower.sky.model.SkyModel`).
    settings : SkySettings (default: SkySettings())
        Every setting of the run (:mod:`sky_flower.sky.settings`, documented in
        docs/configuration.md): allocation, schedule and transport, training,
        benchmark round, failure policy and deadlines, re-planning. Read from Hydra
        (``SkySettings.from_hydra``), a run config (``from_run_config``), or built in
        Python (``SkySettings().replace({"train.lr": 0.01})``). ``num_rounds`` is
        ``start``'s, as with Flower's strategies; ``objective`` is how a config names
        ``model``'s loss (``SkyModel.from_settings``).
    node_order : Sequence[str] (default: ())
        Pipeline order by node name (fleet order); the first data owner is always
        stage 0. Nodes not listed follow in name order.
    min_nodes : int (default: 2)
        Wait for this many connected nodes before the benchmark round (set it to your
        fleet's size: nodes that connect later are not in the plan); ``0``: every node
        that connects within ``messaging.node_wait_s`` (a federation without a fleet).
    hooks : Sequence[SkyHooks] (default: ())
        Observers called at each point of the run (:class:`SkyHooks`; a function
        ``fn(kind, payload)`` as ``EventCallback(fn)``).
    link_cache : dict[int, tuple[float, float, float]], optional
        Node id -> relay link timed by an earlier benchmark round on the same grid (not
        timed again; filled as links are timed).
    concurrent_clientapps : int, optional
        How many ClientApps the runtime runs at once (Flower's simulation engine: its
        workers, ``floor(CPUs / simulation.num_cpus_per_node)``); ``None``: no bound (a
        deployment runs each message in a process of its own). Stage sessions hold one
        per stage of every pipeline (:class:`sky_flower.sky.transport.session.
        StreamSessions`): a pipeline with more stages is refused, a plan with more in
        all sets its stages up every round.

    Raises
    ------
    ValueError
        If the transport cannot run the schedule, ``train.bn_policy=local`` with a model
        without BatchNorm (naming the settings), or the model's loss or metric cannot
        travel to the nodes by reference.

    Notes
    -----
    A failed round is recorded with its error (``rounds`` and ``failed_rounds``); the
    nodes whose own fault it was are dropped (a data owner cannot be) and the model is
    re-planned; non-finite replies are judged by :func:`sky_flower.sky.rounds.blame.judge`
    (the training diverged: nobody is dropped; or one helper is set aside for a round);
    ``failure.max_failed_rounds`` consecutive failed rounds end the run with
    :class:`SkyNodeError`.
    """

    def __init__(
        self,
        model: SkyModel | None = None,  # required; None only to name old keywords' new home
        settings: SkySettings | None = None,
        *,
        node_order: Sequence[str] = (),
        min_nodes: int = 2,
        hooks: Sequence[SkyHooks] = (),
        link_cache: dict[int, Link] | None = None,
        concurrent_clientapps: int | None = None,
        **removed: Any,  # noqa: ANN401 - the keywords of the old signature: refused, with their new home
    ) -> None:
        if removed:
            raise TypeError(migration_hint(removed))
        if not isinstance(model, SkyModel):
            raise TypeError(
                f"SkyStrategy's first argument is a SkyModel (model_fn, input_shape, loss, "
                f"metric), got {type(model).__name__}: e.g. SkyStrategy(SkyModel(Net, [64]), "
                f"SkySettings())"
            )
        if settings is not None and not isinstance(settings, SkySettings):
            raise TypeError(
                f"SkyStrategy's settings are a SkySettings, got {type(settings).__name__}: for "
                f"a few values use SkySettings().replace({{'train.lr': 0.01, ...}}) (keys are "
                f"Hydra paths), or SkySettings.from_run_config(context.run_config)"
            )
        self.model, self.settings = model, settings or SkySettings()
        self.schedule = self.settings.schedule_object()
        self.node_order, self.min_nodes = list(node_order), min_nodes
        self.hooks = HookList(hooks)
        self.state = RunState()
        store = None
        if self.settings.train.optimizer_state == "keep":
            from sky_flower.sky.migration import OptimizerStore

            store = OptimizerStore()
        self.executor = RoundExecutor(model, self.settings, store, capacity=concurrent_clientapps)
        self.benchmarker = Benchmarker(
            self.settings, model.input_shape, model.input_dtype, link_cache
        )
        self.planner = Planner(self.settings, model)
        self.recovery = Recovery(self.settings)

    # -- what a caller reads: the run's state ------------------------------------------
    @property
    def rounds(self) -> list[RoundRecord]:
        """Every round, trained or failed (:class:`RoundRecord`; each reads as its
        ``results.json`` row too)."""
        return self.state.rounds

    @property
    def failed_rounds(self) -> list[FailedRound]:
        """What recovery did after each failed round."""
        return self.state.failed_rounds

    @property
    def replans(self) -> list[ReplanRecord]:
        """Every re-plan taken."""
        return self.state.replans

    @property
    def joins(self) -> list[JoinRecord]:
        """Every node that joined or came back."""
        return self.state.joins

    @property
    def dropped(self) -> dict[str, int]:
        """Node name -> node id of every node dropped for its own fault."""
        return self.state.dropped

    @property
    def node_profiles(self) -> list[NodeProfile]:
        """The nodes planned with now."""
        return self.state.node_profiles

    @property
    def global_arrays(self) -> ArrayRecord | None:
        """The last good global model."""
        return self.state.global_arrays

    @property
    def federated(self) -> planning.FederatedPlanned | None:
        """The plan the next round runs (every data owner's pipeline)."""
        return self.state.federated

    @property
    def runs(self) -> list[planning.PipelineRun]:
        """The pipelines the next round runs, one per data owner."""
        return self.state.runs

    @property
    def plan(self) -> Plan | None:
        """The first data owner's pipeline plan (:attr:`plans`: all)."""
        fed = self.state.federated
        return fed.planned[0].plan if fed is not None else None

    @property
    def cost(self) -> CostModel | None:
        """The first data owner's pipeline's cost model."""
        fed = self.state.federated
        return fed.planned[0].cost if fed is not None else None

    @property
    def pipeline(self) -> Pipeline | None:
        """The first data owner's pipeline (:attr:`runs`: all)."""
        return self.state.runs[0].pipeline if self.state.runs else None

    @property
    def plans(self) -> list[Plan]:
        """Every data owner's pipeline plan, in pipeline order."""
        return [r.pipeline.plan for r in self.state.runs]

    def records(self) -> RunRecords:
        """What the run has recorded so far (``results.json``'s lists), as they stand."""
        st = self.state
        return RunRecords(
            tuple(st.rounds), tuple(st.failed_rounds), tuple(st.replans), tuple(st.joins)
        )

    # -- steps a caller may run one by one (tests, benchmarks) -------------------------
    def subscribe(self, hook: SkyHooks) -> None:
        """Add an observer after construction (called after those given as ``hooks``).

        Raises
        ------
        TypeError
            If ``hook`` is not a :class:`SkyHooks`.
        """
        self.hooks.add(hook)

    def request_stop(self) -> None:
        """Make the running strategy stop at its next poll (raises ``SkyNodeError``)."""
        self.executor.stop.set()

    def run_settings(self) -> RunSettings:
        """The settings every runner (and the benchmark's exchange) uses."""
        return self.executor.run_settings(len(self.profile_model()), self.state.names)

    def runner(self) -> Runner:
        """A fresh runner of the configured transport (one per pipeline)."""
        return self.executor.runner_cls(self.run_settings())

    def check_plan(self, pipeline: Pipeline) -> None:
        """Raise ``ValueError`` if the transport cannot run ``pipeline``
        (:meth:`sky_flower.sky.rounds.executor.RoundExecutor.check_plan`)."""
        self.executor.check_plan(pipeline, self.run_settings())

    def wait_for_nodes(self, grid: Grid, timeout: float) -> list[int]:
        """Block until ``min_nodes`` nodes are connected, at most ``timeout`` s.

        Raises
        ------
        SkyNodeError
            If no node is connected after ``timeout`` seconds, or the run is stopped.
        """
        return wait_for_nodes(grid, self.min_nodes, timeout, self.executor.stop)

    def profile_model(self) -> list[LayerProfile]:
        """Per-layer FLOPs and bytes of the model (computed once, on the server)."""
        if not self.state.layer_profiles:
            self.state.layer_profiles = self.planner.profile_model()
        return self.state.layer_profiles

    def precheck(
        self,
        names: Sequence[str],
        memory_caps: Sequence[float | None],
        holds_data: Sequence[bool] | None = None,
    ) -> None:
        """Refuse, before any node is contacted, a fleet whose known memory caps make
        every plan infeasible, or ``even`` with a pipeline longer than the model or
        whose equal cuts overflow a cap whatever the owners' sample counts
        (``holds_data``: which nodes own data, where known;
        :func:`sky_flower.sky.planning.planning.precheck`).

        Raises
        ------
        InfeasibleMemoryError, ValueError
            As :func:`sky_flower.sky.planning.planning.precheck`.
        """
        planning.precheck(
            self.profile_model(),
            self.schedule,
            self.settings.allocation.method,
            names,
            memory_caps,
            holds_data,
        )

    def benchmark(self, grid: Grid, node_ids: list[int]) -> list[NodeProfile]:
        """Run the benchmark round (a node whose reply is an error is left out with a
        warning); returns the profiles.

        Raises
        ------
        SkyNodeError
            If no data owner answered.
        """
        st, layers, run = self.state, self.profile_model(), self.run_settings()
        links = self.executor.link_timing(run)
        found = self.benchmarker.run(grid, node_ids, self.node_order, layers, run, links, st.names)
        st.node_profiles, st.ids = found.nodes, found.node_ids
        st.num_examples, st.handler_rate = found.num_examples, found.handler_rate
        st.samples = dict(found.samples)
        st.names.update(found.names)
        self.executor.bound_by_runtime(found.runtime_workers)
        self.hooks.on_benchmark(BenchmarkEnd(tuple(layers), tuple(found.nodes), found.emulation))
        return st.node_profiles

    def make_plan(self, alternatives: bool = True) -> Plan:
        """Plan one pipeline per data owner over the profiled nodes and install it
        (``alternatives``: also predict the other allocations, for the ``plan`` event).
        Returns the first owner's pipeline plan (:attr:`plans` holds them all).

        Raises
        ------
        ValueError
            If no node has been profiled yet, or no plan fits the nodes' memory.
        """
        st = self.state
        fed = self.planner.plan(st.layer_profiles, st.node_profiles, st.samples, alternatives)
        self._install(fed)
        return fed.planned[0].plan

    def _install(self, fed: planning.FederatedPlanned) -> None:
        """Run ``fed`` from the next round and call the hooks' ``on_plan``."""
        st = self.state
        st.federated = fed
        st.runs = planning.pipeline_runs(fed, st.node_profiles, st.ids, st.handler_rate)
        self.planner.installed()
        self.hooks.on_plan(PlanInstalled(fed))

    # -- Flower's Strategy interface ---------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Not used: :meth:`start` runs each round through its transport's runner."""
        raise NotImplementedError("SkyStrategy runs its rounds in start()")

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Not used: :meth:`start` aggregates each round itself (FedAvg of the pipelines)."""
        raise NotImplementedError("SkyStrategy runs its rounds in start()")

    # no node-side evaluation: the server evaluates (``start(evaluate_fn=...)``); the
    # functions, not a base class, of what every server-side-evaluated strategy shares
    configure_evaluate = ServerSideEvaluation.configure_evaluate
    aggregate_evaluate = ServerSideEvaluation.aggregate_evaluate

    def summary(self) -> None:
        """Log the strategy's settings."""
        s, t = self.schedule, self.settings.train
        log(INFO, "\t├── Allocation: %s", self.settings.allocation.method)
        log(
            INFO,
            "\t├── Schedule: batch %d, %d micro-batch(es), %s, transport %s",
            s.batch_size,
            s.microbatches,
            s.kind,
            s.transport,
        )
        log(INFO, "\t└── Optimizer: %s (lr %g) on every stage", t.optimizer, t.lr)
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

        A round in which a node fails is recorded in ``rounds`` with its error (naming
        the node) and the next round starts from the last good global model;
        ``failure.max_failed_rounds`` consecutive failures end the run with
        :class:`SkyNodeError`. The returned arrays are the last good global model. The
        hooks' ``on_start`` runs first and ``on_end`` last, with the error if one ends
        the run.
        """
        keys = self._module_keys(initial_arrays)
        if keys is not None:  # the app's own Net().state_dict(): the converted model's in
            initial_arrays = ArrayRecord(keys.to_converted(initial_arrays.to_torch_state_dict()))
            evaluate_fn = _evaluated_as(keys, evaluate_fn)
        s = self.settings
        self.hooks.on_start(RunStart(num_rounds, s.allocation.method, self.schedule.transport))
        try:
            result = self._run(grid, initial_arrays, num_rounds, timeout, evaluate_fn)
        except BaseException as err:
            self.executor.close()
            self.hooks.on_end(RunEnd(self.records(), err))
            raise
        self.executor.close()  # stage sessions end with the run
        self.hooks.on_end(RunEnd(self.records(), None))
        if keys is not None:  # and the user's keys out
            result.arrays = ArrayRecord(keys.to_original(result.arrays.to_torch_state_dict()))
        return result

    def _module_keys(self, arrays: ArrayRecord) -> ModuleKeys | None:
        """How ``arrays`` (``initial_arrays``) key the model: like the converted model
        (None) or like the module ``model_fn`` converted (a Flower app's
        ``ArrayRecord(Net().state_dict())``), see
        :class:`sky_flower.pipeline.graph.ModuleKeys`."""
        model = self.model.model_fn()
        if set(arrays.keys()) == set(model.state_dict()):
            return None
        return ModuleKeys.of(model, arrays.to_torch_state_dict())

    def _run(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
    ) -> Result:
        """The loop: benchmark -> plan -> per round: run -> evaluate -> report ->
        recover / re-plan. Each part returns what it found; only this loop (and the
        helpers below it) writes the run's state."""
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        self.summary()
        st, evaluator = self.state, Evaluator(evaluate_fn)
        t_start = time.time()
        wait_s = min(timeout, self.settings.messaging.node_wait_s)
        self.benchmark(grid, self.wait_for_nodes(grid, timeout=wait_s))
        self.make_plan()
        for run in st.runs:
            self.check_plan(run.pipeline)
        result = Result(arrays=initial_arrays)
        self._evaluate(evaluator, 0, initial_arrays, result)
        st.global_arrays = initial_arrays
        report.log_round_header()
        failures = 0  # consecutive failed rounds
        trained = 0
        for rnd in range(1, num_rounds + 1):
            mode = self.settings.replan.mode
            self._joined(self.benchmarker.note_returns(rnd, mode, self._fleet()))  # off only
            res = self.executor.run(grid, st.runs, st.global_arrays, rnd, self.run_settings())
            if self.executor.stop.is_set():  # Ctrl-C, SIGTERM: what broke is no node's fault
                raise SkyNodeError(f"run stopped by the caller in round {rnd} (not recorded)")
            row, new = res.record, res.arrays
            if res.failure is not None or new is None:
                assert res.failure is not None
                failures += 1
                self._failed(rnd, row, res.failure, failures)
                if rnd == num_rounds and not trained:  # fewer rounds than max_failed_rounds
                    raise SkyNodeError(
                        f"none of the {num_rounds} round(s) trained (the last: "
                        f"{res.failure}); the global model is the initial one"
                    )
                continue
            trained += 1
            failures = 0
            self._drop_confirmed(rnd)  # helpers set aside before it: their own fault
            result.arrays = st.global_arrays = new
            result.train_metrics_clientapp[rnd] = MetricRecord(
                {"train_loss": row.train_loss, "train_accuracy": row.train_accuracy}
            )
            self._evaluate(evaluator, rnd, new, result, row)
            partial = pipelines_failure(row.failed_pipelines) if row.failed_pipelines else None
            verdict = None
            if partial is not None:  # decided before the round is reported
                verdict = self.recovery.decide(partial, st.node_profiles, st.runs, partial=True)
                row.diverged = verdict.diverged or None
            st.rounds.append(row)
            report.log_round(row, kinds_label(self.executor.runner_cls, st.runs, self.schedule))
            self.hooks.on_round(RoundEnd(row, self.records()))
            if partial is not None and verdict is not None:
                if verdict.diverged:
                    text = diverged_text(rnd, verdict.diverged, self.recovery.lr)
                    log(WARNING, "Round %d: %s", rnd, text)
                self._recover(rnd, partial, verdict, partial=True)
            self._replan_after(rnd, row, num_rounds)
        log(INFO, "Sky strategy finished in %.1f s", time.time() - t_start)
        report.log_final(self.plans, self.settings.allocation.method, result)
        return result

    def _evaluate(
        self,
        evaluator: Evaluator,
        server_round: int,
        arrays: ArrayRecord,
        result: Result,
        row: RoundRecord | None = None,
    ) -> None:
        """Evaluate round ``server_round``'s model into ``result`` and ``row.test``."""
        metrics = evaluator.evaluate(server_round, arrays, result)
        if metrics is None:
            return
        if row is not None:
            row.test.update(metrics)
        self.hooks.on_evaluate(server_round, metrics)

    # -- the loop's steps that change the fleet ----------------------------------------
    def _fleet(self) -> Fleet:
        """The fleet as the run knows it now (read by the benchmarker)."""
        st = self.state
        return Fleet(st.node_profiles, st.ids, st.names, st.dropped, st.rejoin_asked)

    def _joined(self, joined: Joined) -> list[str]:
        """Add the helpers that joined (tracked by the planner) and record the joins."""
        st = self.state
        st.names.update(joined.names)
        st.rejoin_asked |= joined.asked
        st.handler_rate.update(joined.handler_rate)
        st.node_profiles.extend(self.planner.track(node) for node in joined.nodes)
        st.ids.update(joined.ids)
        for name in joined.rejoined:
            st.dropped.pop(name, None)
        st.joins.extend(joined.joins)
        return [node.name for node in joined.nodes]

    def _replan_after(self, rnd: int, row: RoundRecord, num_rounds: int) -> None:
        """After round ``rnd`` trained: update the profiles and, when the planner says
        so, install a better plan for the next round (profiling joiners first)."""
        st = self.state
        if not self.planner.observes(row, st.federated is not None):
            return
        st.node_profiles = self.planner.observe(row, st.node_profiles)
        if rnd >= num_rounds:
            return
        run = self.run_settings()
        joined = self._joined(  # profiled now, planned with below
            self.benchmarker.admit_joiners(
                rnd + 1, st.layer_profiles, run, self.executor.link_timing(run), self._fleet()
            )
        )
        d = self.planner.replan(
            rnd,
            row,
            num_rounds,
            st.federated,
            st.layer_profiles,
            st.node_profiles,
            st.samples,
            joined,
        )
        if d is None or d.new is None:
            return
        runs = planning.pipeline_runs(d.new, st.node_profiles, st.ids, st.handler_rate)
        try:
            for r in runs:
                self.check_plan(r.pipeline)
        except ValueError as err:
            log(WARNING, "Not re-planning after round %d: %s", rnd, err)
            return
        st.replans.append(self.planner.taken(rnd, d, joined))
        self._install(d.new)

    def _report_failed(self, record: RoundRecord) -> None:
        """Record a failed round and report it."""
        self.state.rounds.append(record)
        self.hooks.on_round(RoundEnd(record, self.records()))

    def _failed(self, rnd: int, row: RoundRecord, failure: RoundFailure, failures: int) -> None:
        """Record failed round ``rnd`` (``row``: its time), end the run at
        ``failure.max_failed_rounds``, else act on the recovery's verdict.

        Raises
        ------
        TrainingDiverged
            If the training diverged and ``failures`` consecutive rounds have failed.
        SkyNodeError
            If ``failures`` consecutive rounds have failed (``max_failed_rounds``).
        """
        st, rec = self.state, self.recovery
        verdict = rec.decide(failure, st.node_profiles, st.runs)
        if verdict.diverged:
            text = rec.diverged(rnd, failure, verdict)
            restored = self._put_back()
            log(WARNING, "Round %d failed: %s. The last good global model is kept.", rnd, text)
            st.failed_rounds.append(
                FailedRound(rnd, text, [], diverged=True, restored_nodes=restored or None)
            )
            error = f"round {rnd} failed: {text}"
            self._report_failed(RoundRecord(rnd, row.round_time_s, error=error, diverged=True))
            if failures >= rec.max_failed_rounds:
                raise rec.end_diverged(text, failures) from None  # shown as it is
            return
        log(
            WARNING,
            "Round %d failed: %s. The last good global model is kept (%d consecutive "
            "failed round(s) of at most max_failed_rounds=%d).",
            rnd,
            failure,
            failures,
            rec.max_failed_rounds,
        )
        last = failures >= rec.max_failed_rounds
        if last:  # the round that ends the run is listed too
            st.failed_rounds.append(FailedRound(rnd, str(failure), []))
        self._report_failed(
            RoundRecord(rnd, row.round_time_s, error=f"round {rnd} failed: {failure}")
        )
        if last:
            end = rec.end(rnd, failure, failures)
            raise end from end.__cause__
        self._recover(rnd, failure, verdict)

    def _recover(
        self, rnd: int, failure: RoundFailure, verdict: Verdict, partial: bool = False
    ) -> None:
        """After round ``rnd`` failed with ``failure`` (the run goes on): drop the nodes
        whose own fault it was (``verdict.drop``), set aside ``verdict.set_aside`` for the
        next round, and re-plan on the others. A data owner is never dropped (stage 0
        needs its data): a round it failed is simply retried, as is one whose nodes
        cannot be left out (the others cannot hold the model). Records
        ``failed_rounds`` unless ``partial`` (the round row names the failed pipelines)."""
        st = self.state
        out = self._leave_out(set(verdict.drop) | set(verdict.set_aside))
        dropped = [p.name for p, _ in out if p.name in verdict.drop]
        aside = [p.name for p, _ in out if p.name in verdict.set_aside]
        for name in dropped:
            self._drop(name)
        record = FailedRound(rnd, str(failure), dropped, set_aside=aside or None)
        self.recovery.set_aside([(p, i) for p, i in out if p.name in aside], record)
        if not partial:  # a round some pipelines finished is recorded in its row
            st.failed_rounds.append(record)
        if out:
            parts = [f"dropped {', '.join(dropped)}" if dropped else ""]
            if aside:
                parts.append(
                    f"set aside {', '.join(aside)} for one round (non-finite output on "
                    "finite input: dropped if the next round trains without it, put "
                    "back if it goes non-finite again)"
                )
            log(
                WARNING,
                "Round %d failed; %s and re-planned on %d node(s)",
                rnd,
                "; ".join(part for part in parts if part),
                len(st.node_profiles),
            )

    def _leave_out(self, names: set[str]) -> list[tuple[NodeProfile, int]]:
        """Remove the helpers named from the fleet and re-plan; keep them (and the plan)
        when the others cannot hold the model. Returns those left out, each with its
        index in the fleet."""
        st = self.state
        out = [
            (n, i) for i, n in enumerate(st.node_profiles) if n.name in names and not n.holds_data
        ]
        if not out:
            return []
        old, failed = st.node_profiles, [p for p, _ in out]
        st.node_profiles = [n for n in old if n not in failed]
        try:
            self.make_plan(alternatives=False)
        except ValueError as plan_err:  # e.g. the others cannot hold the model
            st.node_profiles = old
            self.make_plan(alternatives=False)
            log(
                WARNING,
                "Cannot re-plan without %s: %s",
                ", ".join(p.name for p, _ in out),
                plan_err,
            )
            return []
        return out

    def _put_back(self) -> list[str]:
        """Return the helpers set aside to the fleet and re-plan; their names."""
        back = self.recovery.put_back()
        if not back:
            return []
        st = self.state
        names = [prof.name for prof, _, _ in back]
        old = list(st.node_profiles)
        for prof, index, record in sorted(back, key=lambda b: b[1]):
            st.node_profiles.insert(min(index, len(st.node_profiles)), prof)
            record.restored_nodes = [*(record.restored_nodes or []), prof.name]
        try:
            self.make_plan(alternatives=False)
        except ValueError as plan_err:  # cannot happen: they held the model before
            st.node_profiles = old
            log(WARNING, "Cannot re-plan with %s put back: %s", ", ".join(names), plan_err)
            return []
        log(
            WARNING,
            "Put %s back (set aside after a non-finite round, but the training itself "
            "diverged) and re-planned on %d node(s)",
            ", ".join(names),
            len(st.node_profiles),
        )
        return names

    def _drop_confirmed(self, rnd: int) -> None:
        """After round ``rnd`` trained: drop the helpers set aside before it (the round
        trained finite without them); re-admitted only after they leave the node list
        and come back (a restart), not on the next profile."""
        for name, record in self.recovery.round_trained(rnd):
            record.dropped_nodes = [*record.dropped_nodes, name]
            nid = self._drop(name)
            if nid is not None:
                self.state.rejoin_asked.add(nid)

    def _drop(self, name: str) -> int | None:
        """Drop node ``name`` for its own fault (out of ``ids``, into ``dropped``); its id."""
        nid = self.state.ids.pop(name, None)
        if nid is not None:
            self.state.dropped[name] = nid
        return nid


def _evaluated_as(
    keys: ModuleKeys, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None
) -> Callable[[int, ArrayRecord], MetricRecord | None] | None:
    """``evaluate_fn`` handed the global model keyed like the user's module."""
    if evaluate_fn is None:
        return None

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        return evaluate_fn(
            server_round, ArrayRecord(keys.to_original(arrays.to_torch_state_dict()))
        )

    return evaluate
