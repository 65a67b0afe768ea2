"""``optimal``: the exact partition, by whichever exact method fits the instance.

Dispatch, cheapest proof first (what each proves: the package docstring, "What
"optimal" means"):

1. small instances (at most ``ENUMERATION_LIMIT`` plans): exhaustive enumeration
   (:mod:`~sky_flower.core.partition.enumeration`), stopped by ``time_limit_s``;
2. a link per pair of nodes: the chain DP over (nodes in use, last node's link, layer)
   (:mod:`~sky_flower.core.partition.chain`), for throughput, one-pass steps and GPipe;
3. ``throughput`` with one link for every pair: the period DP over node kinds
   (:class:`~sky_flower.core.partition.dp._PeriodDP`);
4. one-pass ``step`` (``sequential`` or M = 1, ``direct``) with one link for every
   pair: the min-plus DP over node kinds and layers
   (:class:`~sky_flower.core.partition.dp._SumDP`);
5. one link for every pair, otherwise: the chain DP (GPipe's branch and bound) when its
   work is small, else the slot/kind MILP solved by HiGHS
   (:class:`~sky_flower.core.partition.milp._SlotMilp`), or the heuristic's plan with a
   note saying why nothing exact applies.

Never worse than :func:`~sky_flower.core.partition.heuristic.heuristic`, which also
decides memory feasibility exactly before any solving.
"""

from __future__ import annotations

import math
import time

import numpy as np

from sky_flower.core.cost import CostModel
from sky_flower.core.partition.chain import CHAIN_DP_WORK_LIMIT, _chain_case, _ChainDP
from sky_flower.core.partition.dp import DP_STATE_LIMIT, SUM_DP_WORK_LIMIT, _PeriodDP, _SumDP
from sky_flower.core.partition.enumeration import ENUMERATION_LIMIT, _count_plans, _enumerate
from sky_flower.core.partition.heuristic import heuristic
from sky_flower.core.partition.milp import MILP_VARIABLE_LIMIT, _milp_ok, _SlotMilp, plan_gap
from sky_flower.core.partition.plan import Plan, _check_objective, _kinds, make_plan
from sky_flower.core.schedule import MILP_TIME_LIMIT_S

SOLVERS = ("auto", "enumerate", "milp", "dp", "chain")


def optimal(
    cost: CostModel,
    objective: str = "step",
    time_limit_s: float = MILP_TIME_LIMIT_S,
    mip_rel_gap: float = 1e-6,
    solver: str = "auto",
) -> Plan:
    """Minimum objective over every plan (order, idle nodes, cuts), proven.

    Enumeration when there are at most ``ENUMERATION_LIMIT`` plans, otherwise the
    slot/kind MILP (module docstring) solved by HiGHS. Never worse than
    :func:`heuristic`: if HiGHS stops at the time limit, the better of its incumbent
    and the heuristic's plan is returned, with a note.

    Parameters
    ----------
    objective : {"step", "throughput"}
    time_limit_s : float
        HiGHS time limit (seconds).
    mip_rel_gap : float
        Relative gap at which HiGHS may stop and call the solution optimal.
    solver : {"auto", "enumerate", "milp", "dp"}
        ``auto``: enumeration up to ``ENUMERATION_LIMIT`` plans; else, for
        ``throughput`` with one link for every pair, the exact programme over node kinds
        (``dp``, up to ``DP_STATE_LIMIT`` states); else the MILP.

    Raises
    ------
    InfeasibleMemoryError
        If no assignment fits memory.
    ValueError
        On an unknown solver.
    """
    _check_objective(objective)
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}: use {', '.join(SOLVERS)}")
    t0 = time.perf_counter()
    h = heuristic(cost, objective, time_limit_s=time_limit_s)  # proves infeasibility first
    lb = cost.lower_bound(objective)
    small = _count_plans(cost.num_nodes, cost.num_layers) <= ENUMERATION_LIMIT
    if solver == "enumerate" or (solver == "auto" and small):
        return _by_enumeration(cost, objective, t0, lb, h, time_limit_s)
    uniform = len(set(cost.inv_bw.tolist())) == 1 and len(set(cost.latency.tolist())) == 1
    if solver == "chain" or (solver == "auto" and not uniform):
        plan = _by_chain(cost, objective, t0, lb, h, time_limit_s)
        if plan is not None:
            return plan
    if objective == "throughput" and uniform and solver in ("auto", "dp"):
        plan = _by_period_dp(cost, objective, t0, lb, h, time_limit_s)
        if plan is not None:
            return plan
    one_pass = cost.schedule.kind == "sequential" or cost.schedule.microbatches == 1
    if objective == "step" and one_pass and uniform and not cost.relay and solver in ("auto", "dp"):
        plan = _by_sum_dp(cost, objective, t0, h, time_limit_s)
        if plan is not None:
            return plan
    if solver == "auto" and uniform:
        plan = _by_chain(cost, objective, t0, lb, h, time_limit_s)
        if plan is not None:
            return plan
    why = _why_not_milp(cost, objective, solver)
    if why is not None:
        return make_plan(
            cost,
            "optimal",
            h.spec,
            time.perf_counter() - t0,
            lower_bound_s=lb,
            objective=objective,
            note=f"{why}: heuristic plan, not proven",
        )
    return _by_milp(cost, objective, t0, lb, h, time_limit_s, mip_rel_gap)


def _by_enumeration(  # noqa: PLR0913
    cost: CostModel, objective: str, t0: float, lb: float, h: Plan, time_limit_s: float
) -> Plan:
    """The enumerated optimum, proven; when the time limit stops the enumeration, the
    better of its best so far and the heuristic's plan, not proven."""
    best, done = _enumerate(cost, objective, deadline=t0 + time_limit_s)
    if best is None or (not done and cost.objective(best, objective) > h.objective_value_s):
        best = h.spec
    v = cost.objective(best, objective)
    note = "exhaustive enumeration"
    if not done:
        note += f": time limit {time_limit_s:g} s reached, not proven"
    return make_plan(
        cost,
        "optimal",
        best,
        time.perf_counter() - t0,
        lower_bound_s=min(lb, v) if done else lb,
        objective=objective,
        proven_optimal=done,
        note=note,
    )


def _by_period_dp(  # noqa: PLR0913
    cost: CostModel, objective: str, t0: float, lb: float, h: Plan, time_limit_s: float
) -> Plan | None:
    """The period DP's plan, or None when it has too many states."""
    dp = _PeriodDP(cost)
    if dp.num_states > DP_STATE_LIMIT:
        return None
    deadline = t0 + time_limit_s
    stages, proven = dp.solve(h.period_s, deadline)
    if stages is None or cost.period(stages) > h.period_s:
        stages = h.spec
    one_f = cost.schedule.kind == "1f1b" and not cost.relay
    proven = proven and not one_f
    v = cost.period(stages)
    note = "exact dynamic programme over node kinds"
    if one_f:
        note += " (1F1B memory charged for N stages: not proven)"
    elif not proven:
        note += f": time limit {time_limit_s:g} s reached"
    return _dp_plan(cost, objective, stages, t0, v if proven else lb, proven, note)


def _by_sum_dp(
    cost: CostModel, objective: str, t0: float, h: Plan, time_limit_s: float = math.inf
) -> Plan | None:
    """The one-pass DP's plan, proven, or None when its work is over the limit (the
    heuristic's plan, not proven, when the time limit stops it)."""
    dp2 = _SumDP(cost)
    if dp2.work > SUM_DP_WORK_LIMIT:
        return None
    stages = dp2.solve(t0 + time_limit_s)
    if stages == "timeout":
        note = f"one-pass dynamic programme: time limit {time_limit_s:g} s reached, "
        note += "heuristic plan, not proven"
        return _dp_plan(cost, objective, h.spec, t0, cost.lower_bound(objective), False, note)
    if stages is None or cost.step_time(stages) > h.predicted_step_time_s:
        stages = h.spec
    note = "exact dynamic programme over node kinds and layers (one pass)"
    return _dp_plan(cost, objective, stages, t0, cost.step_time(stages), True, note)


def _why_not_milp(cost: CostModel, objective: str, solver: str) -> str | None:
    """None if the MILP should run, else why the heuristic's plan is returned."""
    why = _milp_ok(cost)
    if why is None and objective == "throughput" and solver == "auto":
        why = (
            f"the exact programme has {_PeriodDP(cost).num_states} node-kind states "
            f"(limit {DP_STATE_LIMIT}) and the MILP's bound is too weak for throughput"
        )
    if why is None:
        n_kinds = len(set(_kinds(cost)) - {-1})
        size = min(cost.num_nodes, cost.num_layers) * cost.num_layers * max(n_kinds, 1)
        if size > MILP_VARIABLE_LIMIT:
            why = f"the MILP would have {size} variables (limit {MILP_VARIABLE_LIMIT})"
    return why


def _by_milp(  # noqa: PLR0913
    cost: CostModel,
    objective: str,
    t0: float,
    lb: float,
    h: Plan,
    time_limit_s: float,
    mip_rel_gap: float,
) -> Plan:
    """The MILP's plan (or the heuristic's where it is better), with HiGHS's bound; its
    ``mip_gap`` is the returned plan's own gap to that bound (:func:`plan_gap`), never
    that of an incumbent it was not."""
    model = _SlotMilp(cost, objective)
    remaining = max(time_limit_s - (time.perf_counter() - t0), 0.1)
    res = model.solve(remaining, mip_rel_gap)
    dual = getattr(res, "mip_dual_bound", None)
    surrogate = objective == "step" and cost.schedule.kind == "1f1b"
    if dual is not None and np.isfinite(dual) and not surrogate:
        lb = max(lb, float(dual) + model.offset)
    h_v = h.objective_value_s
    proven = False
    if res.x is not None:
        stages = model.to_stages(res.x)
        v = cost.objective(stages, objective)
        if res.status == 0 and not surrogate:
            # proven within mip_rel_gap; the heuristic may match it within that gap
            if h_v < v:
                stages, v = h.spec, h_v
            proven, lb, note = True, min(lb, v), ""
        elif v <= h_v:
            note = (
                "MILP minimised GPipe's closed form as a surrogate for 1F1B"
                if surrogate
                else f"time limit {time_limit_s:g} s reached: MILP incumbent (beats heuristic)"
            )
        else:
            stages, v, note = h.spec, h_v, "heuristic beats the MILP's plan"
            if res.status != 0:
                note = f"time limit {time_limit_s:g} s reached: " + note
    else:
        stages, v = h.spec, h_v
        note = f"MILP found no solution in {time_limit_s:g} s ({res.message}): heuristic plan"
    return make_plan(
        cost,
        "optimal",
        stages,
        time.perf_counter() - t0,
        lower_bound_s=lb,
        objective=objective,
        proven_optimal=proven,
        mip_gap=plan_gap(v, lb),
        note=note,
    )


def _by_chain(  # noqa: PLR0913
    cost: CostModel, objective: str, t0: float, lb: float, h: Plan, time_limit_s: float
) -> Plan | None:
    """The (kinds, last link class, layer) programme's plan, or None when it does not
    model the objective or is over its work limit."""
    case = _chain_case(cost, objective)
    dp = _ChainDP(cost)
    if case is None or dp.work > CHAIN_DP_WORK_LIMIT:
        return None
    _, stages, done = dp.run(case, h.predicted_step_time_s, t0 + time_limit_s)
    h_v = h.objective_value_s
    if stages is None or cost.objective(stages, objective) > h_v:
        stages = h.spec
    v = cost.objective(stages, objective)
    note = "exact dynamic programme over (nodes in use, last node's link, layer)"
    if case == "gpipe":
        note += " in a branch and bound over caps on the GPipe step's two maxima"
    if not done:
        note += f": time limit {time_limit_s:g} s reached, not proven"
    return _dp_plan(cost, objective, stages, t0, v if done else lb, done, note)


def _dp_plan(  # noqa: PLR0913
    cost: CostModel,
    objective: str,
    stages: list,
    t0: float,
    lower_bound_s: float,
    proven: bool,
    note: str,
) -> Plan:
    """A dynamic programme's plan: proven (gap 0) or not, with its bound and note."""
    return make_plan(
        cost,
        "optimal",
        stages,
        time.perf_counter() - t0,
        lower_bound_s=lower_bound_s,
        objective=objective,
        proven_optimal=proven,
        mip_gap=0.0 if proven else None,
        note=note,
    )
