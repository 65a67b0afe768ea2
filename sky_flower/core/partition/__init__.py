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
* ``optimal``: exact. Small instances are enumerated (every order, idle set and cut).
  With one link for every pair of nodes, two dynamic programmes over how many nodes of
  each kind are in use (identical nodes are interchangeable) prove the optimum:
  :class:`_PeriodDP` for ``throughput``, :class:`_SumDP` for a one-pass step
  (``sequential`` or M = 1, ``direct``). Otherwise a MILP solved by HiGHS
  (:func:`scipy.optimize.milp`) over pipeline *slots* and node *kinds* (nodes with
  identical profiles are interchangeable, so the model chooses how many of each kind
  and where, not which one; this removes the symmetry that stalls node-indexed
  models): binary ``y[k, j]`` = layer j in slots ``<= k``,
  binary ``z[k, t]`` = slot k runs a node of kind t, continuous ``x[k, j, t]`` = layer j
  in slot k of kind t. The MILP needs the ``direct`` transport and links that are the
  same for every node pair (otherwise the heuristic's plan is returned, with a note).

Every plan carries a lower bound (:meth:`CostModel.lower_bound`: total work over total
speed, and one micro-batch's critical path; for ``optimal`` also HiGHS's dual bound).

Modules: :mod:`.plan` (:class:`Plan`, :func:`make_plan`, shared helpers), :mod:`.even`,
:mod:`.heuristic`, :mod:`.brute` (enumeration, :func:`brute_force`,
:func:`feasible_stages`), :mod:`.milp` (the slot/kind MILP), :mod:`.dp` (the period and
sum DPs over node kinds), :mod:`.optimal` (dispatch among the exact methods).

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

METHODS = ("even", "heuristic", "optimal")

__all__ = [
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
    time_limit_s: float = 30.0,
    mip_rel_gap: float = 1e-6,
) -> Plan:
    """Partition by ``method`` (``even``, ``heuristic`` or ``optimal``).

    Raises
    ------
    ValueError
        On an unknown method or objective (lists the valid ones).
    InfeasibleMemoryError
        If the layers cannot fit the nodes' memory.
    """
    _check_objective(objective)
    if method == "even":
        return even(cost, objective)
    if method == "heuristic":
        return heuristic(cost, objective)
    if method == "optimal":
        return optimal(cost, objective, time_limit_s=time_limit_s, mip_rel_gap=mip_rel_gap)
    raise ValueError(f"unknown allocation {method!r}: choose one of {', '.join(METHODS)}")
