"""The Sky strategy's planner: the model's layer profile, the first plan, and online
re-planning after each round (what it decides and why:
:mod:`sky_flower.sky.planning.replan`). One part of
:class:`sky_flower.strategies.sky.SkyStrategy`, built from the settings and testable
alone on a :class:`sky_flower.sky.rounds.state.RunState`."""

from __future__ import annotations

from collections.abc import Callable
from logging import INFO, WARNING
from typing import Any

from flwr.supercore import log

from sky_flower.core.cost import Schedule
from sky_flower.core.profile import LayerProfile
from sky_flower.sky.model import SkyModel
from sky_flower.sky.planning import planning
from sky_flower.sky.planning.replan import (
    ProfileTracker,
    ReplanConfig,
    decide,
    drift_text,
    log_decision,
    round_time,
    shifted_plan,
)
from sky_flower.sky.rounds.hooks import SkyHooks
from sky_flower.sky.rounds.records import RoundRecord
from sky_flower.sky.rounds.state import RunState
from sky_flower.sky.settings import SkySettings


class Planner:
    """Plans the run and re-plans it between rounds.

    Parameters
    ----------
    state : RunState
        Read: the profiles, ``samples``; written: ``layer_profiles``, ``federated``,
        ``runs``, ``replans``, ``tracker``, ``node_profiles`` (smoothed).
    settings : SkySettings
        ``allocation``, ``milp_time_limit_s``, ``train`` (epochs or steps per round,
        optimizer), ``replan``.
    schedule : Schedule
        The run's schedule.
    model : SkyModel
        The model and one sample's shape and dtype (profiled once, on the server).
    check_plan : callable
        ``(Pipeline) -> None``: raises ``ValueError`` if the transport cannot run a
        pipeline (a re-plan it refuses is not taken).
    joiners : callable
        ``(next_round) -> names``: profiles and adds the nodes that joined
        (:meth:`sky_flower.sky.rounds.joins.Benchmarker.admit_joiners`).
    hooks : SkyHooks
        ``on_plan`` is called with every plan installed.
    """

    def __init__(  # noqa: PLR0913
        self,
        state: RunState,
        settings: SkySettings,
        schedule: Schedule,
        model: SkyModel,
        check_plan: Callable[[Any], None],
        joiners: Callable[[int], list[str]],
        hooks: SkyHooks,
    ) -> None:
        self.state, self.settings, self.schedule = state, settings, schedule
        self.model = model
        self.check_plan, self.joiners, self.hooks = check_plan, joiners, hooks
        r = settings.replan
        self.replan_cfg = ReplanConfig(mode=r.mode, threshold=r.threshold, smoothing=r.smoothing)

    def profile_model(self) -> list[LayerProfile]:
        """Per-layer FLOPs and bytes of the model (computed once, kept in
        ``state.layer_profiles``)."""
        st = self.state
        if not st.layer_profiles:
            t = self.settings.train
            m = self.model
            st.layer_profiles = planning.profile_model(
                m.model_fn, list(m.input_shape), self.schedule, t.optimizer, t.lr, m.input_dtype
            )
        return st.layer_profiles

    def make_plan(self, alternatives: bool = True) -> planning.FederatedPlanned:
        """Plan one pipeline per data owner over ``state.node_profiles``
        (:func:`sky_flower.sky.planning.planning.make_federated_plan`; ``alternatives``:
        also predict the other allocations on this benchmark, for the ``plan`` event)
        and install it.

        Raises
        ------
        ValueError
            If no node has been profiled yet, or no plan fits the nodes' memory
            (``InfeasibleMemoryError``).
        """
        if not self.state.node_profiles:
            raise ValueError(
                "no node has been profiled yet: run the benchmark round first "
                "(strategy.benchmark(grid, node_ids), which start() does)"
            )
        fed = self._plan(alternatives=alternatives)
        self.install_plan(fed)
        return fed

    def _plan(self, alternatives: bool, log_tables: bool = True) -> planning.FederatedPlanned:
        s, st = self.settings, self.state
        return planning.make_federated_plan(
            st.layer_profiles,
            st.node_profiles,
            st.samples,
            self.schedule,
            s.allocation,
            local_epochs=s.train.local_epochs,
            steps_per_round=s.train.steps_per_round,
            time_limit_s=s.milp_time_limit_s,
            alternatives=alternatives,
            log_tables=log_tables,
        )

    def install_plan(self, fed: planning.FederatedPlanned) -> None:
        """Run ``fed`` from the next round (``state.federated``, ``state.runs``) and
        call the hooks' ``on_plan``."""
        st = self.state
        st.federated = fed
        st.runs = planning.pipeline_runs(fed, st.node_profiles, st.ids, st.handler_rate)
        if st.tracker is not None:
            st.tracker.snapshot()
        self.hooks.on_plan(fed.event())

    def replan_after(self, rnd: int, row: RoundRecord, num_rounds: int) -> None:
        """After round ``rnd`` trained (``row``): update the profiles, and install a
        better plan for the next round when :func:`decide` says so (``replans`` records
        it). Nothing under ``replan.mode=off`` or after a round with failed pipelines
        (the failure's re-plan has run)."""
        cfg, st = self.replan_cfg, self.state
        if cfg.mode == "off" or row.failed_pipelines or st.federated is None:
            return
        if st.tracker is None:
            st.tracker = ProfileTracker(st.node_profiles, cfg.smoothing)
        drifted = st.tracker.observe(row.stages or [])
        st.node_profiles = st.tracker.profiles(st.node_profiles)
        if rnd >= num_rounds:
            return
        joined = self.joiners(rnd + 1)  # profiled now, planned with below
        layers, nodes, sched = st.layer_profiles, st.node_profiles, self.schedule
        candidate = self._candidate(rnd, bool(joined))
        steps = {p.owner: p.measured_step_time_s for p in row.pipelines or []}
        measured = round_time(st.federated, lambda p: steps.get(p.owner) or 0.0)
        keep = self.settings.replan.optimizer_state == "keep"
        d = decide(
            cfg, st.federated, candidate, layers, nodes, sched, measured, num_rounds - rnd, keep
        )
        if not d.take or d.new is None:
            if joined:
                log(
                    INFO,
                    "Not re-planning after round %d for %s (joined): %s",
                    rnd,
                    ", ".join(joined),
                    d.record.get("reason")
                    or f"expected gain {100 * d.record['predicted_gain']:.1f} % <= threshold "
                    f"{100 * cfg.threshold:.0f} %",
                )
            return
        runs = planning.pipeline_runs(d.new, nodes, st.ids, st.handler_rate)
        try:
            for run in runs:
                self.check_plan(run.pipeline)
        except ValueError as err:
            log(WARNING, "Not re-planning after round %d: %s", rnd, err)
            return
        d.record.update({"after_round": rnd, "drift": drift_text(drifted), "joined": joined})
        why = f"{', '.join(joined)} joined" if joined else d.record["drift"] or "profiles updated"
        d.record["reason"] = (
            f"forced (replan.mode=force){'; ' + why if joined else ''}"
            if cfg.mode == "force"
            else (
                f"{why}: expected gain "
                f"{100 * d.record['predicted_gain']:.1f} % > threshold {100 * cfg.threshold:.0f} %"
            )
        )
        log_decision(rnd, d)
        planning.log_plan_tables(d.new.fplan, d.new.planned, self.settings.allocation)
        st.replans.append(d.record)
        self.install_plan(d.new)

    def _candidate(self, rnd: int, joined: bool = False) -> planning.FederatedPlanned | None:
        """The plan to weigh: the allocation re-run on the updated profiles, or (force,
        when no node ``joined``) the current plan with its first cuts moved (alternating
        direction per round)."""
        st = self.state
        layers, nodes, sched = st.layer_profiles, st.node_profiles, self.schedule
        assert st.federated is not None
        if self.replan_cfg.mode == "force" and not joined:
            return shifted_plan(st.federated, layers, nodes, sched, 1 if rnd % 2 else -1)
        try:  # the tables are logged below only if the re-plan is taken
            return self._plan(alternatives=False, log_tables=False)
        except ValueError as err:  # e.g. memory: keep the current plan
            log(WARNING, "Re-planning after round %d failed, keeping the plan: %s", rnd, err)
            return None
