"""The three ways of choosing every owner's helpers: ``even``, ``heuristic``, ``optimal``.

Each returns a *solution*: ``(owner, helper set)`` in priority order (see
:mod:`~sky_flower.core.federated.instance`); the per-pipeline cuts come from
:func:`~sky_flower.core.partition.partition` with the same method.
"""

from __future__ import annotations

from sky_flower.core.federated.greedy import chain_search
from sky_flower.core.federated.instance import Instance, Solution


def by_samples(inst: Instance) -> list[int]:
    """Owner indices, most samples first (ties: fleet order)."""
    return sorted(range(inst.K), key=lambda k: (-inst.samples[k], k))


def even_solution(inst: Instance) -> tuple[Solution, str]:
    """Helpers dealt round-robin over the owners, most samples first.

    Rank the owners by samples (most first, ties: fleet order). With at least as many
    helpers as owners (``H >= K``), helper ``h`` (fleet order of the helpers) joins the
    owner ranked ``h mod K``, and every pipeline starts at once. With fewer
    (``0 < H < K``), the owner ranked ``r`` takes helper ``r mod H`` alone, and the
    pipelines sharing a helper run one after another, most samples first. With no
    helpers every owner trains alone. Inside each pipeline the ``even`` partition cuts
    equal layer counts in fleet order (owner first).
    """
    order = by_samples(inst)
    K, H = inst.K, inst.H
    if H >= K:
        sets = [frozenset(h for h in range(H) if h % K == r) for r in range(K)]
        note = "even: helper h joins the owner ranked h mod K by samples; all at once"
    elif H:
        sets = [frozenset({r % H}) for r in range(K)]
        note = (
            "even: the owner ranked r by samples takes helper r mod H; pipelines sharing "
            "a helper run one after another, most samples first"
        )
    else:
        sets = [frozenset() for _ in range(K)]
        note = "even: no helpers, every owner trains alone"
    return [(order[r], sets[r]) for r in range(K)], note


def heuristic_solution(inst: Instance, deadline: float) -> tuple[Solution, str]:
    """The best of three candidates: the chain search
    (:mod:`~sky_flower.core.federated.greedy`, local search until ``deadline``, a
    :func:`time.perf_counter` value), every owner alone, and ``even``'s assignment.
    ``even``'s is scored with ``even`` cuts and, when it wins, returned for
    ``heuristic`` cuts, which are never worse per pipeline and use no more nodes: so the
    heuristic is never worse than ``even`` when ``even`` fits."""
    order = by_samples(inst)
    chains = chain_search(inst, order, deadline)
    alone = [(k, frozenset()) for k in order]
    best = min(
        [(chains, "heuristic: chain search"), (alone, "heuristic: every owner alone")],
        key=lambda c: inst.makespan(c[0], "heuristic"),
    )
    ev = even_solution(inst)[0]
    if inst.makespan(ev, "even") < inst.makespan(best[0], "heuristic"):
        return ev, "heuristic: even's assignment with heuristic cuts"
    return best
