"""How a split-training step runs: :class:`Schedule` and the plan's per-stage terms.

:class:`Schedule` holds the batch, the micro-batches, the schedule kind (``sequential``,
GPipe: Huang et al. 2019, arXiv 1811.06965; ``1f1b``: PipeDream-Flush, Narayanan et al.
2021, arXiv 2006.09503) and the transport (``relay`` through the Flower server, or
``direct`` peer to peer). :class:`StageTerms` are the times the cost model
(:mod:`sky_flower.core.cost`) derives for a plan. Pure: no Flower, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

LABEL_BYTES_PER_SAMPLE = 8  # int64 class index

ScheduleKind = Literal["sequential", "gpipe", "1f1b"]
Transport = Literal["relay", "direct"]
SCHEDULE_KINDS = ("sequential", "gpipe", "1f1b")
TRANSPORTS = ("relay", "direct")

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
    kind : {"sequential", "gpipe", "1f1b"}
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
    """

    batch_size: int = 64
    microbatches: int = 1
    kind: ScheduleKind = "sequential"
    transport: Transport = "relay"
    microbatches_per_message: int = 0

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
            raise ValueError(f"unknown transport {self.transport!r}: use relay or direct")
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
