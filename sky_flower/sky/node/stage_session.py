"""A stage session on the node: the one loop over a session's control stream, for both
transports that keep a stage across rounds (``stream``, ``direct``; the server's side:
:mod:`sky_flower.sky.transport.session`).

Per round the server sends ``begin`` (``round``, ``steps``, ``rebuild``; the entries of
the round's global weights that differ from what the stage holds; with ``rebuild``, the
whole slice and, ``train.optimizer_state=keep``, the optimizer state). The stage starts
the round as a per-round set-up would (:meth:`SessionStage.begin`: the global weights,
no gradients, a fresh optimizer unless kept; the round's randomness key, data order and
emulation), so a session computes what per-round messages compute, bit for bit. It
plays the round (:meth:`SessionStage.play`: ``stream``, the op frames that follow on the
same stream until the server's ``end``; ``direct``, torch's schedule in the session's
process group) and answers with an ``end`` frame (``round``; its weights and buffers,
figures and, keep, its optimizer state). Where the round says ``release`` (``direct``:
its ``begin``; ``stream``: the server's ``end``; the node runs stages of other pipelines
too, which the plan runs one after another), the stage frees its layers after the reply
and the next ``begin`` rebuilds them, so the node holds one pipeline's stage at a time,
as the planner's memory budget assumes. The fleet's faults strike round by round
(:func:`~sky_flower.emulation.faults.round_hook`,
:func:`~sky_flower.emulation.faults.spoil_reply`). The session ends at the server's
``close``; at the stage's own error (its :data:`~sky_flower.sky.protocol.STAGE_ERROR`,
already reported on the stream, becomes the Flower reply); or with an error raised (the
stream broke or ended, a peer failed, a fault struck).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from sky_flower.emulation import faults
from sky_flower.emulation.devices import Emulation
from sky_flower.emulation.faults import StepHook
from sky_flower.pipeline.stage import stage_optimizer
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.node.channels import Header, StageChannel
from sky_flower.sky.node.stage_ops import NodeStage
from sky_flower.sky.transport.stream_tls import StreamError

if TYPE_CHECKING:
    from sky_flower.sky.transport.channel import StageLink

Frames = Iterator[tuple[Header, RecordDict]]


class SessionStage(ABC):
    """A stage kept live across the rounds of a session: its layers (``module``; None
    once released) and their optimizer (``opt``; None: no trainable parameters)."""

    transport: str  # its message type (P.STREAM, P.DIRECT), which the fleet's faults name
    node: NodeStage  # what the node gives the stage (its emulation by round among it)
    st: P.StageConfig  # the stage (its optimizer's name and learning rate)
    index: int  # the stage's index in its pipeline (named in errors)
    keeps_optimizer: bool  # train.optimizer_state=keep: the optimizer lives across rounds
    module: nn.Module | None
    opt: torch.optim.Optimizer | None

    @abstractmethod
    def build(self, weights: ArrayRecord, optim: ArrayRecord | None) -> None:
        """The layers from ``weights`` (keys of the full model) and their optimizer,
        loaded from ``optim`` (the state by parameter name, keep) where given."""

    def parts(self) -> list[nn.Module]:
        """The modules that hold the layers (keys of the full model)."""
        return [self.module]

    def begin(self, header: Header, records: RecordDict) -> None:
        """Start the round that the ``begin`` frame ``header`` opens as a per-round
        set-up would (a freshly built stage): rebuilt from ``records`` (the whole slice
        and, keep, the optimizer state) where ``rebuild`` (released), else the weights
        in ``records`` (those that changed) loaded; no gradients; a fresh optimizer
        unless kept."""
        arrays = records.array_records.get(P.ARRAYS, ArrayRecord())
        if header.get("rebuild") or self.module is None:
            self.build(arrays, records.array_records.get(migration.OPTIM_KEY))
        else:
            entries = arrays.to_torch_state_dict()
            for part in self.parts():
                own = part.state_dict()
                mine = {k: v.to(own[k].device) for k, v in entries.items() if k in own}
                if mine:
                    part.load_state_dict(mine, strict=False)
        for p in self.module.parameters():
            p.grad = None
        if not self.keeps_optimizer:
            self.opt = stage_optimizer(self.module, self.st.optimizer, self.st.lr)

    @abstractmethod
    def play(
        self,
        header: Header,
        frames: Frames,
        link: StageChannel | StageLink,
        emu: Emulation,
        fault: StepHook | None,
    ) -> tuple[RecordDict, bool]:
        """Play the round that ``header`` began, emulated as ``emu``, ``fault`` called
        before each step, with what else the stream brings (``frames``) and ``link`` at
        hand. Returns the round's reply (or the
        :data:`~sky_flower.sky.protocol.STAGE_ERROR` of the stage's own error, already
        sent on ``link``) and whether to release the layers after it."""

    def release(self) -> None:
        """Free the layers and optimizer (the next ``begin`` has ``rebuild``)."""
        self.module = self.opt = None

    def figures(self) -> dict[str, float]:
        """Figures of the whole session beside ``rounds`` and ``compute_s``."""
        return {}


def serve_session(
    stage: SessionStage, link: StageChannel | StageLink, silence_s: float
) -> RecordDict:
    """Serve ``stage``'s rounds over its control stream ``link`` until the server's
    ``close`` (see the module's docstring); ``silence_s`` bounds an injected stall.

    Returns
    -------
    RecordDict
        At ``close``: the session's figures (``rounds``, ``compute_s`` and
        :meth:`SessionStage.figures`); or the stage's own error.

    Raises
    ------
    StreamError
        If the stream ends before ``close`` or brings a frame other than ``begin`` or
        ``close`` between rounds (and what :meth:`SessionStage.play` raises: a peer's
        failure, a fault, a malformed op).
    """
    frames = iter(link.frames())
    rounds, compute = 0, 0.0
    for header, records in frames:
        op = header.get("op")
        if op == "close":
            figures = {"rounds": rounds, P.COMPUTE_S: compute, **stage.figures()}
            return RecordDict({P.METRICS: MetricRecord(figures)})
        if op != "begin":
            raise StreamError(
                f"stage {stage.index}: a {op!r} frame between a session's rounds (begin or close)"
            )
        rnd = int(header["round"])
        emu = stage.node.emulation_at(rnd)
        stage.begin(header, records)
        fault = faults.round_hook(emu, stage.transport, rnd, silence_s)
        out, release = stage.play(header, frames, link, emu, fault)
        if P.STAGE_ERROR in out:  # the stage's own error ends the session
            return out
        rounds, compute = rounds + 1, compute + float(out[P.METRICS][P.COMPUTE_S])
        faults.spoil_reply(emu, stage.transport, rnd, out)
        link.send({"op": "end", "round": rnd}, out)
        if release:  # hold this stage's memory only during its rounds
            stage.release()
    raise StreamError(
        f"stage {stage.index}: the endpoint ended the stream before the session's close"
    )
