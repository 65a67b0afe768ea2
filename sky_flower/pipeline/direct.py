"""The ``direct`` transport: one round of one pipeline stage, peer to peer (no Flower).

For one round the stage nodes join a ``torch.distributed`` process group (gloo on CPU)
through a TCPStore the server hosts, and run a ``torch.distributed.pipelining`` schedule
(GPipe, Huang et al. 2019, arXiv 1811.06965; or 1F1B / PipeDream-Flush, Narayanan et al.
2021, arXiv 2006.09503) over ``M`` micro-batches per step. Rank ``k`` runs stage ``k``;
rank 0 is the data owner: it feeds stage 0 with its own batches and sends each batch's
labels to the last stage (``dist.isend``, tag :data:`LABEL_TAG`), where the schedule's
loss function uses them. The loss is the mean cross-entropy per micro-batch and the
schedule divides the accumulated gradients by ``M`` (``scale_grads=True``), so a step
computes exactly the gradient of the whole batch's mean loss, as the unsplit model does.
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

This module is also the engine of the transport benchmark's case (b): stages in local
processes, without Flower (:func:`spawn_local`).
"""

from __future__ import annotations

import datetime
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from sky_flower.pipeline.objective import correct_count

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
LABEL_TAG = 7
TICKETS = "sky.tickets"
PEER_FAILURE = "stopped: a peer stage failed or stalled"
# gloo's errors when a peer is gone or silent (torch 2.13)
_PEER_SIGNS = ("Timed out", "Connection closed by peer", "Connection reset", "Broken pipe")


class DirectStageError(RuntimeError):
    """A stage of a ``direct`` round failed (the message names the stage and why)."""


class RankRefusedError(DirectStageError):
    """A node asked to join a round's process group with a rank it was not planned for."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a stage joins one round's process group.

    Attributes
    ----------
    host : str
        TCPStore host (the server's address, reachable from every stage node).
    port : int
        TCPStore port.
    key : str
        Fresh random prefix for this round's keys (only the planned stages get it).
    rank : int
        This stage's rank = its stage index, ``0 <= rank < world_size``.
    world_size : int
        Number of stages ``S``.
    ticket : str
        This rank's ticket, checked against the store before joining.
    timeout_s : float
        Bound (seconds) on every peer operation of the round (a stage that fails or
        stalls mid-round ends the round for all within about this time).
    join_timeout_s : float (default: 60.0)
        Bound (seconds) on joining: reaching the store and waiting for every stage to
        join. At least ``timeout_s``; larger, since the stages' messages may start some
        seconds apart (a busy Flower simulation engine, a SuperNode's polling tick).
    """

    host: str
    port: int
    key: str
    rank: int
    world_size: int
    ticket: str
    timeout_s: float
    join_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size} stages")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class RoundHost:
    """Server side of a round's rendezvous: a TCPStore with one ticket per rank.

    Parameters
    ----------
    host : str (default: "127.0.0.1")
        Address to listen on; the stages connect to it.
    world_size : int
        Number of stages.
    timeout_s : float
        Bound on every peer operation of the round, seconds.
    join_timeout_s : float (default: 60.0)
        Bound on joining the round, seconds (see :class:`Rendezvous`).

    Use as a context manager; the store stops when it exits.
    """

    def __init__(
        self,
        world_size: int,
        timeout_s: float,
        host: str = "127.0.0.1",
        join_timeout_s: float = 60.0,
    ) -> None:
        self.host, self.world_size, self.timeout_s = host, world_size, timeout_s
        self.join_timeout_s = max(join_timeout_s, timeout_s)
        self.key = f"sky-{secrets.token_hex(8)}"
        self.tickets = [secrets.token_hex(8) for _ in range(world_size)]
        self.store = dist.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.join_timeout_s),
        )
        self.port = int(self.store.port)
        prefixed = dist.PrefixStore(f"{self.key}/{TICKETS}", self.store)
        for rank, ticket in enumerate(self.tickets):
            prefixed.set(str(rank), ticket)

    def rendezvous(self, rank: int) -> Rendezvous:
        """The rendezvous of stage ``rank`` (goes into that stage's message only)."""
        return Rendezvous(
            self.host,
            self.port,
            self.key,
            rank,
            self.world_size,
            self.tickets[rank],
            self.timeout_s,
            self.join_timeout_s,
        )

    def close(self) -> None:
        """Stop the store."""
        del self.store

    def __enter__(self) -> RoundHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Emulated:
    """What the fleet's emulation does inside a ``direct`` stage.

    Attributes
    ----------
    slowdown : float
        Sleep ``slowdown x`` each forward's and each backward's measured compute time of
        the stage module, per micro-batch (SkyComputing's emulation).
    send_next_s : Callable[[int], float]
        Seconds of link delay to send ``bytes`` to the next stage (activations).
    send_prev_s : Callable[[int], float]
        Seconds of link delay to send ``bytes`` to the previous stage (gradients).

    The link delay is slept by the sender right after it computes the tensor, before the
    schedule sends it: it blocks the sending stage (a real NIC would overlap it with the
    next micro-batch's compute), so it is an upper bound on the link's effect.
    """

    slowdown: float = 0.0
    send_next_s: Callable[[int], float] = lambda nbytes: 0.0
    send_prev_s: Callable[[int], float] = lambda nbytes: 0.0
    compute_s: float = field(default=0.0, init=False)


class _BackwardEnd(torch.autograd.Function):
    """Identity whose backward ends the stage's backward timing (input side)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list) -> torch.Tensor:  # noqa: D102
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        wrapper = ctx.box[0]
        wrapper._end_backward(g)
        return g, None


class _BackwardStart(torch.autograd.Function):
    """Identity whose backward starts the stage's backward timing (output side)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list) -> torch.Tensor:  # noqa: D102
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        ctx.box[0]._t_backward = time.perf_counter()
        return g, None


class EmulatedStage(nn.Module):
    """A stage module with the fleet's emulation around it (numerically the identity).

    Forward: run ``inner``, sleep ``slowdown x`` its time, then the link delay to send
    the output to the next stage (not on the last stage). Backward: from the output's
    gradient arriving to the input's gradient computed, then the same sleep, then the
    link delay to send the input gradient back (not on the first stage).

    Parameters
    ----------
    inner : nn.Module
        The stage's layers; ``(B/M, ...) -> (B/M, ...)``.
    emulated : Emulated
        What to emulate; ``emulated.compute_s`` accumulates the measured compute (s).
    is_first, is_last : bool
        Position of the stage in the pipeline.
    """

    def __init__(self, inner: nn.Module, emulated: Emulated, is_first: bool, is_last: bool):
        super().__init__()
        self.inner = inner
        self.emulated = emulated
        self.is_first, self.is_last = is_first, is_last
        self._t_backward = 0.0
        self._box = [self]

    def _end_backward(self, g: torch.Tensor) -> None:
        elapsed = time.perf_counter() - self._t_backward
        self.emulated.compute_s += elapsed
        if self.emulated.slowdown > 0:
            time.sleep(self.emulated.slowdown * elapsed)
        if not self.is_first:
            time.sleep(self.emulated.send_prev_s(g.numel() * g.element_size()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B/M, ...) -> (B/M, ...)``, as ``inner``."""
        if not x.requires_grad:  # stage 0: a leaf, so that the backward timing ends here
            x = x.detach().requires_grad_(torch.is_grad_enabled())
        if x.requires_grad:
            x = _BackwardEnd.apply(x, self._box)
        t0 = time.perf_counter()
        y = self.inner(x)
        elapsed = time.perf_counter() - t0
        self.emulated.compute_s += elapsed
        if self.emulated.slowdown > 0:
            time.sleep(self.emulated.slowdown * elapsed)
        if not self.is_last:
            time.sleep(self.emulated.send_next_s(y.numel() * y.element_size()))
        return _BackwardStart.apply(y, self._box) if y.requires_grad else y


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
        Last stage only: each step's batch loss (mean over the batch).
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


def _device(host: str):  # noqa: ANN202 - a ProcessGroupGloo.Device
    if host in ("127.0.0.1", "localhost"):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def join(rdv: Rendezvous) -> None:
    """Join the round's gloo process group as ``rdv.rank`` (bounded by
    ``rdv.join_timeout_s``; afterwards its operations by ``rdv.timeout_s``).

    Raises
    ------
    RankRefusedError
        If the store holds another ticket for this rank (not the planned node).
    DirectStageError
        If the store or the other stages cannot be reached in time.
    """
    if dist.is_initialized():  # a previous round that did not clean up (should not happen)
        dist.destroy_process_group()
    join_s = max(rdv.join_timeout_s, rdv.timeout_s)
    timeout = datetime.timedelta(seconds=join_s)
    try:
        base = dist.TCPStore(
            rdv.host, rdv.port, is_master=False, wait_for_workers=False, timeout=timeout
        )
        store = dist.PrefixStore(rdv.key, base)
        expected = dist.PrefixStore(TICKETS, store).get(str(rdv.rank)).decode()
    except (RuntimeError, OSError) as err:
        raise DirectStageError(
            f"stage {rdv.rank}: cannot reach the round's store at {rdv.host}:{rdv.port} "
            f"within {join_s:g} s: {err}"
        ) from err
    if not secrets.compare_digest(expected, rdv.ticket):
        raise RankRefusedError(
            f"rank {rdv.rank} refused: this node's ticket does not match the one planned for "
            "that rank (only the round's planned nodes may join)"
        )
    # Wait (up to the join timeout) until every planned stage has checked in; only then
    # build the group, whose timeout (gloo fixes it when it connects) is the shorter
    # round timeout that bounds every operation.
    op_timeout = datetime.timedelta(seconds=rdv.timeout_s)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = op_timeout
    opts._devices = [_device(rdv.host)]
    try:
        arrived = dist.PrefixStore("arrived", store)
        arrived.set(str(rdv.rank), "1")
        arrived.wait([str(r) for r in range(rdv.world_size)], timeout)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("pg", store),
            rank=rdv.rank,
            world_size=rdv.world_size,
            timeout=op_timeout,
            pg_options=opts,
        )
    except (RuntimeError, OSError) as err:
        raise DirectStageError(
            f"stage {rdv.rank} of {rdv.world_size}: {PEER_FAILURE} (the other stages did not "
            f"all join within {join_s:g} s): {_first_line(err)}"
        ) from err


def run_stage(  # noqa: PLR0913
    rdv: Rendezvous,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
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
) -> StageResult:
    """Run one round (``steps`` steps) of stage ``rdv.rank`` of a pipeline, peer to peer.

    Parameters
    ----------
    rdv : Rendezvous
        The round's rendezvous for this stage.
    module : nn.Module
        The stage's layers (trained in place).
    optimizer : torch.optim.Optimizer
        Over ``module``'s parameters; stepped once per step.
    kind : {"gpipe", "1f1b"}
        The ``torch.distributed.pipelining`` schedule.
    microbatches : int
        ``M``; must divide the batch.
    steps : int
        Steps in the round.
    batch_size : int
        ``B``, samples per step (the last stage receives ``(B,)`` labels).
    input_shape : sequence of int
        Shape of one sample of this stage's input (without the batch dimension). The
        stage is built with static shapes: ``torch.distributed.pipelining``'s runtime
        shape inference deadlocks on gloo in torch 2.13 (the last stage sends its
        backward metadata while stage 0 waits for its first activation send).
    batch_fn : callable, rank 0 only
        ``step -> (x (B, ...) float32, labels (B,) int64)``: the data owner's batch.
    emulated : Emulated, optional
        Fleet emulation (slowdown, link delay) of this stage.
    fault : callable, optional
        Called with the step index before each step (fault injection for tests).
    loss_fn : callable, optional
        ``(output, labels) -> scalar`` mean loss of a micro-batch (last stage; default
        cross-entropy).
    metric_fn : callable, optional
        ``(output (B, ...), labels (B,)) -> int`` of a step (last stage; default correct
        predictions, :func:`sky_flower.pipeline.objective.correct_count`).

    Returns
    -------
    StageResult

    Raises
    ------
    DirectStageError
        Naming the stage when it, or a peer it waits for, fails or stalls (after at
        most ``rdv.timeout_s``); :class:`RankRefusedError` for an unplanned rank.
    ValueError
        On an unknown schedule kind or a missing ``batch_fn`` on rank 0.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    rank, S = rdv.rank, rdv.world_size
    if rank == 0 and batch_fn is None:
        raise ValueError("rank 0 (the data owner) needs batch_fn")
    if batch_size % microbatches:
        raise ValueError(
            f"batch of {batch_size} is not divisible into {microbatches} micro-batches"
        )
    example = torch.zeros(batch_size // microbatches, *[int(d) for d in input_shape])
    example.requires_grad_(rank > 0)  # static shapes: requires_grad decides what is sent back
    with torch.no_grad():
        example_out = module(example)
    emulated = emulated or Emulated()
    wrapped = EmulatedStage(module, emulated, is_first=rank == 0, is_last=rank == S - 1)
    result = StageResult()
    t0 = time.perf_counter()
    join(rdv)
    try:
        result.setup_s = time.perf_counter() - t0
        stage = PipelineStage(
            wrapped,
            rank,
            S,
            torch.device("cpu"),
            input_args=example,
            output_args=example_out.requires_grad_(True),
        )
        is_last = rank == S - 1
        schedule = SCHEDULES[kind](
            stage,
            n_microbatches=microbatches,
            loss_fn=loss_fn or nn.functional.cross_entropy,  # every rank: sets has_backward
            scale_grads=True,
        )
        for step in range(steps):
            if fault is not None:
                fault(step)
            t_step = time.perf_counter()
            label_work = None
            x = labels = None
            if rank == 0:
                x, labels = batch_fn(step)  # type: ignore[misc]
                if S > 1:
                    label_work = dist.isend(labels.contiguous(), dst=S - 1, tag=LABEL_TAG)
            if is_last and S > 1:
                labels = torch.empty(batch_size, dtype=torch.int64)
                dist.recv(labels, src=0, tag=LABEL_TAG)
            losses: list[torch.Tensor] = []
            if rank == 0:
                out = schedule.step(x, target=labels if is_last else None, losses=losses)
            else:
                out = schedule.step(target=labels if is_last else None, losses=losses)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if label_work is not None:
                label_work.wait()
            if is_last:
                result.losses.append(float(sum(float(v.detach()) for v in losses) / len(losses)))
                result.correct += int((metric_fn or correct_count)(out.detach(), labels))
                result.samples += int(labels.shape[0])
            result.step_times_s.append(time.perf_counter() - t_step)
    except DirectStageError:
        raise
    except Exception as err:  # noqa: BLE001 - named and re-raised
        text = _first_line(err)
        if any(sign in text for sign in _PEER_SIGNS):
            raise DirectStageError(
                f"stage {rank} of {S}: {PEER_FAILURE} (timeout {rdv.timeout_s:g} s): {text}"
            ) from err
        raise DirectStageError(f"stage {rank} of {S}: {type(err).__name__}: {text}") from err
    finally:
        result.compute_s = emulated.compute_s
        if dist.is_initialized():  # a crashed stage may already have left
            dist.destroy_process_group()
    return result


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else ""


def _local_worker(  # noqa: PLR0913
    rdv: Rendezvous,
    model_cfg: dict,
    bounds: tuple[int, int],
    weights: dict,
    optimizer: str,
    lr: float,
    kind: str,
    microbatches: int,
    batches: list | None,
    steps: int,
    batch_size: int,
    input_shape: tuple,
    slowdown: float,
    queue: object,
) -> None:
    from sky_flower.core.profile import default_optimizer_factory
    from sky_flower.pipeline.models import build_model
    from sky_flower.pipeline.stage import build_stage, slice_state

    torch.set_num_threads(1)
    try:
        first, last = bounds
        module = build_stage(
            lambda: build_model(model_cfg), first, last, slice_state(weights, first, last)
        )
        opt = default_optimizer_factory(optimizer, lr)(list(module.parameters()))
        res = run_stage(
            rdv,
            module,
            opt,
            kind,
            microbatches,
            steps,
            batch_size,
            input_shape,
            batch_fn=(lambda s: batches[s]) if batches is not None else None,
            emulated=Emulated(slowdown=slowdown),
        )
        state = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
        queue.put((rdv.rank, res, state))  # type: ignore[attr-defined]
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        queue.put((rdv.rank, err, None))  # type: ignore[attr-defined]


def run_local(  # noqa: PLR0913
    model_cfg: dict,
    bounds: Sequence[tuple[int, int]],
    weights: dict,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    kind: str = "gpipe",
    microbatches: int = 1,
    optimizer: str = "adam",
    lr: float = 1e-3,
    slowdowns: Sequence[float] | None = None,
    timeout_s: float = 60.0,
) -> tuple[dict, list[StageResult]]:
    """``torch.distributed.pipelining`` alone: one local process per stage, no Flower.

    Parameters
    ----------
    model_cfg : dict
        :func:`sky_flower.pipeline.models.build_model` config.
    bounds : sequence of (first, last)
        Layers of each stage, in pipeline order.
    weights : dict
        Full-model state dict to start from.
    batches : list of (x (B, ...), labels (B,))
        One batch per step (given to rank 0 only).
    kind, microbatches, optimizer, lr
        As :func:`run_stage` and :func:`sky_flower.core.profile.default_optimizer_factory`.
    slowdowns : sequence of float, optional
        Emulated slowdown per stage.
    timeout_s : float
        Bound on the round, seconds.

    Returns
    -------
    (dict, list of StageResult)
        The trained full-model state dict and each stage's measurements.

    Raises
    ------
    DirectStageError
        If a stage fails or the round does not finish within ``timeout_s`` (+ 30 s for
        process start-up); every process is ended before it is raised.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    S = len(bounds)
    slowdowns = list(slowdowns or [0.0] * S)
    shapes = stage_input_shapes(
        lambda: build_model_cfg(model_cfg), tuple(batches[0][0].shape[1:]), bounds
    )
    queue = ctx.Queue()
    procs = []
    with RoundHost(S, timeout_s) as host:
        for k in range(S):
            p = ctx.Process(
                target=_local_worker,
                args=(
                    host.rendezvous(k),
                    dict(model_cfg),
                    tuple(bounds[k]),
                    weights,
                    optimizer,
                    lr,
                    kind,
                    microbatches,
                    batches if k == 0 else None,
                    len(batches),
                    int(batches[0][1].shape[0]),
                    shapes[k],
                    slowdowns[k],
                    queue,
                ),
                daemon=True,
            )
            p.start()
            procs.append(p)
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s + 30.0
        try:
            while len(got) < S and time.monotonic() < deadline:
                try:
                    rank, res, state = queue.get(timeout=1.0)
                except Exception:  # noqa: BLE001 - queue.Empty
                    if not any(p.is_alive() for p in procs) and queue.empty():
                        break
                    continue
                got[rank] = (res, state)
        finally:
            for p in procs:
                p.join(timeout=5.0)
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = [f"{r}: {v[0]}" for r, v in sorted(got.items()) if isinstance(v[0], BaseException)]
    missing = [k for k in range(S) if k not in got]
    if errors or missing:
        raise DirectStageError(
            "local pipeline failed: "
            + "; ".join(errors + [f"stage {k} gave no result" for k in missing])
        )
    merged: dict = {}
    for k in range(S):
        merged.update({key: torch.from_numpy(v) for key, v in got[k][1].items()})
    return merged, [got[k][0] for k in range(S)]


def build_model_cfg(model_cfg: dict) -> nn.Module:
    """:func:`sky_flower.pipeline.models.build_model` (imported late: keeps this module light)."""
    from sky_flower.pipeline.models import build_model

    return build_model(model_cfg)


def stage_input_shapes(
    model_fn: Callable[[], nn.Module],
    input_shape: Sequence[int],
    bounds: Sequence[tuple[int, int]],
) -> list[tuple[int, ...]]:
    """Per-sample input shape of each stage ``(first, last)`` of a layered model.

    Runs the model's layers on the meta device (no memory, no compute).

    Returns
    -------
    list of tuple of int
        ``shapes[k]`` = shape of one sample entering stage ``k`` (no batch dimension).
    """
    from sky_flower.core.profile import as_layers

    with torch.device("meta"):
        layers = as_layers(model_fn())
        h = torch.zeros(1, *[int(d) for d in input_shape])
        shapes = []
        for first, last in bounds:
            shapes.append(tuple(int(d) for d in h.shape[1:]))
            for j in range(first, last + 1):
                h = layers[j](h)
    return shapes
