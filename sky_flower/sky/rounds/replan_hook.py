"""The Sky strategy's online re-planning hook: a mixin of
:class:`sky_flower.strategies.sky.SkyStrategy` (as
:class:`sky_flower.sky.rounds.recovery.RoundRecovery`), split out of it to keep the strategy's
module short. What it decides and why: :mod:`sky_flower.sky.planning.replan`."""

from __future__ import annotations

from collections.abc import Callable
from logging import INFO, WARNING
from typing import Any

from flwr.supercore import log

from sky_flower.core.profile import LayerProfile, NodeProfile
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


class RoundReplanning:
    """Online re-planning for :class:`sky_flower.strategies.sky.SkyStrategy` (a mixin,
    as :class:`sky_flower.sky.rounds.recovery.RoundRecovery`): :meth:`init_replan` in its
    constructor, :meth:`install_plan` for every plan, :meth:`replan_after` after every
    round that trained."""

    layer_profiles: list[LayerProfile]
    node_profiles: list[NodeProfile]
    samples: dict[str, int]
    schedule: Any
    allocation: str
    local_epochs: float
    steps_per_round: int
    milp_time_limit_s: float
    federated: planning.FederatedPlanned | None
    runs: list[Any]
    _ids: dict[str, int]
    _handler_rate: dict[str, float]
    on_event: Callable[[str, dict], None]
    runner: Callable[[], Any]
    admit_joiners: Callable[[int], list[str]]  # sky_flower.sky.rounds.joins.NodeJoins

    def init_replan(self, replan: ReplanConfig | None, optimizer_state: str) -> None:
        """Set up re-planning (``replan``; None: off) and where optimizer state lives
        between rounds (``round``: fresh each round; ``keep``: kept per pipeline by the
        server, :mod:`sky_flower.sky.migration`).

        Raises
        ------
        ValueError
            On an unknown ``optimizer_state``, or ``keep`` with a schedule that may run
            several chunks per stage (``interleaved``, ``zero_bubble``, ``auto``).
        """
        from sky_flower.sky.migration import OPTIMIZER_STATES, OptimizerStore

        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(
                f"train.optimizer_state must be one of {', '.join(OPTIMIZER_STATES)}, "
                f"got {optimizer_state!r}"
            )
        kind = self.schedule.kind  # type: ignore[attr-defined] - the strategy's
        if optimizer_state == "keep" and kind in ("interleaved", "zero_bubble", "auto"):
            raise ValueError(
                f"train.optimizer_state=keep moves each layer's optimizer state with its "
                f"stage, which needs one chunk per stage: schedule.kind={kind} may split a "
                f"stage into chunks. Use schedule.kind=gpipe or 1f1b with keep, or "
                f"train.optimizer_state=round"
            )
        self.replan_cfg = replan or ReplanConfig()
        self.optimizer_state = optimizer_state
        self.optimizer_store = OptimizerStore() if optimizer_state == "keep" else None
        self.replans: list[dict[str, Any]] = []
        self.tracker: ProfileTracker | None = None

    def install_plan(self, fed: planning.FederatedPlanned) -> None:
        """Run ``fed`` from the next round: its pipelines, the first one's plan as
        ``plan`` / ``cost`` / ``pipeline``; the ``plan`` event."""
        self.federated = fed
        self.runs = planning.pipeline_runs(fed, self.node_profiles, self._ids, self._handler_rate)
        first = fed.planned[0]
        self.plan, self.cost, self.group_size = first.plan, first.cost, first.group_size
        self.pipeline = self.runs[0].pipeline
        if self.tracker is not None:
            self.tracker.snapshot()
        self.on_event("plan", fed.event())

    def replan_after(self, rnd: int, row: dict[str, Any], num_rounds: int) -> None:
        """After round ``rnd`` trained (``row``): update the profiles, and install a
        better plan for the next round when :func:`decide` says so (``replans`` records
        it). Nothing under ``replan.mode=off`` or after a round with failed pipelines
        (the failure's re-plan has run)."""
        cfg = self.replan_cfg
        if cfg.mode == "off" or row.get("failed_pipelines") or self.federated is None:
            return
        if self.tracker is None:
            self.tracker = ProfileTracker(self.node_profiles, cfg.smoothing)
        drifted = self.tracker.observe(row["stages"])
        self.node_profiles = self.tracker.profiles(self.node_profiles)
        if rnd >= num_rounds:
            return
        joined = self.admit_joiners(rnd + 1)  # profiled now, planned with below
        layers, nodes, sched = self.layer_profiles, self.node_profiles, self.schedule
        candidate = self._candidate(rnd, bool(joined))
        steps = {p["owner"]: p["measured_step_time_s"] for p in row["pipelines"]}
        measured = round_time(self.federated, lambda p: steps.get(p.owner) or 0.0)
        d = decide(
            cfg, self.federated, candidate, layers, nodes, sched, measured,
            num_rounds - rnd, self.optimizer_store is not None,
        )  # fmt: skip
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
        runs = planning.pipeline_runs(d.new, nodes, self._ids, self._handler_rate)
        try:
            for run in runs:
                self.runner().check_plan(run.pipeline)
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
        planning.log_plan_tables(d.new.fplan, d.new.planned, self.allocation)
        self.replans.append(d.record)
        self.install_plan(d.new)

    def _candidate(self, rnd: int, joined: bool = False) -> planning.FederatedPlanned | None:
        """The plan to weigh: the allocation re-run on the updated profiles, or (force,
        when no node ``joined``) the current plan with its first cuts moved (alternating
        direction per round)."""
        layers, nodes, sched = self.layer_profiles, self.node_profiles, self.schedule
        assert self.federated is not None
        if self.replan_cfg.mode == "force" and not joined:
            return shifted_plan(self.federated, layers, nodes, sched, 1 if rnd % 2 else -1)
        try:
            return planning.make_federated_plan(
                layers,
                nodes,
                self.samples,
                sched,
                self.allocation,
                local_epochs=self.local_epochs,
                steps_per_round=self.steps_per_round,
                time_limit_s=self.milp_time_limit_s,
                alternatives=False,
                log_tables=False,  # logged below only if the re-plan is taken
            )
        except ValueError as err:  # e.g. memory: keep the current plan
            log(WARNING, "Re-planning after round %d failed, keeping the plan: %s", rnd, err)
            return None
