"""The stage engine of the ``direct`` transport: one round of one pipeline stage.

Rank ``k`` runs stage ``k`` of a ``torch.distributed.pipelining`` schedule (GPipe, Huang
et al. 2019, arXiv 1811.06965; or 1F1B / PipeDream-Flush, Narayanan et al. 2021, arXiv
2006.09503) over ``M`` micro-batches per step; or, with ``v`` model chunks per rank
(:class:`Chunk`; chunk ``c`` of ``C = S v`` on rank ``c mod S``), interleaved 1F1B
(``ScheduleInterleaved1F1B``, arXiv 2104.04473) or zero bubble
(``ScheduleInterleavedZeroBubble``, ZB1P of arXiv 2401.10241, whose backward is split
into input and weight gradients). Each chunk runs its forwards in micro-batch order in
every schedule, so the keyed randomness and BatchNorm buffers are as on one stage. Rank
0 is the data owner: it feeds stage 0 with its own batches and sends each batch's labels
to the last stage (``dist.isend``, tag :data:`LABEL_TAG`), where the schedule's loss
function uses them. The schedule's loss function is the user's loss scaled as the
objective's reduction declares (:class:`sky_flower.pipeline.objective.LossReduction`:
``1 / M`` for a mean, 1 for a sum, ``w_m / W`` for a weighted mean, ``W`` from the whole
step's labels), once, before its backward; the schedule does not scale the gradients
again (``scale_grads=False``), so a step computes the gradient of the user's loss on the
whole batch, as the unsplit model does, whatever its reduction. Every
stage steps its own optimizer once per step (a stage without parameters has none). The
schedule runs each micro-batch's forward once, with its graph, in micro-batch order, so
buffers (BatchNorm) update as the whole model's do; each layer's randomness is keyed by
``(seed, round, step, micro-batch, layer)`` as on every path
(:func:`sky_flower.pipeline.stage.forward_layers`); the static-shape probe has no side
effects (:func:`sky_flower.pipeline.stage.probe_forward`). :func:`run_stage` always
destroys its process group, so a long-lived process can join the next round's group,
unless it runs in a group joined before and left joined (``joined``: a direct stage
session's rounds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from sky_flower.core.example import example_input
from sky_flower.pipeline.emulated import (
    Emulated,
    EmulatedOptimizer,
    EmulatedStage,
    emulate_weight_pass,
)
from sky_flower.pipeline.objective import LossReduction, correct_count
from sky_flower.pipeline.rendezvous import (
    _PEER_SIGNS,
    PEER_FAILURE,
    DirectStageError,
    Rendezvous,
    _first_line,
    join,
)
from sky_flower.pipeline.stage import RngKey, probe_forward

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_CHUNK = ("interleaved", "zero_bubble")  # schedules over a list of chunks per rank
LABEL_TAG = 7


@dataclass(frozen=True)
class Chunk:
    """One model chunk (virtual stage) of a rank.

    Attributes
    ----------
    index : int
        Global chunk index ``c``, ``0 <= c < C``; it runs on rank ``c mod S``.
    module : nn.Module
        The chunk's layers (trained in place).
    input_shape : tuple of int
        Shape of one sample of its input (no batch dimension).
    input_dtype : torch.dtype or str, optional
        Its input's dtype (default float32).
    """

    index: int
    module: nn.Module
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype | str | None = None


@dataclass
class StageResult:
    """What one stage measured in one ``direct`` round.

    Attributes
    ----------
    setup_s : float
        Joining the process group (rendezvous, ticket check), seconds.
    step_times_s : list of float
        Wall time of each step (schedule + optimizer), seconds.
    compute_s : float
        Measured forward + backward compute of the stage module (emulation sleeps
        excluded), seconds.
    losses : list of float
        Last stage only: each step's batch loss (the user's loss of the whole batch:
        the sum of the micro-batches' scaled losses).
    correct : int
        Last stage only: correct predictions over the round.
    samples : int
        Last stage only: samples seen.
    """

    setup_s: float = 0.0
    step_times_s: list[float] = field(default_factory=list)
    compute_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    correct: int = 0
    samples: int = 0


def run_stage(  # noqa: PLR0913
    rdv: Rendezvous,
    module: nn.Module | Sequence[Chunk],
    optimizer: torch.optim.Optimizer | None,
    kind: str,
    microbatches: int,
    steps: int,
    batch_size: int,
    input_shape: Sequence[int],
    batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    emulated: Emulated | None = None,
    fault: Callable[[int], None] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    metric_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    rng: RngKey | None = None,
    input_dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    reduction: LossReduction | None = None,
    joined: bool = False,
) -> StageResult:
    """Run one round (``steps`` steps) of stage ``rdv.rank`` of a pipeline, peer to peer.

    Parameters
    ----------
    rdv : Rendezvous
        The round's rendezvous for this stage.
    module : nn.Module or sequence of Chunk
        The stage's layers (trained in place), or the rank's chunks (``v`` of the
        ``S v``; ``input_shape`` and ``input_dtype`` are then each chunk's own).
    optimizer : torch.optim.Optimizer or None
        Over ``module``'s (every chunk's) parameters; stepped once per step. None for a
        stage without trainable parameters.
    kind : {"gpipe", "1f1b", "interleaved", "zero_bubble"}
        The ``torch.distributed.pipelining`` schedule (:data:`SCHEDULES`; the last two
        take any number of chunks per rank, the first two one).
    microbatches : int
        ``M``; must divide the batch.
    steps : int
        Steps in the round.
    batch_size : int
        ``B``, samples per step (the last stage receives the ``(B, ...)`` labels, their
        dtype and shape sent with them: :func:`send_labels`).
    input_shape : sequence of int
        Shape of one sample of this stage's input (without the batch dimension). The
        stage is built with static shapes: ``torch.distributed.pipelining``'s runtime
        shape inference deadlocks on gloo in torch 2.13 (the last stage sends its
        backward metadata while stage 0 waits for its first activation send).
    batch_fn : callable, rank 0 only
        ``step -> (x (B, ...), labels (B, ...))``: the data owner's batch (``x`` of
        ``input_dtype``).
    emulated : Emulated, optional
        Fleet emulation (slowdown, link delay) of this stage.
    fault : callable, optional
        Called with the step index before each step (fault injection for tests).
    loss_fn : callable, optional
        ``(output, labels) -> scalar`` loss of a micro-batch, reduced as ``reduction``
        declares (last stage; default cross-entropy, a mean).
    metric_fn : callable, optional
        ``(output (B, ...), labels (B,)) -> int`` of a step (last stage; default correct
        predictions, :func:`sky_flower.pipeline.objective.correct_count`).
    rng : RngKey, optional
        The run's seed and the round (its ``step`` is ignored: each step sets its own)
        of the layers' keyed random stream; default seed 0, round 0.
    input_dtype : torch.dtype or str, optional
        Dtype of this stage's input (default float32; int64 for the token ids entering
        a language model's first stage).
    device : torch.device or str
        Where the stage computes (its modules must be there already). With
        ``rdv.backend == "gloo"`` the peers exchange CPU tensors: a GPU stage's
        activations and gradients cross to and from the GPU at its edges
        (:class:`~sky_flower.pipeline.emulated.EmulatedStage`); with ``nccl`` they stay
        on the GPUs (labels included).
    reduction : LossReduction, optional
        How ``loss_fn`` reduces (default ``mean``): how the last stage scales each
        micro-batch's loss.
    joined : bool
        This process has already joined the round's group
        (:func:`~sky_flower.pipeline.rendezvous.join`) and stays in it: a direct stage
        session (:func:`sky_flower.sky.node.direct_node.run_direct_session`) runs every
        round of its group this way (``setup_s`` 0). Otherwise the stage joins the group
        first and always destroys it at the end.

    Returns
    -------
    StageResult

    Raises
    ------
    DirectStageError
        Naming the stage when it, or a peer it waits for, fails or stalls (after at
        most ``rdv.timeout_s``); :class:`RankRefusedError` for an unplanned rank. After
        it a joined group is unusable: leave it.
    ValueError
        On an unknown schedule kind, several chunks for GPipe / 1F1B or a missing
        ``batch_fn`` on rank 0.
    """
    if isinstance(module, nn.Module):  # the stage's layers: chunk ``rank`` of ``S``
        chunks = [Chunk(rdv.rank, module, tuple(input_shape), input_dtype)]
    else:
        chunks = list(module)
    _check(kind, rdv.rank, batch_fn, batch_size, microbatches, len(chunks))  # before joining
    S = rdv.world_size
    C = len(chunks) * S
    emulated = emulated or Emulated()
    device = torch.device(device)
    comm = device if rdv.backend == "nccl" else torch.device("cpu")  # where peers' tensors live
    wrapped = [
        EmulatedStage(
            ch.module,
            emulated,
            is_first=ch.index == 0,
            is_last=ch.index == C - 1,
            device=device,
            comm_device=comm,
        )
        for ch in chunks
    ]
    rng = rng or RngKey()
    result = StageResult()
    if not joined:
        t0 = time.perf_counter()
        join(rdv, device)
        result.setup_s = time.perf_counter() - t0
    try:
        stages = [
            _pipeline_stage(ch, w, C, batch_size // microbatches, device, comm)
            for ch, w in zip(chunks, wrapped, strict=True)
        ]
        for st, w in zip(stages, wrapped, strict=True) if kind == "zero_bubble" else ():
            emulate_weight_pass(st, emulated)
            w.plain_output = True
        step_loss = StepLoss(loss_fn or nn.functional.cross_entropy, reduction, microbatches)
        schedule = SCHEDULES[kind](
            stages if kind in MULTI_CHUNK else stages[0],
            n_microbatches=microbatches,
            loss_fn=step_loss,  # every rank: sets has_backward
            scale_grads=False,  # normalised once, in the loss, before its backward
        )
        for step in range(steps):
            if fault is not None:
                fault(step)
            t_step = time.perf_counter()
            for w in wrapped:
                w.start_step(RngKey(rng.seed, rng.round, step))
            opt = None if optimizer is None else EmulatedOptimizer(optimizer, emulated)
            _step(rdv, schedule, opt, batch_fn, step, result, metric_fn, comm, step_loss)
            result.step_times_s.append(time.perf_counter() - t_step)
    except DirectStageError:
        raise
    except Exception as err:  # noqa: BLE001 - named and re-raised
        raise _stage_error(rdv, err) from err
    finally:
        result.compute_s = emulated.compute_s
        if not joined and dist.is_initialized():  # a crashed stage may already have left
            dist.destroy_process_group()
    return result


class StepLoss:
    """The schedule's loss function: ``(output, target) ->`` the micro-batch's share of
    the batch's loss (:meth:`LossReduction.micro_loss`). Set :attr:`total` to the
    whole step's label weight (``weighted``) before each step.

    Parameters
    ----------
    loss_fn : callable
        The user's ``(output, labels) -> scalar``.
    reduction : LossReduction or None
        How it reduces (None: ``mean``).
    microbatches : int
        ``M``.
    """

    def __init__(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        reduction: LossReduction | None,
        microbatches: int,
    ) -> None:
        self.loss_fn, self.microbatches = loss_fn, microbatches
        self.reduction = reduction or LossReduction()
        self.total: float | None = None

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.reduction.micro_loss(
            self.loss_fn, output, target, self.microbatches, self.total
        )


def _pipeline_stage(  # noqa: PLR0913
    chunk: Chunk,
    wrapped: nn.Module,
    C: int,
    mb_size: int,
    device: torch.device,
    comm: torch.device,
) -> PipelineStage:
    """``torch.distributed.pipelining`` stage ``chunk.index`` of ``C`` whose peer
    tensors live on ``comm``, static shapes from a side-effect-free probe of the chunk
    on ``device`` (in the group: a failure ends it for all)."""
    example = example_input(mb_size, chunk.input_shape, chunk.input_dtype)
    example_out = probe_forward(chunk.module, example.to(device)).to(comm)
    example = example.to(comm)
    # static shapes: requires_grad decides what is sent back
    example.requires_grad_(chunk.index > 0 and example.is_floating_point())
    return PipelineStage(
        wrapped,
        chunk.index,
        C,
        comm,
        input_args=example,
        output_args=example_out.requires_grad_(True),
    )


def _check(  # noqa: PLR0913
    kind: str,
    rank: int,
    batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None,
    batch_size: int,
    microbatches: int,
    chunks: int = 1,
) -> None:
    """Raise ValueError on an unknown schedule, several chunks per rank for GPipe /
    1F1B, rank 0 without batches, or a batch that the micro-batches do not divide."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    if chunks != 1 and kind not in MULTI_CHUNK:
        raise ValueError(
            f"schedule {kind!r} runs one chunk per rank, got {chunks}: use one of "
            f"{', '.join(MULTI_CHUNK)} for several"
        )
    if rank == 0 and batch_fn is None:
        raise ValueError("rank 0 (the data owner) needs batch_fn")
    if batch_size % microbatches:
        raise ValueError(
            f"batch of {batch_size} is not divisible into {microbatches} micro-batches"
        )


def _stage_error(rdv: Rendezvous, err: Exception) -> DirectStageError:
    """``err`` as the stage's error: a peer's failure or stall, or this stage's own."""
    rank, S = rdv.rank, rdv.world_size
    text = _first_line(err)
    if any(sign in text for sign in _PEER_SIGNS):
        return DirectStageError(
            f"stage {rank} of {S}: {PEER_FAILURE} (timeout {rdv.timeout_s:g} s): {text}"
        )
    return DirectStageError(f"stage {rank} of {S}: {type(err).__name__}: {text}")


def _step(  # noqa: PLR0913
    rdv: Rendezvous,
    schedule: Any,
    optimizer: torch.optim.Optimizer | EmulatedOptimizer | None,
    batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None,
    step: int,
    result: StageResult,
    metric_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None,
    comm: torch.device,
    step_loss: StepLoss,
) -> None:
    """One step of the schedule on this stage: labels to the last stage, the pipelined
    forward and backward, the optimizer; the last stage records loss and accuracy.
    The batch and labels enter on ``comm`` (the device peer tensors live on)."""
    rank, S = rdv.rank, rdv.world_size
    is_last = rank == S - 1
    label_work = None
    x = labels = None
    if rank == 0:
        x, labels = batch_fn(step)  # type: ignore[misc]
        x, labels = x.to(comm), labels.to(comm)
        if S > 1:
            label_work = send_labels(labels, S - 1)
    if is_last and S > 1:
        labels = recv_labels(0, comm)
    if is_last:
        step_loss.total = step_loss.reduction.total(labels)
    losses: list[torch.Tensor] = []
    if rank == 0:
        out = schedule.step(x, target=labels if is_last else None, losses=losses)
    else:
        out = schedule.step(target=labels if is_last else None, losses=losses)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for work in label_work or []:
        work.wait()
    if is_last:
        result.losses.append(float(sum(float(v.detach()) for v in losses)))
        result.correct += int((metric_fn or correct_count)(out.detach(), labels))
        result.samples += int(labels.numel())  # labels counted: tokens for an LM


LABEL_DTYPES = (torch.int64, torch.int32, torch.float32, torch.float64, torch.bool)
_HEADER = 8  # dtype code, ndim, up to 6 dimensions


def send_labels(labels: torch.Tensor, dst: int) -> list:
    """Send a step's labels (any shape of up to 6 dimensions, a dtype of
    :data:`LABEL_DTYPES`) to rank ``dst``: a header (dtype, shape), then the labels.
    Returns the two pending sends (wait on each).

    Raises
    ------
    ValueError
        On a dtype outside :data:`LABEL_DTYPES` or more than 6 dimensions.
    """
    if labels.dtype not in LABEL_DTYPES or labels.dim() > _HEADER - 2:
        raise ValueError(
            f"labels of dtype {labels.dtype} and shape {tuple(labels.shape)} cannot travel: "
            f"use one of {LABEL_DTYPES} with at most {_HEADER - 2} dimensions"
        )
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = LABEL_DTYPES.index(labels.dtype), labels.dim()
    header[2 : 2 + labels.dim()] = torch.tensor(labels.shape, dtype=torch.int64)
    header = header.to(labels.device)  # NCCL sends from the GPU
    return [
        dist.isend(header, dst=dst, tag=LABEL_TAG + 1),
        dist.isend(labels.contiguous(), dst=dst, tag=LABEL_TAG),
    ]


def recv_labels(src: int, device: torch.device | None = None) -> torch.Tensor:
    """Receive labels sent by :func:`send_labels` from rank ``src``, on ``device``
    (where the group's tensors live: the CPU for gloo, this rank's GPU for NCCL)."""
    device = device or torch.device("cpu")
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=src, tag=LABEL_TAG + 1)
    ndim = int(header[1])
    shape = [int(d) for d in header[2 : 2 + ndim]]
    labels = torch.empty(shape, dtype=LABEL_DTYPES[int(header[0])], device=device)
    dist.recv(labels, src=src, tag=LABEL_TAG)
    return labels
