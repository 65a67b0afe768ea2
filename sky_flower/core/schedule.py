"""How a split-training step runs: :class:`Schedule` and the plan's per-stage terms.

:class:`Schedule` holds the batch, the micro-batches, the schedule kind (``sequential``,
GPipe: Huang et al. 2019, arXiv 1811.06965; ``1f1b``: PipeDream-Flush, Narayanan et al.
2021, arXiv 2006.09503; on ``direct`` also ``interleaved`` 1F1B, arXiv 2104.04473, and
``zero_bubble``, ZB1P of arXiv 2401.10241, with ``chunks`` model chunks per stage, see
:mod:`sky_flower.core.virtual`; or ``auto``: the planner picks the direct kind with the
least predicted step, :func:`choose_schedule`) and the transport (``relay`` through the
Flower server, or ``direct`` peer to peer). :class:`StageTerms` are the times the cost
model (:mod:`sky_flower.core.cost`) derives for a plan; :func:`predict` plays a plan's
step on the direct transport for any of its kinds (step time, bubble share, memory).
Pure: no Flower, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from sky_flower.core.virtual import (
    VIRTUAL_KINDS,
    Action,
    rank_orders,
    simulate_chunks,
    split_chunks,
)

LABEL_BYTES_PER_SAMPLE = 8  # int64 class index
# allocation=optimal's MILP time limit (HiGHS), by default: the one place it is written
# (SkySettings.allocation.time_limit_s, and through it the Hydra job's, the planners'
# defaults)
MILP_TIME_LIMIT_S = 30.0

ScheduleKind = Literal["sequential", "gpipe", "1f1b", "interleaved", "zero_bubble", "auto"]
Transport = Literal["relay", "direct", "stream"]
SCHEDULE_KINDS = ("sequential", "gpipe", "1f1b", *VIRTUAL_KINDS, "auto")
DIRECT_KINDS = ("gpipe", "1f1b", *VIRTUAL_KINDS)  # what ``auto`` chooses from
TRANSPORTS = ("relay", "direct", "stream")

Stage = tuple[int, int, int]  # (node index, first layer, last layer)


@dataclass(frozen=True)
class Schedule:
    """How a step runs.

    Attributes
    ----------
    batch_size : int
        Samples per training step (B).
    microbatches : int
        Micro-batches per step (M); must divide ``batch_size``. 1 = whole batch.
    kind : {"sequential", "gpipe", "1f1b", "interleaved", "zero_bubble", "auto"}
        Execution order of the micro-batches (see module docstring).
    transport : {"relay", "direct"}
        ``relay``: every hop is a Flower message through the server; ``direct``: peer to
        peer.
    microbatches_per_message : int
        ``relay`` with ``gpipe``/``1f1b`` only: micro-batches carried by one Flower
        message (``c``; the step then has ``G = M / c`` message groups). Each message
        pays Flower's per-message latency and ``context.state`` shipping once, so a
        larger ``c`` saves messages and a smaller one overlaps more stages.
        0 (default): the cost model picks the divisor of ``M`` with the least
        predicted step time (:meth:`CostModel.relay_group_size`).
    chunks : int
        ``interleaved`` / ``zero_bubble`` (and ``auto``'s candidates): model chunks per
        stage ``v >= 1`` (:func:`sky_flower.core.virtual.split_chunks`).
    """

    batch_size: int = 64
    microbatches: int = 1
    kind: ScheduleKind = "sequential"
    transport: Transport = "relay"
    microbatches_per_message: int = 0
    chunks: int = 2

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.microbatches < 1:
            raise ValueError(
                f"batch_size ({self.batch_size}) and microbatches ({self.microbatches}) "
                "must be >= 1"
            )
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"schedule.microbatches={self.microbatches} must divide "
                f"batch_size={self.batch_size}: pick a divisor"
            )
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(
                f"unknown schedule kind {self.kind!r}: use one of {', '.join(SCHEDULE_KINDS)}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"unknown transport {self.transport!r}: use one of {', '.join(TRANSPORTS)}"
            )
        if self.kind in (*VIRTUAL_KINDS, "auto") and self.transport != "direct":
            raise ValueError(
                f"schedule.kind={self.kind} runs on transport=direct only "
                "(torch.distributed.pipelining): set schedule.transport=direct"
            )
        if self.chunks < 1:
            raise ValueError(f"schedule.chunks must be >= 1, got {self.chunks}")
        c = self.microbatches_per_message
        if c < 0 or (c > 0 and self.microbatches % c):
            raise ValueError(
                f"schedule.microbatches_per_message={c} must be 0 (chosen by the cost "
                f"model) or a divisor of schedule.microbatches={self.microbatches}"
            )

    @property
    def microbatch_size(self) -> int:
        """Samples per micro-batch (B / M)."""
        return self.batch_size // self.microbatches

    @property
    def search_kind(self) -> str:
        """The kind the partitioners search with: ``1f1b`` for the chunked kinds (one
        chunk per stage), ``gpipe`` for ``auto`` (its memory, all ``M`` micro-batches
        stashed, bounds every kind's); the kind itself otherwise. The plan found is then
        predicted with the real kind (:func:`predict`)."""
        if self.kind in VIRTUAL_KINDS:
            return "1f1b"
        return "gpipe" if self.kind == "auto" else self.kind

    def for_search(self) -> Schedule:
        """This schedule with :attr:`search_kind` (what the partitioners get)."""
        return replace(self, kind=self.search_kind)  # type: ignore[arg-type]


@dataclass(frozen=True)
class StageTerms:
    """Per-stage and per-link times of a plan (seconds; arrays in pipeline order).

    ``fwd``, ``bwd``: shape (S,), per micro-batch. ``link``: shape (S - 1,), one way, per
    micro-batch (the same forward and back). ``overhead``: shape (S,), per step.
    ``relay`` only (else None): ``message``, shape (S,), what one Flower message costs
    stage ``k`` besides compute and payload (measured latency + ``context.state``
    shipping of its weights and optimizer state); ``node_link``, shape (S,), the payload
    seconds stage ``k``'s node spends per micro-batch and direction (bytes in + bytes out
    over its own bandwidth); ``grad_state``, shape (S,), the extra state shipping per
    message while a pipelined step accumulates gradients (``state_s_per_byte x``
    parameter bytes).
    """

    fwd: np.ndarray
    bwd: np.ndarray
    link: np.ndarray
    overhead: np.ndarray
    message: np.ndarray | None = None
    node_link: np.ndarray | None = None
    grad_state: np.ndarray | None = None


@dataclass(frozen=True)
class SchedulePrediction:
    """What :func:`predict` gives for one schedule of a plan (direct transport).

    Attributes
    ----------
    kind : str
        ``gpipe``, ``1f1b``, ``interleaved`` or ``zero_bubble``.
    chunks : int
        Chunks per rank (1 for GPipe / 1F1B).
    step_time_s : float
        Predicted seconds per step (:func:`simulate_chunks`).
    bubble_share : float
        ``1 - sum of rank compute / (S x step)``: the ranks' idle share of the step.
    memory_bytes : list of float
        Per rank: parameters, gradients and optimizer state of its chunks plus the
        simulated peak of stashed activations.
    chunk_layers : list of (node, first, last)
        The chunks (``S v`` of them; the stages for ``v = 1``).
    """

    kind: str
    chunks: int
    step_time_s: float
    bubble_share: float
    memory_bytes: list[float]
    chunk_layers: list[tuple[int, int, int]]


def orders_for(kind: str, stages: int, chunks: int, microbatches: int) -> list[list[Action]]:
    """Per-rank :class:`~sky_flower.core.virtual.Action` lists of any schedule kind:
    ``sequential`` / GPipe / 1F1B from :func:`sky_flower.core.simulate.stage_order` (one
    chunk per rank), the others from :func:`rank_orders`."""
    if kind in VIRTUAL_KINDS:
        return rank_orders(kind, stages, chunks, microbatches)
    from sky_flower.core.simulate import stage_order

    return stage_order(kind, stages, microbatches)


def predict(
    cost: Any,  # noqa: ANN401 - a CostModel (which imports this module)
    stages: Sequence[Stage],
    kind: str,
    chunks: int = 1,
) -> SchedulePrediction:
    """Step time, bubble share and per-rank memory of ``stages`` under ``kind``.

    Parameters
    ----------
    cost : CostModel
        Its per-layer times and memory (:mod:`sky_flower.core.cost`; direct transport).
    stages : sequence of (node, first, last)
        The plan.
    kind : {"gpipe", "1f1b", "interleaved", "zero_bubble"}
    chunks : int
        ``v`` for the virtual kinds (ignored, 1, for GPipe / 1F1B).

    Raises
    ------
    ValueError
        As :func:`check_virtual` and :func:`split_chunks`.
    """
    S, M = len(stages), cost.schedule.microbatches
    v = chunks if kind in VIRTUAL_KINDS else 1
    parts = split_chunks(stages, v)
    C = len(parts)
    fwd = [cost.stage_fwd(i, a, b) for i, a, b in parts]
    bwd = [cost.stage_bwd(i, a, b, c == C - 1) for c, (i, a, b) in enumerate(parts)]
    link = [
        0.0
        if parts[c][0] == parts[c + 1][0]
        else cost.link_time(parts[c][0], parts[c + 1][0], parts[c][2])
        for c in range(C - 1)
    ]
    mb = cost.schedule.microbatch_size
    stash = [mb * float(cost.stash_prefix[b + 1] - cost.stash_prefix[a]) for _, a, b in parts]
    sim = simulate_chunks(orders_for(kind, S, v, M), fwd, bwd, link, link, M, stash=stash)
    static = [0.0] * S
    for c, (_, a, b) in enumerate(parts):
        static[c % S] += float(cost.static_prefix[b + 1] - cost.static_prefix[a])
    work = M * (sum(fwd) + sum(bwd))
    step = sim.step_time_s
    bubble = 1.0 - work / (S * step) if step > 0 else 0.0
    memory = [static[r] + sim.peak_stash[r] for r in range(S)]
    return SchedulePrediction(kind, v, step, bubble, memory, parts)


def choose_schedule(
    cost: Any,  # noqa: ANN401 - a CostModel
    stages: Sequence[Stage],
    kinds: Sequence[str] = DIRECT_KINDS,
    chunks: int = 2,
) -> tuple[SchedulePrediction, dict[str, float | None]]:
    """The schedule with the least predicted step for a plan (``schedule.kind=auto``).

    Every kind in ``kinds`` is predicted (:func:`predict`); a kind that cannot run (too
    few layers for ``chunks``, micro-batches torch refuses, 1F1B with ``M < S``) or
    whose memory exceeds a node's capacity is skipped (``None`` in the table).

    Parameters
    ----------
    cost : CostModel
        Of the direct transport.
    stages : sequence of (node, first, last)
        The plan.
    kinds : sequence of str
        Candidates (default :data:`DIRECT_KINDS`).
    chunks : int
        ``v`` for the chunked kinds.

    Returns
    -------
    (SchedulePrediction, dict)
        The best kind's prediction (ties: the earlier in ``kinds``) and every kind's
        predicted step time (seconds, or None).

    Raises
    ------
    ValueError
        If no kind can run.
    """
    S, M = len(stages), cost.schedule.microbatches
    table: dict[str, float | None] = {}
    best: SchedulePrediction | None = None
    for kind in kinds:
        try:
            if kind == "1f1b" and M < S:
                raise ValueError("1f1b needs M >= S")
            p = predict(cost, stages, kind, chunks)
        except ValueError:
            table[kind] = None
            continue
        nodes = [stages[r][0] for r in range(S)]
        if any(m > cost.capacity[n] for m, n in zip(p.memory_bytes, nodes, strict=True)):
            table[kind] = None
            continue
        table[kind] = p.step_time_s
        if best is None or p.step_time_s < best.step_time_s:
            best = p
    if best is None:
        raise ValueError(f"no schedule of {', '.join(kinds)} runs this plan")
    return best, table


def predict_plan(cost: Any, stages: Sequence[Stage]) -> SchedulePrediction:  # noqa: ANN401
    """:func:`predict` for ``cost.schedule``'s own kind and chunks (``auto``: the best of
    :func:`choose_schedule`)."""
    sched = cost.schedule
    if sched.kind == "auto":
        return choose_schedule(cost, stages, chunks=sched.chunks)[0]
    return predict(cost, stages, sched.kind, sched.chunks)
