"""The ``direct`` transport: one round of one pipeline stage, peer to peer (no Flower).

For one round the stage nodes join a ``torch.distributed`` process group (gloo on CPU)
through a TCPStore the server hosts, and run a ``torch.distributed.pipelining`` schedule
(GPipe, Huang et al. 2019, arXiv 1811.06965; or 1F1B / PipeDream-Flush, Narayanan et al.
2021, arXiv 2006.09503) over ``M`` micro-batches per step. Rank ``k`` runs stage ``k``;
rank 0 is the data owner: it feeds stage 0 with its own batches and sends each batch's
labels to the last stage (``dist.isend``, tag :data:`LABEL_TAG`), where the schedule's
loss function uses them. Each micro-batch's loss is scaled once, before its backward,
as the objective's reduction declares (:class:`sky_flower.pipeline.objective.
LossReduction`; the schedule's ``scale_grads`` is off), so a step computes the gradient
of the user's loss on the whole batch, as the unsplit model does.
Every stage steps its own optimizer once per step.

Only planned ranks can join: the server writes one random ticket per rank into the
round's store (under the round's fresh prefix key); a stage that presents another
ticket is refused (:class:`RankRefusedError`) before it joins the group.

A stage that fails or stalls ends the round for all stages within a bounded time: every
collective and point-to-point operation carries the process group's timeout
(``timeout_s``), a peer whose process dies closes its sockets (the others' pending
operations fail at once), and :func:`run_stage` always destroys its process group, so
a long-lived process (a Ray actor in Flower's simulation engine) can join the next
round's group. Errors are raised as :class:`DirectStageError` naming the stage.

This module is the transport's public face; the parts live in

* :mod:`sky_flower.pipeline.rendezvous`: :class:`Rendezvous`, :class:`RoundHost`,
  :func:`join`, the errors;
* :mod:`sky_flower.pipeline.emulated`: :class:`Emulated`, :class:`EmulatedStage`;
* :mod:`sky_flower.pipeline.engine`: :func:`run_stage`, :class:`StageResult`;
* :mod:`sky_flower.pipeline.local`: :func:`run_local` (stages in local processes,
  without Flower: the transport benchmark's case (b)), :func:`stage_input_shapes`.
"""

from __future__ import annotations

from sky_flower.pipeline.emulated import Emulated, EmulatedStage
from sky_flower.pipeline.engine import LABEL_TAG, SCHEDULES, StageResult, run_stage
from sky_flower.pipeline.local import build_model_cfg, run_local, stage_input_shapes
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
    "build_model_cfg",
    "join",
    "run_local",
    "run_stage",
    "stage_input_shapes",
]
