""":func:`plan_federation`: the entry point of the joint planner, and its lower bounds."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

import numpy as np

from sky_flower.core.cost import Schedule
from sky_flower.core.federated.exact import optimal_solution
from sky_flower.core.federated.greedy import HEURISTIC_BUDGET_S
from sky_flower.core.federated.instance import Instance, Solution
from sky_flower.core.federated.plan import FederatedPlan
from sky_flower.core.federated.search import even_solution, heuristic_solution
from sky_flower.core.partition import METHODS, InfeasibleMemoryError, Plan
from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.core.schedule import MILP_TIME_LIMIT_S

BOUND_LP_VARIABLES = 2_000  # owner bounds use the memory LP up to this many variables


def plan_federation(  # noqa: PLR0913
    layers: Sequence[LayerProfile],
    nodes: Sequence[NodeProfile],
    samples: Mapping[str, int],
    schedule: Schedule,
    method: str = "heuristic",
    *,
    local_epochs: float = 1.0,
    steps_per_round: int = 0,
    time_limit_s: float = MILP_TIME_LIMIT_S,
) -> FederatedPlan:
    """Plan one federated round: a pipeline per data owner, helpers shared.

    Owners are the ``nodes`` with ``holds_data`` (stage 0 of their own pipeline: raw
    data never leaves them), the others are helpers. Owner ``k`` runs ``steps_k``
    (:func:`~sky_flower.core.federated.plan.steps_in_round` of its ``samples``) steps of
    ``plan_k.predicted_step_time_s`` each; the planner picks every owner's helpers and
    cuts to minimise the round's makespan (see the package docstring for the methods).
    ``heuristic`` and ``optimal`` return the all-alone plan (FedAvg) when it is
    predicted no slower and every owner fits.

    Parameters
    ----------
    layers : sequence of LayerProfile
        The model's L layer profiles.
    nodes : sequence of NodeProfile
        Every node, each with L per-layer times; ``holds_data`` marks owners.
    samples : mapping of str to int
        Training samples per owner name (other names are ignored).
    schedule : Schedule
        Batch, micro-batches, schedule kind and transport of every pipeline.
    method : {"even", "heuristic", "optimal"}
    local_epochs : float
        Passes over each owner's data per round (when ``steps_per_round`` is 0).
    steps_per_round : int
        If > 0, every pipeline runs this many steps.
    time_limit_s : float
        Limit for ``optimal`` (its enumeration and each per-pipeline solve).

    Returns
    -------
    FederatedPlan

    Raises
    ------
    InfeasibleMemoryError
        Naming the owner whose pipeline cannot fit even with every helper (``even``
        also when its equal cuts do not fit).
    ValueError
        On no owners, a missing sample count (names the owner), an owner with fewer
        samples than a batch, duplicate names, or an unknown method.
    """
    t0 = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    inst = Instance(
        layers,
        nodes,
        samples,
        schedule,
        local_epochs=local_epochs,
        steps_per_round=steps_per_round,
        time_limit_s=time_limit_s,
    )
    inst.check_owners()
    alone = [inst.alone_time(k) for k in range(inst.K)]
    fedavg = max(alone) if all(math.isfinite(t) for t in alone) else None
    solution, plans, proven, note, cuts = _choose(inst, method, t0, time_limit_s)
    round_time = max(inst.timeline(solution, plans)[1])
    if method != "even" and fedavg is not None and fedavg <= round_time:
        solution = [(k, frozenset()) for k in range(inst.K)]
        plans = [inst.plan(k, (), cuts) for k in range(inst.K)]
        round_time = fedavg
        note = "every owner trains alone (FedAvg): predicted no slower than any split"
    pipes = inst.pipelines(solution, plans)
    bound, owner_bounds = lower_bounds(inst)
    used = {n for p in pipes for n in p.nodes}
    return FederatedPlan(
        method=method,
        pipelines=pipes,
        round_time_s=round_time,
        fedavg_round_time_s=fedavg,
        lower_bound_s=bound,
        owner_bounds_s=owner_bounds,
        proven_optimal=proven,
        solve_time_s=time.perf_counter() - t0,
        idle_helpers=tuple(h.name for h in inst.helpers if h.name not in used),
        note=note,
    )


def _choose(
    inst: Instance, method: str, t0: float, time_limit_s: float
) -> tuple[Solution, list[Plan], bool, str, str]:
    """Solution, its plans, proven, note and the per-pipeline method of the cuts.

    Raises
    ------
    InfeasibleMemoryError
        If a chosen pipeline does not fit (``even``'s equal cuts).
    """
    proven, cuts = False, method
    if method == "even":
        solution, note = even_solution(inst)
    else:
        solution, note = heuristic_solution(inst, t0 + HEURISTIC_BUDGET_S)
    if method == "optimal":
        solution, proven, note, cuts = optimal_solution(inst, t0 + time_limit_s, solution)
    plans = []
    for k, s in solution:
        plan = inst.plan(k, s, cuts)
        if plan is None:
            names = [inst.owners[k].name, *(inst.helpers[h].name for h in sorted(s))]
            why = (
                " with equal layer counts (or has more nodes than layers). Use heuristic "
                "or optimal, which respect memory."
                if method == "even"
                else "."
            )
            raise InfeasibleMemoryError(
                f"{method} allocation: the pipeline of data owner {inst.owners[k].name!r} over "
                f"{names} does not fit memory{why}"
            )
        plans.append(plan)
    return solution, plans, proven, note, cuts


def lower_bounds(inst: Instance) -> tuple[float, dict[str, float]]:
    """The round's lower bound and every owner's (seconds).

    Federation: every step of owner ``k`` puts ``M`` micro-batches through every layer
    (``c_nj = fwd + bwd`` of layer ``j`` on node ``n``, per micro-batch), and pipelines
    that share a node run one after another, so in a round of ``T`` seconds node ``n``
    does at most ``T max_j (w_j / c_nj)`` units of work ``w`` (``w_j``: the mean over
    nodes): ``T >= M sum_k steps_k sum_j w_j / sum_n max_j (w_j / c_nj)`` (total work
    over total speed; exact for nodes that differ by a speed factor). Owner ``k``: its
    pipeline uses a subset of the owner and every helper, so ``T >= steps_k x``
    :meth:`~sky_flower.core.cost.CostModel.step_lower_bound` over them (its memory LP
    only up to :data:`BOUND_LP_VARIABLES` nodes x layers: tens of milliseconds per
    owner kind beyond). The round bound is the largest of these.
    """
    nodes = [*inst.owners, *inst.helpers]
    c = np.array([n.layer_fwd_s for n in nodes], float) + np.array(
        [n.layer_bwd_s for n in nodes], float
    )
    w = c.mean(axis=0)
    pos = w > 0
    total = 0.0
    if pos.any():
        rate = (w[pos][None, :] / np.maximum(c[:, pos], 1e-300)).max(axis=1)
        work = inst.schedule.microbatches * sum(inst.steps) * float(w.sum())
        total = work / float(rate.sum())
    per_kind: dict[int, float] = {}
    owners: dict[str, float] = {}
    for k, o in enumerate(inst.owners):
        kind = inst.owner_kind[k]
        if kind not in per_kind:
            cost = inst.cost(k, range(inst.H))
            cost.memory_lp_bound(max_variables=BOUND_LP_VARIABLES)  # cached for the next
            per_kind[kind] = cost.step_lower_bound()
        owners[o.name] = inst.steps[k] * per_kind[kind]
    return max(total, *owners.values()), owners
