"""Schedules with several model chunks per rank: interleaved 1F1B and zero bubble (pure).

A pipeline of ``S`` ranks with ``v`` chunks ("virtual stages") per rank cuts the model
into ``C = S v`` contiguous chunks; chunk ``c`` runs on rank ``c mod S`` (torch's "loop"
placement), so a micro-batch visits every rank ``v`` times. Two schedules of
``torch.distributed.pipelining`` (torch 2.13) use it, and this module gives their
per-rank op order, a discrete-event simulation of a step, and the plan-level step time
and memory the cost model uses:

* ``"interleaved"``: ``ScheduleInterleaved1F1B`` (Narayanan et al. 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", arXiv
  2104.04473): the warm-up shrinks the bubble from ``(S-1)(f+b)`` to about
  ``(S-1)(f+b)/v``;
* ``"zero_bubble"``: ``ScheduleInterleavedZeroBubble`` (ZB1P of Qi et al. 2024, "Zero
  Bubble Pipeline Parallelism", arXiv 2401.10241): each backward is split into the
  input gradient ``I`` (sent back at once) and the weight gradient ``W`` (deferred to
  fill bubbles). ``I`` and ``W`` are charged ``(1 - w) b`` and ``w b`` of the measured
  backward ``b`` with ``w = WEIGHT_GRAD_SHARE`` (0.5: a linear layer's two matrix
  products of equal size; the benchmark round does not time them apart).

:func:`rank_orders` is a transcription of torch's ``_calculate_single_rank_operations``
/ ``_get_1f1b_rank_ops`` with the idle slots (``None``) dropped; the tests compare it
with torch's own ``pipeline_order``. :func:`simulate_chunks` plays the orders with
every rank and every directed rank pair (link) a resource, links first in first out
by readiness (:func:`play`, which :func:`sky_flower.core.simulate.simulate` plays
GPipe / 1F1B with too: ``v = 1``). Units: seconds (per micro-batch for the
inputs), bytes for memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

VIRTUAL_KINDS = ("interleaved", "zero_bubble")
WEIGHT_GRAD_SHARE = 0.5


class Action(NamedTuple):
    """One op of a pipeline schedule, as every schedule kind produces it and every
    consumer reads it: the relay's and the stream's drivers
    (:func:`sky_flower.sky.transport.hops.step_orders`), the direct schedules' cost
    model (:func:`simulate_chunks`) and the relay's and stream's
    (:func:`sky_flower.core.simulate.simulate`). torch's pipelining names the same
    thing ``_Action(stage_index, computation_type, microbatch_index)``.

    Attributes
    ----------
    op : {"F", "B", "I", "W"}
        Forward, full backward, input gradient, weight gradient (zero bubble).
    stage : int
        The (virtual) stage the op runs: the stage index, or the model chunk under
        ``interleaved`` / ``zero_bubble`` (chunk ``c`` on rank ``c mod S``).
    microbatch : int
        The micro-batch (the relay's and stream's message group).
    """

    op: str
    stage: int
    microbatch: int


def check_virtual(kind: str, stages: int, chunks: int, microbatches: int) -> None:
    """Raise ``ValueError`` unless torch 2.13 runs ``kind`` with these sizes.

    torch runs ``M // max(1, M // S)`` micro-batches per round and needs the rounds to
    divide ``M``; each chunk needs at least one layer (checked by :func:`split_chunks`).
    """
    if kind not in VIRTUAL_KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}: use one of {', '.join(VIRTUAL_KINDS)}")
    if stages < 1 or chunks < 1 or microbatches < 1:
        raise ValueError(
            f"need stages, chunks and micro-batches >= 1, got {stages}, {chunks}, {microbatches}"
        )
    rounds = max(1, microbatches // stages)
    if microbatches % rounds:
        raise ValueError(
            f"schedule.kind={kind} with {stages} stages needs schedule.microbatches to be a "
            f"multiple of max(1, M // S) = {rounds} (torch's rounds), got {microbatches}: "
            f"use a multiple of {stages}"
        )


def rank_orders(kind: str, stages: int, chunks: int, microbatches: int) -> list[list[Action]]:
    """Per-rank op order of ``kind`` as torch 2.13 runs it (idle slots dropped).

    Parameters
    ----------
    kind : {"interleaved", "zero_bubble"}
    stages, chunks, microbatches : int
        Ranks ``S``, chunks per rank ``v``, micro-batches ``M``.

    Returns
    -------
    list of list of (str, int, int)
        ``orders[r]``: rank ``r``'s ops ``(op, chunk, micro-batch)``; ``op`` is ``F``,
        ``B`` (full backward; interleaved) or ``I`` / ``W`` (zero bubble).

    Raises
    ------
    ValueError
        As :func:`check_virtual`.
    """
    check_virtual(kind, stages, chunks, microbatches)
    return [_rank_ops(kind, stages, chunks, microbatches, r) for r in range(stages)]


def _rank_ops(kind: str, S: int, v: int, M: int, rank: int) -> list[Action]:
    """torch's ``_get_1f1b_rank_ops`` for one rank (see :func:`rank_orders`)."""
    zb = kind == "zero_bubble"
    per_round = M // max(1, M // S)
    warmup = min((v - 1) * per_round + (1 if zb else 2) * (S - 1 - rank), M * v)
    steady = M * v - warmup

    def fwd_chunk(op: int) -> int:
        return ((op // per_round) % v) * S + rank

    def bwd_chunk(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * S + rank

    count = {"F": [0] * (S * v), "B": [0] * (S * v), "W": [0] * (S * v)}

    def nxt(op: str, c: int) -> Action:
        m = count[op][c]
        count[op][c] += 1
        return Action("I" if zb and op == "B" else op, c, m)

    ops: list[Action] = []
    backward_ops: list[int] = []
    weights = 0
    for op in range(warmup + steady + warmup):
        if op < warmup + steady:
            ops.append(nxt("F", fwd_chunk(op)))
        if op >= warmup:
            ops.append(nxt("B", bwd_chunk(op)))
            backward_ops.append(op)
            if zb and op - warmup >= rank:  # torch: num_1f1b_microbatches = rank
                ops.append(nxt("W", bwd_chunk(backward_ops[weights])))
                weights += 1
    while zb and weights < len(backward_ops):
        ops.append(nxt("W", bwd_chunk(backward_ops[weights])))
        weights += 1
    return ops


@dataclass(frozen=True)
class ChunkSim:
    """Outcome of :func:`simulate_chunks` (seconds from the start of the step).

    Attributes
    ----------
    step_time_s : float
        Makespan of the step.
    busy_s : dict[str, float]
        Working seconds of each rank (``"stage{r}"``) and each used link
        (``"link{a}>{b}"``).
    peak_stash : list[float]
        Per rank, the most stash weight held at once: chunk ``c``'s weight (default 1, a
        micro-batch of it) is held from its ``F`` to its ``B`` (or ``W``, which still
        needs the stashed inputs).
    ops : list of (str, str, int, int, float, float)
        ``(resource, op, chunk, micro-batch, start, end)``, sorted by start.
    """

    step_time_s: float
    busy_s: dict[str, float]
    peak_stash: list[float]
    ops: list[tuple[str, str, int, int, float, float]]


def simulate_chunks(  # noqa: PLR0913
    orders: Sequence[Sequence[Action]],
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    fwd_link_s: Sequence[float],
    bwd_link_s: Sequence[float],
    microbatches: int,
    rank_of: Callable[[int], int] | None = None,
    weight_share: float = WEIGHT_GRAD_SHARE,
    stash: Sequence[float] | None = None,
) -> ChunkSim:
    """Play one step of per-rank op orders over ``C`` chunks (discrete events).

    Parameters
    ----------
    orders : sequence of sequence of (op, chunk, micro-batch)
        Per rank, its ops in execution order (:func:`rank_orders`, or
        ``[("F" | "B", k, m) ...]`` for GPipe / 1F1B with one chunk per rank).
    fwd_s, bwd_s : sequence of float, shape (C,)
        Seconds per micro-batch of each chunk's forward and (full) backward.
    fwd_link_s, bwd_link_s : sequence of float, shape (C-1,)
        Seconds to move a micro-batch's activations from chunk ``c`` to ``c+1`` and its
        gradient back (ignored when both chunks are on one rank).
    microbatches : int
        ``M``.
    rank_of : callable, optional
        ``chunk -> rank`` (default ``chunk mod S``).
    weight_share : float
        Share of a backward that is the weight gradient ``W`` (``I`` is the rest).
    stash : sequence of float, shape (C,), optional
        Per-chunk stash weight for :attr:`ChunkSim.peak_stash` (default 1 each).

    Returns
    -------
    ChunkSim

    Raises
    ------
    ValueError
        Wrong lengths, or an order that deadlocks or misses an op.
    """
    S, C = len(orders), len(fwd_s)
    if len(bwd_s) != C or len(fwd_link_s) != C - 1 or len(bwd_link_s) != C - 1:
        raise ValueError(f"need {C} chunk times and {C - 1} link times per direction")
    rec, names, step = play(
        orders, fwd_s, bwd_s, fwd_link_s, bwd_link_s, microbatches, rank_of, weight_share
    )
    busy: dict[str, float] = {f"stage{r}": 0.0 for r in range(S)}
    ops = []
    for start, end, res, op, c, m in rec:
        busy[names[res]] = busy.get(names[res], 0.0) + end - start
        ops.append((names[res], op, c, m, start, end))
    return ChunkSim(step, busy, peak_stash(orders, stash or [1.0] * C), ops)


def peak_stash(orders: Sequence[Sequence[Action]], stash: Sequence[float]) -> list[float]:
    """Per rank, the most stash weight its order holds at once: chunk ``c``'s
    ``stash[c]`` from its ``F`` to its ``B`` (or, the backward split, its ``W``, which
    still needs the stashed inputs)."""
    peak = []
    for order in orders:
        live = top = 0.0
        for op, c, _ in order:
            if op == "F":
                live += stash[c]
                top = max(top, live)
            elif op == "B" or op == "W":
                live -= stash[c]
        peak.append(top)
    return peak


def play(  # noqa: PLR0913, PLR0915
    orders: Sequence[Sequence[Action]],
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    fwd_link_s: Sequence[float],
    bwd_link_s: Sequence[float],
    microbatches: int,
    rank_of: Callable[[int], int] | None = None,
    weight_share: float = WEIGHT_GRAD_SHARE,
) -> tuple[list[tuple[float, float, int, str, int, int]], list[str], float]:
    """The timeline of one step (:func:`simulate_chunks`; :func:`sky_flower.core.
    simulate.simulate` is its one-chunk-per-rank case): every op as ``(start, end,
    resource, op, chunk, micro-batch)``, sorted; the resources' names; the step's
    makespan (seconds).

    Resources: rank ``r`` is resource ``r`` (``"stage{r}"``), the link from rank ``r``
    to ``r + 1`` resource ``S + r``, from ``r + 1`` back to ``r`` ``2 S - 1 + r``, any
    other pair (the wrap-around of chunked schedules) a number after those (each
    ``"link{a}>{b}"``). A link op (``SF`` activations, ``SB`` gradients) names the
    chunk it feeds.

    An op starts at the later of "its rank is free" and "its inputs have arrived"
    (``F`` the chunk's input; ``B`` / ``I`` its output's gradient, or its own ``F`` on
    the last chunk; ``W`` its ``I``); a transfer starts at the later of "its link is
    free" and the end of the op that sends it. Every link has one sender, whose sends
    become ready in its order, so serving a link in the order its sends are played is
    first in first out by readiness. The ranks are played with a work list: each runs
    its order until an op's input has not arrived, and runs again once one does; each
    op is visited once (``O(S M v)``).

    Raises
    ------
    ValueError
        If an order deadlocks (an op whose input never arrives) or misses an op.
    """
    S, C, M = len(orders), len(fwd_s), microbatches
    dur = {"F": list(fwd_s), "B": list(bwd_s)}
    dur["I"] = [(1.0 - weight_share) * b for b in bwd_s]
    dur["W"] = [weight_share * b for b in bwd_s]
    nan = math.nan
    # act[c][m]: chunk c's input of micro-batch m has arrived (chunk 0 has it at t = 0);
    # grad[c][m]: its output's gradient; f_end / i_end: its own F / I (or B) ended
    act = [[0.0] * M] + [[nan] * M for _ in range(C - 1)]
    grad = [[nan] * M for _ in range(C)]
    f_end = [[nan] * M for _ in range(C)]
    i_end = [[nan] * M for _ in range(C)]
    rank = [rank_of(c) if rank_of else c % S for c in range(C)]
    free = [0.0] * S
    names = [f"stage{r}" for r in range(S)]
    names += [f"link{r}>{r + 1}" for r in range(S - 1)] + [f"link{r + 1}>{r}" for r in range(S - 1)]
    link_free = [0.0] * len(names)  # by resource (ranks' entries unused)
    ids: dict[tuple[int, int], int] = {}
    for r in range(S - 1):
        ids[(r, r + 1)], ids[(r + 1, r)] = S + r, 2 * S - 1 + r

    def send(src: int, c: int, m: int, t: float, kind: str, seconds: float) -> float:
        """When the transfer to chunk ``c`` sent at ``t`` arrives (at once on its rank)."""
        dst = rank[c]
        if dst == src:
            return t
        q = ids.get((src, dst))
        if q is None:
            q = ids[(src, dst)] = len(names)
            names.append(f"link{src}>{dst}")
            link_free.append(0.0)
        t0 = link_free[q] if link_free[q] > t else t
        t1 = link_free[q] = t0 + seconds
        rec.append((t0, t1, q, kind, c, m))
        work.append(dst)
        return t1

    rec: list[tuple[float, float, int, str, int, int]] = []
    ptr = [0] * S
    work = list(range(S - 1, -1, -1))  # pop() takes rank 0 first
    while work:
        r = work.pop()
        order, i, t = orders[r], ptr[r], free[r]
        while i < len(order):
            op, c, m = order[i]
            if op == "F":
                ready = act[c][m]
            elif op == "W":
                ready = i_end[c][m]
            else:  # its gradient comes after its own F (the last chunk's: its F)
                ready = f_end[c][m] if c == C - 1 else grad[c][m]
            if ready != ready:  # NaN: not arrived yet
                break
            start = ready if ready > t else t
            t = start + dur[op][c]
            rec.append((start, t, r, op, c, m))
            i += 1
            if op == "F":
                f_end[c][m] = t
                if c < C - 1:
                    act[c + 1][m] = send(r, c + 1, m, t, "SF", fwd_link_s[c])
            elif op != "W":
                i_end[c][m] = t
                if c > 0:
                    grad[c - 1][m] = send(r, c - 1, m, t, "SB", bwd_link_s[c - 1])
        ptr[r], free[r] = i, t
    stuck = [r for r in range(S) if ptr[r] < len(orders[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(f"the order deadlocks on rank {r} at {orders[r][ptr[r]]}")
    rec.sort()
    return rec, names, max(free)  # every op ends on a rank, after what fed it


def split_chunks(stages: Sequence[tuple[int, int, int]], chunks: int) -> list[tuple[int, int, int]]:
    """Cut a plan's stages into ``S v`` chunks, chunk ``c`` on stage ``c mod S``'s node.

    The model's ``L`` layers are cut into ``v`` laps of (nearly) equal layer count and
    each lap into ``S`` pieces in proportion to the plan's stages' layer counts (each at
    least one layer), so a node keeps about the share of the model the planner gave it.

    Parameters
    ----------
    stages : sequence of (node, first, last)
        The plan's stages (contiguous, in pipeline order).
    chunks : int
        ``v >= 1`` chunks per stage (``v = 1`` returns the stages).

    Returns
    -------
    list of (node, first, last), length ``S v``

    Raises
    ------
    ValueError
        If the model has fewer than ``S v`` layers.
    """
    S, L = len(stages), stages[-1][2] + 1
    if chunks == 1:
        return [tuple(s) for s in stages]  # type: ignore[misc]
    if L < S * chunks:
        raise ValueError(
            f"{chunks} chunks per stage over {S} stages need at least {S * chunks} layers; "
            f"the model has {L}: lower schedule.chunks"
        )
    share = np.array([s[2] - s[1] + 1 for s in stages], dtype=float) / L
    laps = np.linspace(0, L, chunks + 1).round().astype(int)
    out = []
    for lap in range(chunks):
        a, n = int(laps[lap]), int(laps[lap + 1] - laps[lap])
        sizes = _apportion(share, n)
        for k, size in enumerate(sizes):
            out.append((stages[k][0], a, a + size - 1))
            a += size
    return out


def _apportion(share: np.ndarray, n: int) -> list[int]:
    """``n`` layers over ``len(share)`` pieces in proportion to ``share``, each >= 1."""
    S = len(share)
    if n < S:  # a short lap: one layer each is impossible; caller's laps avoid it
        raise ValueError(f"a lap of {n} layers cannot give {S} stages one layer each")
    sizes = np.ones(S, dtype=int) + np.floor(share * (n - S)).astype(int)
    rest = share * (n - S) - np.floor(share * (n - S))
    for k in np.argsort(-rest, kind="stable")[: n - int(sizes.sum())]:
        sizes[k] += 1
    return [int(x) for x in sizes]
