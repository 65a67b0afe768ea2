"""``even``: equal layer counts over every node in configured order.

SkyComputing's baseline (Zhu, Li, You, arXiv 2202.11836): the first ``L mod N`` nodes
take one more layer; the data owner runs stage 0. Memory is checked, not respected:
a node that cannot hold its share raises :class:`InfeasibleMemoryError`.
"""

from __future__ import annotations

import time

from sky_flower.core.cost import CostModel
from sky_flower.core.partition.feasible import check_memory
from sky_flower.core.partition.plan import (
    MIB,
    InfeasibleMemoryError,
    Plan,
    _check_objective,
    _even_stages,
    make_plan,
)


def even(cost: CostModel, objective: str = "step") -> Plan:
    """Equal layer counts over every node, in configured order (data owner first).

    Raises
    ------
    InfeasibleMemoryError
        If a node cannot hold its equal share (names the node and the numbers).
    ValueError
        If there are fewer layers than nodes.
    """
    _check_objective(objective)
    t0 = time.perf_counter()
    if cost.num_layers < cost.num_nodes:
        raise ValueError(
            f"even allocation needs at least one layer per node: the model has "
            f"{cost.num_layers} layers, the fleet {cost.num_nodes} nodes. Use "
            "allocation=heuristic or allocation=optimal, which may leave nodes idle."
        )
    stages = _even_stages(cost)
    mems = cost.stage_memories(stages)
    for (i, a, b), need in zip(stages, mems, strict=True):
        if need > cost.capacity[i]:
            raise InfeasibleMemoryError(
                f"even allocation puts layers {a}..{b} on node {cost.nodes[i].name!r}: "
                f"{need / MIB:.1f} MiB needed, {cost.capacity[i] / MIB:.1f} MiB available. "
                "Use allocation=heuristic or allocation=optimal, which respect memory"
                f"{_fits_elsewhere(cost)}."
            )
    return make_plan(cost, "even", stages, time.perf_counter() - t0, objective=objective)


def _fits_elsewhere(cost: CostModel) -> str:
    """Whether the exact memory check finds another plan that fits (for the message)."""
    res = check_memory(cost, time_limit_s=5.0)
    if res.feasible:
        return f" (a plan that fits exists: {res.method} found one)"
    if res.status == "infeasible":
        return f"; but no plan fits at all (proven by {res.method})"
    return ""
