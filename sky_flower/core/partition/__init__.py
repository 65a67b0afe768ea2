"""Load-balanced layer partitioner: ``even``, ``heuristic``, ``optimal`` (pure, no Flower).

Layer profiles + node profiles + schedule in (a :class:`~sky_flower.core.cost.CostModel`), a
:class:`Plan` out. A plan is a list of stages ``(node, first, last)``: the data owner
runs stage 0, the planner chooses the order of the other nodes, and a node may be left
idle when the pipeline is faster without it (the plan lists idle nodes). Every method is
scored by the same cost model, for one of two objectives:

* ``step``: :meth:`CostModel.step_time`, the time of one step of the schedule that runs
  (``sequential``, ``gpipe`` or ``1f1b`` with ``M`` micro-batches, transfers included);
* ``throughput``: :meth:`CostModel.period`, the slowest resource's time per
  micro-batch, which sets a full pipeline's throughput.

Methods:

* ``even``: equal layer counts over every node in configured order (the first
  ``L mod N`` take one more): SkyComputing's baseline.
* ``heuristic``: SkyComputing's two stages (Zhu, Li, You, arXiv 2202.11836, Sec. 3.3)
  made fast and order-aware. For a cap ``T`` on a stage's time per micro-batch, nodes
  fill greedily in an order (data owner first, then fastest first; also configured
  order and largest memory first): each takes the longest block that fits ``T`` and its
  memory (binary search on prefix sums; a node that fits nothing stays idle). A
  bisection finds the least feasible ``T`` (the throughput plan); for the step objective
  a grid of larger ``T`` (fewer, fuller stages) is scored too. The best candidate, and
  ``even`` and SkyComputing's speed-proportional start, are then polished by moving
  boundary layers in both directions while the objective improves. O(N log L) per fill.
  On small instances, where greedy fills can be far off (unequal nodes, per-pair links,
  binding memory), exact candidates join in: every plan up to 1,000 plans, else the
  chain DP below when its work is small. The exact memory check's witness is always a
  candidate when the check is cheap, and the check runs before any refusal.
* ``optimal``: exact where the section below says so; otherwise the heuristic's plan
  with a certified lower bound and a note saying why it is not proven.

What "optimal" means
--------------------
The minimum of the objective over **every** plan: which nodes take part, **in which
order** (the data owner first), and where the cuts fall, subject to every stage fitting
its node's memory. The order is chosen, not fixed: with one link for every pair of nodes
only the multiset of nodes matters, and exact programmes over node *kinds* scale to large
fleets; with a link per pair (per-node latency and bandwidth) the order changes the
transfers, and choosing it is NP-hard (with the blocks fixed, ordering the nodes to
minimise summed links is a shortest Hamiltonian path), so the exact method is
exponential in the number of *distinct* nodes. Proven (``proven_optimal=True``, lower
bound equal to the value):

* any fleet and schedule with at most ``ENUMERATION_LIMIT`` plans (enumeration);
* ``throughput``: one link for every pair, any size up to ``DP_STATE_LIMIT`` kind states
  (:class:`~.dp._PeriodDP`); a link per pair, up to ``CHAIN_DP_WORK_LIMIT`` work, i.e.
  about 12 distinct nodes at 40 layers, more when nodes repeat
  (:class:`~.chain._ChainDP`: a DP over (nodes in use, last node's link, layer));
* ``step`` as a sum over stages (``sequential`` on either transport, or M = 1 on
  ``direct``): the same chain DP, or :class:`~.dp._SumDP` for one link everywhere;
* ``step`` with GPipe, M > 1, ``direct``: the chain DP inside a branch and bound over
  caps on the step's two maxima (16 nodes x 123 entries, M = 4: about 16 s);
* ``step`` with GPipe otherwise: the slot/kind MILP (one link for every pair) within
  ``time_limit_s``.

Not proven: 1F1B with M > 1 when memory binds (its stash depends on the stage's
position), the relay's pipelined schedules (the simulator, no closed form), fleets above
the work limits, and any exact path stopped by ``time_limit_s`` (it then says so in the
note and keeps the better of its best and the heuristic's plan). Every plan carries a
lower bound (:meth:`CostModel.lower_bound`: total work over total speed, and one
micro-batch's critical path; for ``optimal`` also HiGHS's dual bound).

Memory feasibility is decided exactly before any method refuses
(:func:`~.feasible.check_memory`: a DP over capacity kinds, or a feasibility MILP that
answers ``unknown`` when it runs out of time); the error says which check proved it.

Modules: :mod:`.plan` (:class:`Plan`, :func:`make_plan`, shared helpers), :mod:`.even`,
:mod:`.heuristic`, :mod:`.enumeration` and :mod:`.brute` (enumeration,
:func:`brute_force`, :func:`feasible_stages`), :mod:`.feasible` (exact memory check),
:mod:`.chain` (per-pair links), :mod:`.milp` (the slot/kind MILP), :mod:`.dp` (the period
and sum DPs over node kinds), :mod:`.optimal` (dispatch among the exact methods).

Example
-------
>>> plan = partition(cost_model, "heuristic")   # doctest: +SKIP
>>> print(plan.table())                          # doctest: +SKIP
"""

from __future__ import annotations

from sky_flower.core.cost import CostModel
from sky_flower.core.partition.brute import (
    brute_force,
    feasible_bounds,
    feasible_stages,
)
from sky_flower.core.partition.chain import CHAIN_DP_WORK_LIMIT
from sky_flower.core.partition.dp import DP_STATE_LIMIT, SUM_DP_WORK_LIMIT
from sky_flower.core.partition.enumeration import ENUMERATION_LIMIT
from sky_flower.core.partition.even import even
from sky_flower.core.partition.heuristic import heuristic
from sky_flower.core.partition.milp import MILP_VARIABLE_LIMIT
from sky_flower.core.partition.optimal import optimal
from sky_flower.core.partition.plan import (
    MIB,
    OBJECTIVES,
    InfeasibleMemoryError,
    Plan,
    StagePlan,
    _check_objective,
    make_plan,
)
from sky_flower.core.schedule import MILP_TIME_LIMIT_S

METHODS = ("even", "heuristic", "optimal")

__all__ = [
    "CHAIN_DP_WORK_LIMIT",
    "DP_STATE_LIMIT",
    "ENUMERATION_LIMIT",
    "METHODS",
    "MIB",
    "MILP_VARIABLE_LIMIT",
    "OBJECTIVES",
    "SUM_DP_WORK_LIMIT",
    "InfeasibleMemoryError",
    "Plan",
    "StagePlan",
    "brute_force",
    "even",
    "feasible_bounds",
    "feasible_stages",
    "heuristic",
    "make_plan",
    "optimal",
    "partition",
]


def partition(
    cost: CostModel,
    method: str,
    *,
    objective: str = "step",
    time_limit_s: float = MILP_TIME_LIMIT_S,
    mip_rel_gap: float = 1e-6,
) -> Plan:
    """Partition by ``method`` (``even``, ``heuristic`` or ``optimal``).

    Raises
    ------
    ValueError
        On an unknown method or objective (lists the valid ones).
    InfeasibleMemoryError
        If no plan fits the nodes' memory (proven by the exact check, whose name the
        message gives) or the check could not decide within ``time_limit_s``.

    The chunked kinds (``interleaved``, ``zero_bubble``) and ``auto`` are searched with
    :attr:`~sky_flower.core.schedule.Schedule.search_kind` (the plan is theirs; the Sky
    planner then predicts the real kind, :func:`sky_flower.sky.planning.planning.chosen_schedule`).
    """
    _check_objective(objective)
    if cost.schedule.kind != cost.schedule.search_kind:
        cost = CostModel(cost.layers, cost.nodes, cost.schedule.for_search())
    if method == "even":
        return even(cost, objective)
    if method == "heuristic":
        return heuristic(cost, objective, time_limit_s=time_limit_s)
    if method == "optimal":
        return optimal(cost, objective, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap)
    raise ValueError(f"unknown allocation {method!r}: choose one of {', '.join(METHODS)}")
