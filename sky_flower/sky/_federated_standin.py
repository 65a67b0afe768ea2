"""STAND-IN for ``sky_flower.core.federated`` (slice ``fedplan``) until it is merged:
the brief's interface, helpers dealt round-robin to the owners. Deleted after merging."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.partition import Plan, partition
from sky_flower.core.profile import LayerProfile, NodeProfile


@dataclass(frozen=True)
class OwnerPipeline:
    """One owner's pipeline (see the brief)."""

    owner: str
    samples: int
    steps: int
    plan: Plan
    after: tuple[int, ...]
    start_s: float
    time_s: float


@dataclass(frozen=True)
class FederatedPlan:
    """One pipeline per owner (see the brief)."""

    method: str
    pipelines: tuple[OwnerPipeline, ...]
    round_time_s: float
    fedavg_round_time_s: float | None
    lower_bound_s: float
    owner_bounds_s: dict[str, float]
    proven_optimal: bool
    solve_time_s: float
    idle_helpers: tuple[str, ...]
    note: str = ""

    def table(self) -> str:
        """One row per pipeline."""
        return "\n".join(
            f"{p.owner}: {', '.join(s.node for s in p.plan.stages)} {p.steps} steps"
            for p in self.pipelines
        )


def plan_federation(  # noqa: PLR0913
    layers: Sequence[LayerProfile],
    nodes: Sequence[NodeProfile],
    samples: Mapping[str, int],
    schedule: Schedule,
    method: str = "heuristic",
    *,
    local_epochs: float = 1.0,
    steps_per_round: int = 0,
    time_limit_s: float = 30.0,
) -> FederatedPlan:
    """Stand-in: helper ``j`` goes to owner ``j % K``; each owner's layers partitioned."""
    owners = [n for n in nodes if n.holds_data]
    helpers = [n for n in nodes if not n.holds_data]
    out = []
    for i, owner in enumerate(owners):
        group = [owner] + helpers[i :: len(owners)]
        plan = partition(
            CostModel(list(layers), group, schedule), method, time_limit_s=time_limit_s
        )
        per_epoch = max(1, samples[owner.name] // schedule.batch_size)
        steps = steps_per_round or max(1, int(round(local_epochs * per_epoch)))
        t = steps * plan.predicted_step_time_s
        out.append(OwnerPipeline(owner.name, samples[owner.name], steps, plan, (), 0.0, t))
    return FederatedPlan(
        method, tuple(out), max(p.time_s for p in out), None, 0.0, {}, False, 0.0, ()
    )
