"""One joint-planning instance: owners, helpers, steps, per-pipeline plans, timelines.

:class:`Instance` checks the input, computes every owner's steps, and answers "the
pipeline of owner ``k`` over helpers ``S`` by method ``m``" (a
:func:`~sky_flower.core.partition.partition` plan over ``[owner] + S``, cached; nodes with
identical profiles share one solve, renamed). A *solution* is a list of ``(owner,
helper set)`` in priority order; :meth:`Instance.timeline` turns it into start times:
a pipeline starts when every earlier pipeline that shares a node with it has finished
(a semi-active schedule: the earliest start times for that order).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.federated.plan import OwnerPipeline, steps_in_round
from sky_flower.core.partition import (
    METHODS,
    InfeasibleMemoryError,
    Plan,
    feasible_stages,
    heuristic,
    partition,
)
from sky_flower.core.profile import LayerProfile, NodeProfile

Solution = list[tuple[int, frozenset[int]]]  # (owner index, helper indices), priority order


def _kind_key(node: NodeProfile) -> tuple:
    return (
        tuple(node.layer_fwd_s),
        tuple(node.layer_bwd_s),
        node.memory_bytes,
        node.latency_s,
        node.bandwidth_bps,
        node.state_s_per_byte,
    )


def _kinds(nodes: Sequence[NodeProfile]) -> list[int]:
    labels: dict[tuple, int] = {}
    return [labels.setdefault(_kind_key(n), len(labels)) for n in nodes]


NO_HELPERS = (
    " No node helps it: every node holds data, so each data owner must hold the whole "
    "model. Add helpers, nodes that hold no data and take the layers an owner cannot: "
    "deployed, a SuperNode started with --node-config 'sky-holds-data=false' "
    "(docs/deployment.md; python -m sky_flower.deploy <app> --fleet edge4 starts a "
    "fleet's helpers so, while flwr run's simulation makes every SuperNode a data "
    "owner); in the Hydra job (python -m sky_flower.run), fleet nodes with "
    "holds_data: false (conf/fleet/edge4.yaml)."
)


class _SearchCost(CostModel):
    """A cost model whose step-time bound skips the memory LP (the planner solves
    hundreds of pipelines; their own ``lower_bound_s`` is then the LP-free bound)."""

    def memory_lp_bound(self, max_variables: int = 200_000) -> float:  # noqa: ARG002
        """0: see the class docstring."""
        return 0.0


def _renamed(plan: Plan, names: Mapping[str, str]) -> Plan:
    """``plan`` with its node names mapped (same profiles, other nodes)."""
    return replace(
        plan,
        stages=[replace(s, node=names[s.node]) for s in plan.stages],
        idle_nodes=[names[n] for n in plan.idle_nodes],
    )


class Instance:
    """The input of :func:`~sky_flower.core.federated.plan_federation`, checked.

    Raises
    ------
    ValueError
        On no owners, duplicate node names, a missing or negative sample count (names
        the owner), too few samples for one batch, or an unknown method.
    """

    def __init__(  # noqa: PLR0913
        self,
        layers: Sequence[LayerProfile],
        nodes: Sequence[NodeProfile],
        samples: Mapping[str, int],
        schedule: Schedule,
        *,
        local_epochs: float,
        steps_per_round: int,
        time_limit_s: float,
    ) -> None:
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be unique, got {names}")
        self.layers, self.schedule, self.time_limit_s = list(layers), schedule, time_limit_s
        self.owners = [n for n in nodes if n.holds_data]
        self.helpers = [n for n in nodes if not n.holds_data]
        if not self.owners:
            raise ValueError("no data owners: at least one node must hold data (holds_data=True)")
        self.samples, self.steps = [], []
        for o in self.owners:
            if o.name not in samples:
                raise ValueError(f"no sample count for data owner {o.name!r}: pass samples[name]")
            n = int(samples[o.name])
            if n < 0:
                raise ValueError(f"data owner {o.name!r} has a negative sample count ({n})")
            try:
                steps = steps_in_round(steps_per_round, local_epochs, n, schedule.batch_size)
            except ValueError as e:
                raise ValueError(f"data owner {o.name!r}: {e}") from None
            self.samples.append(n)
            self.steps.append(steps)
        kinds = _kinds([*self.owners, *self.helpers])
        self.owner_kind = kinds[: len(self.owners)]
        self.helper_kind = kinds[len(self.owners) :]
        self._cache: dict[tuple, tuple[Plan | None, int, tuple[int, ...]]] = {}
        self.unproven = 0  # per-pipeline ``optimal`` plans that were not proven

    @property
    def K(self) -> int:  # noqa: N802
        """Number of data owners."""
        return len(self.owners)

    @property
    def H(self) -> int:  # noqa: N802
        """Number of helpers."""
        return len(self.helpers)

    @property
    def solves(self) -> int:
        """Per-pipeline partitions solved so far (cache misses)."""
        return len(self._cache)

    def cost(self, k: int, helpers: Iterable[int], fast: bool = False) -> CostModel:
        """The cost model of owner ``k`` with ``helpers`` (in the given order); ``fast``:
        without the memory LP in its step-time bound."""
        nodes = [self.owners[k], *(self.helpers[h] for h in helpers)]
        return (_SearchCost if fast else CostModel)(self.layers, nodes, self.schedule)

    def check_owners(self) -> None:
        """Raise :class:`InfeasibleMemoryError` naming the first owner (fleet order)
        whose pipeline cannot fit even with every helper."""
        for k, o in enumerate(self.owners):
            if self.plan(k, (), "heuristic") is not None:
                continue
            try:
                feasible_stages(self.cost(k, range(self.H)))
            except InfeasibleMemoryError as e:
                raise InfeasibleMemoryError(
                    f"data owner {o.name!r} cannot train the model even with every helper "
                    f"({self.H}): {e}{NO_HELPERS if self.H == 0 else ''}"
                ) from None

    def plan(self, k: int, helpers: Iterable[int], method: str) -> Plan | None:
        """Owner ``k``'s pipeline over ``helpers`` by ``method``; None if it cannot fit.

        ``even`` keeps the helpers in fleet order (its cuts follow that order); the
        other methods choose the order themselves, so nodes with identical profiles are
        interchangeable and one solve serves them all.

        Raises
        ------
        ValueError
            ``even`` with fewer layers than nodes, or an unknown method.
        """
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
        if method == "even":
            hs = tuple(sorted(helpers))
            key: tuple = (method, k, hs)
        else:
            hs = tuple(sorted(helpers, key=lambda h: (self.helper_kind[h], h)))
            key = (method, self.owner_kind[k], tuple(self.helper_kind[h] for h in hs))
        if key not in self._cache:
            self._cache[key] = (self._solve(k, hs, method), k, hs)
        plan, k0, hs0 = self._cache[key]
        if plan is None or (k0, hs0) == (k, hs):
            return plan
        names = {self.owners[k0].name: self.owners[k].name}
        names.update(
            {self.helpers[a].name: self.helpers[b].name for a, b in zip(hs0, hs, strict=True)}
        )
        return _renamed(plan, names)

    def _solve(self, k: int, hs: tuple[int, ...], method: str) -> Plan | None:
        cost = self.cost(k, hs, fast=method != "optimal")
        if method == "even" and cost.num_layers < cost.num_nodes:
            return None
        try:
            if method == "heuristic":  # many solves per search: greedy fills and polishing
                plan = heuristic(cost, time_limit_s=self.time_limit_s, small_exact=False)
            else:
                plan = partition(cost, method, time_limit_s=self.time_limit_s)
        except InfeasibleMemoryError:
            return None
        if method == "optimal" and not plan.proven_optimal:
            self.unproven += 1
        return plan

    def time(self, k: int, helpers: Iterable[int], method: str) -> float:
        """Seconds owner ``k``'s pipeline takes for its steps (``inf`` if it cannot fit)."""
        plan = self.plan(k, helpers, method)
        return math.inf if plan is None else self.steps[k] * plan.predicted_step_time_s

    def alone_time(self, k: int) -> float:
        """Seconds owner ``k`` takes training the whole model alone (``inf``: no fit)."""
        cost = self.cost(k, ())
        stage = [(0, 0, cost.num_layers - 1)]
        if not cost.fits(stage):
            return math.inf
        return self.steps[k] * cost.step_time(stage)

    def makespan(self, solution: Solution, method: str) -> float:
        """Predicted round time of ``solution`` (seconds; ``inf`` if a pipeline cannot fit)."""
        plans = [self.plan(k, s, method) for k, s in solution]
        if any(p is None for p in plans):
            return math.inf
        return max(self.timeline(solution, plans)[1], default=0.0)

    def timeline(
        self, solution: Solution, plans: Sequence[Plan | None]
    ) -> tuple[list[float], list[float], list[tuple[int, ...]]]:
        """Start, end (seconds) and the earlier entries each entry waits for, in
        priority order. A pipeline waits for every earlier one sharing a node of its
        plan's stages."""
        starts: list[float] = []
        ends: list[float] = []
        afters: list[tuple[int, ...]] = []
        used: list[frozenset[str]] = []
        for (k, _), plan in zip(solution, plans, strict=True):
            assert plan is not None
            nodes = frozenset(s.node for s in plan.stages)
            after = tuple(j for j, u in enumerate(used) if u & nodes)
            start = max((ends[j] for j in after), default=0.0)
            starts.append(start)
            ends.append(start + self.steps[k] * plan.predicted_step_time_s)
            afters.append(after)
            used.append(nodes)
        return starts, ends, afters

    def pipelines(self, solution: Solution, plans: Sequence[Plan]) -> tuple[OwnerPipeline, ...]:
        """The round's pipelines, listed by start (ties: priority order, so ``after``
        only names earlier entries)."""
        starts, ends, afters = self.timeline(solution, plans)
        rank = sorted(range(len(solution)), key=lambda i: (starts[i], i))
        pos = {i: r for r, i in enumerate(rank)}
        out = []
        for i in rank:
            k = solution[i][0]
            out.append(
                OwnerPipeline(
                    owner=self.owners[k].name,
                    samples=self.samples[k],
                    steps=self.steps[k],
                    plan=plans[i],
                    after=tuple(sorted(pos[j] for j in afters[i])),
                    start_s=starts[i],
                    time_s=ends[i] - starts[i],
                )
            )
        return tuple(out)
