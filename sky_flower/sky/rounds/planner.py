"""The Sky strategy's planner: the model's layer profile, the plan, and online
re-planning after each round (what it decides and why:
:mod:`sky_flower.sky.planning.replan`). One part of
:class:`sky_flower.strategies.sky.SkyStrategy`, built from the settings and testable
alone: every method is given the profiles and plan it works on and returns its result;
its own state is the re-planner's smoothed profiles (:class:`ProfileTracker`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from logging import INFO, WARNING

from flwr.supercore import log

from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.sky.model import SkyModel
from sky_flower.sky.planning import planning
from sky_flower.sky.planning.replan import (
    Decision,
    ProfileTracker,
    ReplanRecord,
    decide,
    drift_text,
    joined_text,
    log_decision,
    round_time,
    shifted_plan,
)
from sky_flower.sky.rounds.records import RoundRecord
from sky_flower.sky.settings import SkySettings


class Planner:
    """Plans the run and re-plans it between rounds.

    Parameters
    ----------
    settings : SkySettings
        ``allocation`` (method, MILP time limit), ``train`` (epochs or steps per round,
        optimizer), ``replan``, ``schedule``.
    model : SkyModel
        The model and one sample's shape and dtype (profiled once, on the server).
    """

    def __init__(self, settings: SkySettings, model: SkyModel) -> None:
        self.settings, self.model = settings, model
        self.schedule = settings.schedule_object()
        self.replan_cfg = settings.replan  # the settings group itself
        self.tracker: ProfileTracker | None = None  # None until a round trained, replan on
        self._drifted: dict[str, tuple[float, float]] = {}

    def profile_model(self) -> list[LayerProfile]:
        """Per-layer FLOPs and bytes of the model (on the server)."""
        t, m = self.settings.train, self.model
        return planning.profile_model(
            m.model_fn, list(m.input_shape), self.schedule, t.optimizer, t.lr, m.input_dtype
        )

    def plan(  # noqa: PLR0913
        self,
        layers: Sequence[LayerProfile],
        nodes: Sequence[NodeProfile],
        samples: Mapping[str, int],
        alternatives: bool = True,
        log_tables: bool = True,
    ) -> planning.FederatedPlanned:
        """One pipeline per data owner over the fleet ``nodes``
        (:func:`sky_flower.sky.planning.planning.make_federated_plan`; ``alternatives``:
        also predict the other allocations on this benchmark, for the ``plan`` event).

        Raises
        ------
        ValueError
            If no node has been profiled yet, or no plan fits the nodes' memory
            (``InfeasibleMemoryError``).
        """
        if not nodes:
            raise ValueError(
                "no node has been profiled yet: run the benchmark round first "
                "(strategy.benchmark(grid, node_ids), which start() does)"
            )
        s = self.settings
        return planning.make_federated_plan(
            layers,  # type: ignore[arg-type]
            nodes,  # type: ignore[arg-type]
            samples,  # type: ignore[arg-type]
            self.schedule,
            s.allocation.method,
            local_epochs=s.train.local_epochs,
            steps_per_round=s.train.steps_per_round,
            time_limit_s=s.allocation.time_limit_s,
            alternatives=alternatives,
            log_tables=log_tables,
        )

    def installed(self) -> None:
        """A plan was installed: its predictions are made with the factors now."""
        if self.tracker is not None:
            self.tracker.snapshot()

    def track(self, node: NodeProfile) -> NodeProfile:
        """A node that joined: tracked from its profile, as the tracker sees it now."""
        if self.tracker is None:
            return node
        self.tracker.base.append(node)  # type: ignore[attr-defined]
        return self.tracker.profiles([node])[0]

    def observes(self, row: RoundRecord, planned: bool) -> bool:
        """Whether a round that trained (``row``) updates the profiles: ``replan.mode``
        on or ``force``, a plan installed (``planned``), no pipeline failed (the
        failure's re-plan has run)."""
        return self.replan_cfg.mode != "off" and not row.failed_pipelines and planned

    def observe(self, row: RoundRecord, nodes: Sequence[NodeProfile]) -> list[NodeProfile]:
        """The fleet ``nodes`` updated from the round ``row``'s stages (smoothed)."""
        if self.tracker is None:
            self.tracker = ProfileTracker(nodes, self.replan_cfg.smoothing)
        self._drifted = self.tracker.observe(row.stages or [])
        return self.tracker.profiles(nodes)  # type: ignore[arg-type]

    def replan(  # noqa: PLR0913
        self,
        rnd: int,
        row: RoundRecord,
        num_rounds: int,
        current: planning.FederatedPlanned,
        layers: Sequence[LayerProfile],
        nodes: Sequence[NodeProfile],
        samples: Mapping[str, int],
        joined: Sequence[str] = (),
    ) -> Decision | None:
        """After round ``rnd`` trained (``row``, :meth:`observe` first): the better plan
        for the next round when :func:`decide` says so (``None``: keep ``current``;
        ``joined``: the helpers that joined, planned with)."""
        cfg = self.replan_cfg
        candidate = self._candidate(rnd, current, layers, nodes, samples, bool(joined))
        steps = {p.owner: p.measured_step_time_s for p in row.pipelines or []}
        measured = round_time(current, lambda p: steps.get(p.owner) or 0.0)
        keep = self.settings.train.optimizer_state == "keep"
        d = decide(
            cfg, current, candidate, layers, nodes, self.schedule, measured, num_rounds - rnd, keep
        )
        if not d.take or d.new is None:
            if joined:
                log(
                    INFO,
                    "Not re-planning after round %d for %s (joined): %s",
                    rnd,
                    ", ".join(joined),
                    d.record.reason
                    or f"expected gain {100 * d.record.predicted_gain:.1f} % <= threshold "
                    f"{100 * cfg.threshold:.0f} %",
                )
            return None
        return d

    def taken(self, rnd: int, d: Decision, joined: Sequence[str] = ()) -> ReplanRecord:
        """The ``replans`` record of the re-plan ``d`` taken after round ``rnd`` (why:
        the drift :meth:`observe` saw, the nodes ``joined``), logged with its plan."""
        cfg, r = self.replan_cfg, d.record
        r.after_round, r.drift, r.joined = rnd, drift_text(self._drifted), list(joined)
        why = joined_text(joined) or r.drift or "profiles updated"
        r.reason = (
            f"forced (replan.mode=force){'; ' + why if joined else ''}"
            if cfg.mode == "force"
            else (
                f"{why}: expected gain "
                f"{100 * r.predicted_gain:.1f} % > threshold {100 * cfg.threshold:.0f} %"
            )
        )
        log_decision(rnd, d)
        assert d.new is not None
        planning.log_plan_tables(d.new.fplan, d.new.planned, self.settings.allocation.method)
        return r

    def _candidate(  # noqa: PLR0913
        self,
        rnd: int,
        current: planning.FederatedPlanned,
        layers: Sequence[LayerProfile],
        nodes: Sequence[NodeProfile],
        samples: Mapping[str, int],
        joined: bool = False,
    ) -> planning.FederatedPlanned | None:
        """The plan to weigh: the allocation re-run on the updated profiles, or (force,
        when no node ``joined``) the current plan with its first cuts moved (alternating
        direction per round)."""
        if self.replan_cfg.mode == "force" and not joined:
            return shifted_plan(current, layers, nodes, self.schedule, 1 if rnd % 2 else -1)
        try:  # the tables are logged below only if the re-plan is taken
            return self.plan(layers, nodes, samples, alternatives=False, log_tables=False)
        except ValueError as err:  # e.g. memory: keep the current plan
            log(WARNING, "Re-planning after round %d failed, keeping the plan: %s", rnd, err)
            return None
