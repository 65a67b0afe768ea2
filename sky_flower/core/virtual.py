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
by readiness; with ``v = 1`` and the GPipe / 1F1B orders it equals
:func:`sky_flower.core.simulate.simulate`. Units: seconds (per micro-batch for the
inputs), bytes for memory.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
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


ChunkOp = Action  # (op, chunk, micro-batch): a direct schedule's op


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


def rank_orders(kind: str, stages: int, chunks: int, microbatches: int) -> list[list[ChunkOp]]:
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


def _rank_ops(kind: str, S: int, v: int, M: int, rank: int) -> list[ChunkOp]:
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

    def nxt(op: str, c: int) -> ChunkOp:
        m = count[op][c]
        count[op][c] += 1
        return Action("I" if zb and op == "B" else op, c, m)

    ops: list[ChunkOp] = []
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
    orders: Sequence[Sequence[ChunkOp]],
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
    rank_of = rank_of or (lambda c: c % S)
    if len(bwd_s) != C or len(fwd_link_s) != C - 1 or len(bwd_link_s) != C - 1:
        raise ValueError(f"need {C} chunk times and {C - 1} link times per direction")
    dur = {"F": list(fwd_s), "B": list(bwd_s)}
    dur["I"] = [(1.0 - weight_share) * b for b in bwd_s]
    dur["W"] = [weight_share * b for b in bwd_s]
    state = _Sim(S, C, microbatches, rank_of)
    state.run(orders, dur, fwd_link_s, bwd_link_s)
    weights = list(stash) if stash is not None else [1.0] * C
    peak = []
    for order in orders:
        live = top = 0.0
        split = any(op == "W" for op, _, _ in order)
        for op, c, _ in order:
            if op == "F":
                live += weights[c]
            elif op == ("W" if split else "B"):
                live -= weights[c]
            top = max(top, live)
        peak.append(top)
    ops = sorted(state.rec, key=lambda r: (r[4], r[5]))
    busy: dict[str, float] = {f"stage{r}": 0.0 for r in range(S)}
    for res, *_, start, end in ops:
        busy[res] = busy.get(res, 0.0) + end - start
    step = max((r[5] for r in ops), default=0.0)
    return ChunkSim(step, busy, peak, ops)


class _Sim:
    """State of :func:`simulate_chunks`: ranks run their orders, links serve FIFO."""

    def __init__(self, S: int, C: int, M: int, rank_of: Callable[[int], int]) -> None:
        self.S, self.C, self.M, self.rank_of = S, C, M, rank_of
        nan = math.nan
        self.act = [[0.0 if c == 0 else nan for _ in range(M)] for c in range(C)]
        self.grad = [[nan] * M for _ in range(C)]
        self.done: dict[tuple[str, int, int], float] = {}
        self.rec: list[tuple[str, str, int, int, float, float]] = []
        self.heap: list[tuple[float, int, str, tuple]] = []
        self.seq = 0

    def push(self, t: float, what: str, data: tuple) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, what, data))

    def ready(self, op: str, c: int, m: int) -> float:
        """When ``op`` of chunk ``c``, micro-batch ``m`` has its inputs (NaN: not yet)."""
        if op == "F":
            return self.act[c][m]
        if op == "W":
            return self.done.get(("I", c, m), math.nan)
        t = self.done.get(("F", c, m), math.nan)
        g = t if c == self.C - 1 else self.grad[c][m]
        return math.nan if math.isnan(t) or math.isnan(g) else max(t, g)

    def run(self, orders, dur, fl, bl) -> None:  # noqa: ANN001 - see simulate_chunks
        S = self.S
        ptr, free = [0] * S, [True] * S
        queues: dict[tuple[int, int], deque] = {}
        link_free: dict[tuple[int, int], bool] = {}

        def try_start(r: int, t: float) -> None:
            if not free[r] or ptr[r] >= len(orders[r]):
                return
            op, c, m = orders[r][ptr[r]]
            ready = self.ready(op, c, m)
            if ready != ready or ready > t:
                return
            free[r] = False
            self.push(t + dur[op][c], "end", (r, op, c, m, t))

        def start_link(pair: tuple[int, int], t: float) -> None:
            if link_free.get(pair, True) and queues.get(pair):
                link_free[pair] = False
                item = queues[pair].popleft()
                self.push(t + item[3], "arrive", (pair, *item, t))

        for r in range(S):
            try_start(r, 0.0)
        while self.heap:
            t, _, what, data = heapq.heappop(self.heap)
            if what == "end":
                r, op, c, m, t0 = data
                self.rec.append((f"stage{r}", op, c, m, t0, t))
                self.done[(op, c, m)] = t
                ptr[r] += 1
                free[r] = True
                if op == "F" and c < self.C - 1:
                    self.send(queues, (r, self.rank_of(c + 1)), ("SF", c + 1, m, fl[c]), t)
                elif op in ("B", "I") and c > 0:
                    self.send(queues, (r, self.rank_of(c - 1)), ("SB", c - 1, m, bl[c - 1]), t)
                for pair in list(queues):
                    start_link(pair, t)
                for k in range(S):
                    try_start(k, t)
            else:  # a transfer arrived
                pair, kind, c, m, _, t0 = data
                self.rec.append((f"link{pair[0]}>{pair[1]}", kind, c, m, t0, t))
                (self.act if kind == "SF" else self.grad)[c][m] = t
                link_free[pair] = True
                start_link(pair, t)
                try_start(pair[1], t)
        stuck = [r for r in range(S) if ptr[r] < len(orders[r])]
        if stuck:
            r = stuck[0]
            raise ValueError(f"the order deadlocks on rank {r} at {orders[r][ptr[r]]}")

    def send(self, queues: dict, pair: tuple[int, int], item: tuple, t: float) -> None:
        """Queue a transfer on link ``pair`` (or deliver at once within one rank)."""
        kind, c, m, _ = item
        if pair[0] == pair[1]:
            (self.act if kind == "SF" else self.grad)[c][m] = t
            return
        queues.setdefault(pair, deque()).append(item)


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
