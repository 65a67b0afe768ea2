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

This module holds only the Flower ``Strategy``, composed of named parts that share one
:class:`sky_flower.sky.rounds.state.RunState`: a benchmarker
(:class:`sky_flower.sky.rounds.joins.Benchmarker`: the benchmark round and mid-run
joins), a planner (:class:`sky_flower.sky.rounds.planner.Planner`: plan and re-plan), a
round executor (:class:`sky_flower.sky.rounds.executor.RoundExecutor`: pipelines,
runners, FedAvg), a failure policy (:class:`sky_flower.sky.rounds.recovery.Recovery`)
and an evaluator (:class:`sky_flower.sky.rounds.executor.Evaluator`). Observers
subscribe through :class:`sky_flower.sky.rounds.hooks.SkyHooks`.
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
from sky_flower.flower.exchange import Exchange
from sky_flower.flower.strategy import ServerSideEvaluation
from sky_flower.pipeline.graph import ModuleKeys
from sky_flower.sky.model import SkyModel
from sky_flower.sky.planning import planning
from sky_flower.sky.planning.benchmark import Link, wait_for_nodes
from sky_flower.sky.protocol import ARRAYS
from sky_flower.sky.rounds import report
from sky_flower.sky.rounds.executor import RUNNERS, Evaluator, RoundExecutor
from sky_flower.sky.rounds.hooks import EventCallback, HookList, SkyHooks
from sky_flower.sky.rounds.joins import Benchmarker
from sky_flower.sky.rounds.planner import Planner
from sky_flower.sky.rounds.records import RoundRecord
from sky_flower.sky.rounds.recovery import Recovery
from sky_flower.sky.rounds.state import RunState
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.direct import kinds_label
from sky_flower.sky.transport.relay import RelayRunner
from sky_flower.sky.transport.runner import (
    Pipeline,
    Runner,
    RunSettings,
    SkyNodeError,
    merge_weights,
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
    "stream_max_frame_mb": "SkySettings().replace({'schedule.stream_max_frame_mb': ...})",
}


def migration_hint(removed: dict[str, Any]) -> str:
    """The error for keywords of ``SkyStrategy``'s old constructor: where each went
    (a ``SkyModel`` field, a hook, or a setting's Hydra path for ``SkySettings.replace``)."""
    from sky_flower.sky.settings import settings_fields

    by_name: dict[str, str] = {}
    for f, _ in settings_fields():
        path = f.metadata["hydra"]
        if path:
            by_name.setdefault(f.name, path)
            by_name.setdefault(path.replace(".", "_"), path)
    by_name |= {"allocation": "allocation.method", "milp_time_limit_s": "allocation.time_limit_s"}
    by_name |= {f"benchmark_{k}": f"benchmark.{k}" for k in ("warmup", "repeats")}
    by_name |= {f"direct_{k}": f"schedule.direct_{k}" for k in ("timeout_s", "host")}
    by_name |= {"direct_join_timeout_s": "schedule.direct_join_timeout_s"}
    by_name |= {f"stream_{k}": f"schedule.stream_{k}" for k in ("host", "bind", "tls")}
    by_name |= {"stream_timeout_s": "schedule.stream_timeout_s"}
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
        if self.settings.replan.optimizer_state == "keep":
            from sky_flower.sky.migration import OptimizerStore

            store = OptimizerStore()
        self.executor = RoundExecutor(
            self.state, model, self.settings, self.schedule, self.profile_model, store
        )
        self.benchmarker = Benchmarker(
            self.state,
            self.settings,
            self.schedule,
            model.input_shape,
            model.input_dtype,
            self.executor.run_settings,
            self.executor.link_timing,
            self.hooks,
            link_cache,
        )
        self.planner = Planner(
            self.state,
            self.settings,
            self.schedule,
            model,
            self.executor.check_plan,
            self.benchmarker.admit_joiners,
            self.hooks,
        )
        self.recovery = Recovery(self.state, self.settings, self.planner.make_plan, self.hooks)

    # -- what a caller reads: the run's state ------------------------------------------
    @property
    def rounds(self) -> list[RoundRecord]:
        """Every round, trained or failed (:class:`RoundRecord`; each reads as its
        ``results.json`` row too)."""
        return self.state.rounds

    @property
    def failed_rounds(self) -> list[dict[str, Any]]:
        """What recovery did after each failed round."""
        return self.state.failed_rounds

    @property
    def replans(self) -> list[dict[str, Any]]:
        """Every re-plan taken."""
        return self.state.replans

    @property
    def joins(self) -> list[dict[str, Any]]:
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
    def layer_profiles(self) -> list[LayerProfile]:
        """The model's layer profiles (after :meth:`profile_model`)."""
        return self.state.layer_profiles

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
        return self.executor.run_settings()

    def runner(self) -> Runner:
        """A fresh runner of the configured transport (one per pipeline)."""
        return self.executor.runner()

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
        return self.planner.profile_model()

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
            self.settings.allocation,
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
        self.profile_model()
        self.benchmarker.run(grid, node_ids, self.node_order)
        return self.state.node_profiles

    def make_plan(self, alternatives: bool = True) -> Plan:
        """Plan one pipeline per data owner over the profiled nodes and install it
        (``alternatives``: also predict the other allocations, for the ``plan`` event).
        Returns the first owner's pipeline plan (:attr:`plans` holds them all)."""
        fed = self.planner.make_plan(alternatives)
        return fed.planned[0].plan

    def steps_in_round(self) -> int:
        """Training steps per round."""
        t = self.settings.train
        return planning.steps_in_round(
            t.steps_per_round, t.local_epochs, self.state.num_examples, self.schedule.batch_size
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
        names = self.state.names
        ex = Exchange(None, 1.0, describe=names.get, error_cls=SkyNodeError)  # type: ignore[arg-type]
        expected = set(self.model.model_fn().state_dict().keys())
        return merge_weights(list(replies), ex, expected, ARRAYS), None

    # no node-side evaluation: the server evaluates (``start(evaluate_fn=...)``); the
    # functions, not a base class, of what every server-side-evaluated strategy shares
    configure_evaluate = ServerSideEvaluation.configure_evaluate
    aggregate_evaluate = ServerSideEvaluation.aggregate_evaluate

    def summary(self) -> None:
        """Log the strategy's settings."""
        s, t = self.schedule, self.settings.train
        log(INFO, "\t├── Allocation: %s", self.settings.allocation)
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
        self.hooks.on_start(self)
        try:
            result = self._run(grid, initial_arrays, num_rounds, timeout, evaluate_fn)
        except BaseException as err:
            self.executor.close()
            self.hooks.on_end(self, err)
            raise
        self.executor.close()  # stage sessions end with the run
        self.hooks.on_end(self, None)
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
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        self.summary()
        st, evaluator = self.state, Evaluator(evaluate_fn, self.hooks)
        t_start = time.time()
        wait_s = min(timeout, self.settings.messaging.node_wait_s)
        self.benchmark(grid, self.wait_for_nodes(grid, timeout=wait_s))
        self.make_plan()
        for run in st.runs:
            self.executor.check_plan(run.pipeline)
        result = Result(arrays=initial_arrays)
        evaluator.evaluate(0, initial_arrays, result)
        st.global_arrays = initial_arrays
        report.log_round_header()
        failures = 0  # consecutive failed rounds
        trained = 0
        for rnd in range(1, num_rounds + 1):
            self.benchmarker.note_returns(rnd, self.settings.replan.mode)  # off: reported only
            row, new = self.executor.run(grid, rnd, st.global_arrays)
            if new is None:
                failures += 1
                self.recovery.failed(rnd, row, failures)
                if rnd == num_rounds and not trained:  # fewer rounds than max_failed_rounds
                    raise SkyNodeError(
                        f"none of the {num_rounds} round(s) trained (the last: {row.exception}); "
                        "the global model is the initial one"
                    )
                continue
            trained += 1
            failures = 0
            self.recovery.round_trained(rnd)  # helpers set aside before it: their own fault
            result.arrays = st.global_arrays = new
            result.train_metrics_clientapp[rnd] = MetricRecord(
                {"train_loss": row.train_loss, "train_accuracy": row.train_accuracy}
            )
            evaluator.evaluate(rnd, new, result, row)
            st.rounds.append(row)
            report.log_round_line(row)
            label = kinds_label(self.executor.runner_cls, st.runs, self.schedule)
            report.log_stage_report(row, label)
            report.log_pipelines(row)
            report.log_weights_sent(row)
            report.log_session(row)  # stream: the stage session's set-up and round times
            self.hooks.on_round(row)
            if row.failed_pipelines:
                self.recovery.partial_failure(rnd, row)
            self.planner.replan_after(rnd, row, num_rounds)
        log(INFO, "Sky strategy finished in %.1f s", time.time() - t_start)
        report.log_final(self.plans, self.settings.allocation, result)
        return result


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
