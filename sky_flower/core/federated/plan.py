"""Result types of the joint planner and the rule for a pipeline's steps in a round.

:class:`OwnerPipeline` is one data owner's pipeline in a round (its helpers, cuts, start
and duration), :class:`FederatedPlan` the whole round. :func:`steps_in_round` is the one
rule for how many training steps a data owner runs per round (the Sky strategy uses it
too, through :mod:`sky_flower.sky.planning.planning`). Pure: no Flower.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sky_flower import tables
from sky_flower.core.partition import Plan


def steps_in_round(
    steps_per_round: int, local_epochs: float, num_examples: int, batch_size: int
) -> int:
    """Training steps per round: ``steps_per_round`` if > 0, else ``local_epochs``
    passes over the data owner's ``num_examples`` in batches of ``batch_size``
    (``max(1, round(local_epochs x (num_examples // batch_size)))``).

    Raises
    ------
    ValueError
        If the data owner has fewer examples than one batch.
    """
    if steps_per_round > 0:
        return steps_per_round
    per_epoch = num_examples // batch_size
    if per_epoch < 1:
        raise ValueError(
            f"the data owner has {num_examples} examples, fewer than one batch of "
            f"{batch_size}: lower the batch size"
        )
    return max(1, int(round(local_epochs * per_epoch)))


@dataclass(frozen=True)
class OwnerPipeline:
    """One data owner's pipeline in a round.

    Attributes
    ----------
    owner : str
        The data owner's node name; stage 0 of ``plan`` runs on it.
    samples : int
        The owner's training samples.
    steps : int
        Training steps this pipeline runs this round (:func:`steps_in_round`).
    plan : Plan
        As :func:`sky_flower.core.partition.partition` returns it, over ``[owner] +
        helpers`` (helpers that hold no stage are in ``plan.idle_nodes``).
    after : tuple of int
        Indices into :attr:`FederatedPlan.pipelines` that must finish before this one
        starts (they share a node). Pipelines sharing a node are always ordered this
        way, so pipelines that run at once are node-disjoint. Only earlier entries.
    start_s : float
        Predicted start, seconds from the round's start.
    time_s : float
        Predicted duration: ``steps x plan.predicted_step_time_s`` (seconds).
    """

    owner: str
    samples: int
    steps: int
    plan: Plan
    after: tuple[int, ...]
    start_s: float
    time_s: float

    @property
    def end_s(self) -> float:
        """Predicted finish, seconds from the round's start."""
        return self.start_s + self.time_s

    @property
    def nodes(self) -> tuple[str, ...]:
        """Nodes holding a stage, in pipeline order (the owner first)."""
        return tuple(s.node for s in self.plan.stages)


@dataclass(frozen=True)
class FederatedPlan:
    """The plan of one federated round: one pipeline per data owner.

    Attributes
    ----------
    method : str
        ``even``, ``heuristic`` or ``optimal``.
    pipelines : tuple of OwnerPipeline
        One per data owner, listed by predicted start (ties: the planner's priority
        order), so ``after`` only names earlier entries.
    round_time_s : float
        Predicted makespan of the round (seconds): the latest ``end_s``.
    fedavg_round_time_s : float or None
        Every owner trains the whole model alone, all at once (seconds); None if an
        owner cannot hold the model.
    lower_bound_s : float
        A lower bound on any plan's round time (seconds): the largest of total work over
        total speed across the federation and the owner bounds.
    owner_bounds_s : dict of str to float
        Per owner: its steps x the step-time lower bound of a pipeline over the owner
        and every helper (seconds).
    proven_optimal : bool
        True only when ``optimal`` proved the plan optimal.
    solve_time_s : float
        Wall time of the planner (seconds).
    idle_helpers : tuple of str
        Helpers that hold a stage in no pipeline.
    note : str
        What happened (fallbacks, limits, the all-alone choice).
    """

    method: str
    pipelines: tuple[OwnerPipeline, ...]
    round_time_s: float
    fedavg_round_time_s: float | None
    lower_bound_s: float
    owner_bounds_s: dict[str, float] = field(default_factory=dict)
    proven_optimal: bool = False
    solve_time_s: float = 0.0
    idle_helpers: tuple[str, ...] = ()
    note: str = ""

    def table(self) -> str:
        """The plan as text: one row per pipeline (owner, samples, steps, stages as
        ``node[first-last]``, predicted step time, start, duration, what it waits for),
        then the round time, FedAvg's and the lower bound."""
        cells = [
            (
                i,
                p.owner,
                p.samples,
                p.steps,
                f"{p.plan.predicted_step_time_s:.4f}",
                f"{p.start_s:.3f}",
                f"{p.time_s:.3f}",
                ",".join(str(j) for j in p.after) or "-",
                " ".join(f"{s.node}[{s.first_layer}-{s.last_layer}]" for s in p.plan.stages),
            )
            for i, p in enumerate(self.pipelines)
        ]
        head = ("#", "owner", "samples", "steps", "step s", "start s", "time s", "after", "stages")
        rows = [tables.text(head, cells, align="rlrrrrrll", sep="  ", rule=True)]
        fedavg = (
            "infeasible (an owner cannot hold the model)"
            if self.fedavg_round_time_s is None
            else f"{self.fedavg_round_time_s:.3f} s"
        )
        rows.append(
            f"{self.method}: round {self.round_time_s:.3f} s, FedAvg {fedavg}, lower bound "
            f"{self.lower_bound_s:.3f} s, solved in {self.solve_time_s * 1e3:.1f} ms"
            f"{', proven optimal' if self.proven_optimal else ''}"
        )
        if self.idle_helpers:
            rows.append(f"idle helpers ({len(self.idle_helpers)}): {', '.join(self.idle_helpers)}")
        if self.note:
            rows.append(f"note: {self.note}")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        """JSON form."""
        return {
            "method": self.method,
            "pipelines": [
                {
                    "owner": p.owner,
                    "samples": p.samples,
                    "steps": p.steps,
                    "after": list(p.after),
                    "start_s": p.start_s,
                    "time_s": p.time_s,
                    "plan": p.plan.to_dict(),
                }
                for p in self.pipelines
            ],
            "round_time_s": self.round_time_s,
            "fedavg_round_time_s": self.fedavg_round_time_s,
            "lower_bound_s": self.lower_bound_s,
            "owner_bounds_s": dict(self.owner_bounds_s),
            "proven_optimal": self.proven_optimal,
            "solve_time_s": self.solve_time_s,
            "idle_helpers": list(self.idle_helpers),
            "note": self.note,
        }
