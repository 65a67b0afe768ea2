"""The ``direct`` transport: one round of one pipeline stage, peer to peer (no Flower).

For one round the stage nodes join a ``torch.distributed`` process group through a
TCPStore the server hosts (only planned ranks: each presents its ticket) and run a
``torch.distributed.pipelining`` schedule over ``M`` micro-batches per step; rank 0,
the data owner, feeds stage 0 and sends each batch's labels to the last stage. A stage
that fails or stalls ends the round for all stages within the group's timeout, raised
as :class:`DirectStageError` naming the stage.

This module is the transport's public face; the parts live in

* :mod:`sky_flower.pipeline.rendezvous`: :class:`Rendezvous`, :class:`RoundHost`,
  :func:`join`, the errors (tickets, timeouts);
* :mod:`sky_flower.pipeline.emulated`: :class:`Emulated`, :class:`EmulatedStage`;
* :mod:`sky_flower.pipeline.engine`: :func:`run_stage` (the schedules, the loss
  scaling, the labels' transfer), :class:`StageResult`;
* :mod:`sky_flower.pipeline.local`: :func:`run_local` (stages in local processes,
  without Flower: the transport benchmark's case (b)), :func:`stage_input_shapes`.
"""

from __future__ import annotations

from sky_flower.pipeline.emulated import Emulated, EmulatedStage
from sky_flower.pipeline.engine import LABEL_TAG, SCHEDULES, StageResult, run_stage
from sky_flower.pipeline.local import run_local, stage_input_shapes
from sky_flower.pipeline.rendezvous import (
    PEER_FAILURE,
    TICKETS,
    DirectStageError,
    RankRefusedError,
    Rendezvous,
    RoundHost,
    join,
)

__all__ = [
    "LABEL_TAG",
    "PEER_FAILURE",
    "SCHEDULES",
    "TICKETS",
    "DirectStageError",
    "Emulated",
    "EmulatedStage",
    "RankRefusedError",
    "Rendezvous",
    "RoundHost",
    "StageResult",
    "join",
    "run_local",
    "run_stage",
    "stage_input_shapes",
]
