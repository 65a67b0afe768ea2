"""The node's ``train.sky_stream`` handler body: one stage of a ``stream`` round, or of
every round of a ``stream`` stage session (:mod:`sky_flower.sky.node.stage_session`).

The stage connects outbound to the round's endpoint (:class:`sky_flower.sky.transport.channel.
StageLink`: the certificate pinned by the fingerprint of the set-up message, its ticket
in the first frame), keeps its layers, optimizer and stashed inputs **live** for the
round (no ``context.state`` round trip per op, unlike the relay), and answers every op
frame the server forwards: ``F`` (forward of micro-batches ``first .. first+count-1`` of
step ``step``; the last stage: loss and backward too), ``B`` (backward of a group from
its stash), until ``end``. Then it replies over Flower with its weights. The ops are
served by the node's one interpreter (:func:`sky_flower.sky.node.stage_ops.answer_op`)
over a :class:`~sky_flower.sky.node.channels.StreamChannel`, on a :class:`LiveStage`: the
computation is the relay's (:mod:`sky_flower.sky.node.stage_ops`), weights, buffers and
dropout masks equal the unsplit reference.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from sky_flower.emulation import faults
from sky_flower.emulation.devices import EMULATED_S, Emulation
from sky_flower.emulation.faults import StepHook
from sky_flower.pipeline.stage import LossFn, MetricFn, build_stage, stage_optimizer
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.node.channels import Header, StageChannel, StreamChannel
from sky_flower.sky.node.stage_ops import NodeStage, OpStage, answer_op
from sky_flower.sky.node.stage_session import Frames, SessionStage, serve_session
from sky_flower.sky.transport.channel import StreamError, connect

FRAMES = "frames"  # metric keys of the reply: op frames handled, bytes both ways
BYTES = "bytes"


class StageRefusedError(RuntimeError):
    """A ``train.sky_stream`` message planned for another node."""


class LiveStage(OpStage, SessionStage):
    """A ``stream`` stage kept in memory for its round or its session: its layers and
    optimizer, and per round its stash and accumulation
    (:meth:`~sky_flower.sky.node.stage_ops.OpStage.op` runs an op frame on it).

    Built from the set-up message's layer slice (``node.weights``) and, with
    ``train.optimizer_state=keep``, its optimizer state (``node.optim``), on the node's
    device at the set-up's round.

    Raises
    ------
    StageRefusedError
        If the message was planned for another node.
    """

    transport = P.STREAM

    def __init__(self, cfg: P.StreamConfig, node: NodeStage) -> None:
        st = cfg.stage
        node.refuse_unless_planned(cfg.node_id, f"stage {st.stage}", StageRefusedError)
        self.st, self.node, self.index = st, node, st.stage
        self.device = node.emulation_at(st.round).torch_device()  # frames carry CPU bytes
        self.keeps_optimizer = node.optim is not None
        self.build(node.weights, node.optim)
        self.stash: dict[int, torch.Tensor] = {}  # by a group's first micro-batch
        self.acc_step, self.acc_done = -1, 0
        self.compute_s = 0.0
        self.frames = self.nbytes = 0  # op frames handled, bytes both ways: all rounds

    def build(self, weights: ArrayRecord, optim: ArrayRecord | None) -> None:
        """The layers from the slice ``weights`` and their optimizer, loaded from the
        state by parameter name ``optim`` (keep) where given."""
        st, model_fn = self.st, self.node.model_fn
        self.module = build_stage(
            model_fn, st.first, st.last, weights.to_torch_state_dict(), self.device
        )
        self.opt = stage_optimizer(self.module, st.optimizer, st.lr)
        migration.load_optimizer_state(self.opt, model_fn, st.first, st.last, optim)

    def begin(self, header: Header, records: RecordDict) -> None:
        """Start round ``header["round"]`` as a per-round set-up starts its round
        (:meth:`SessionStage.begin`), with an empty stash and accumulation."""
        super().begin(header, records)
        self.st = replace(self.st, round=int(header["round"]))
        self.stash, self.acc_step, self.acc_done, self.compute_s = {}, -1, 0, 0.0

    def play(
        self,
        header: Header,
        frames: Frames,
        link: StageChannel,
        emu: Emulation,
        fault: StepHook | None,
    ) -> tuple[RecordDict, bool]:
        """Answer the round's op frames (:func:`~sky_flower.sky.node.stage_ops.
        answer_op`; ``fault`` at each step's first frame) until the server's ``end``.
        Returns the stage's result (:func:`~sky_flower.sky.migration.live_stage_reply`;
        figures: ``compute_s``, the emulated sleep and, a session's, ``round``, else
        ``frames`` and ``bytes``) and the ``end``'s ``release``; or its own error.

        Raises
        ------
        StreamError
            If the stream ends before ``end``, or an op is malformed
            (:class:`~sky_flower.sky.node.stage_ops.MalformedOpError`).
        """
        at_step, slept = -1, 0.0
        for head, records in frames:
            if head.get("op") == "end":
                figures = {P.COMPUTE_S: self.compute_s, EMULATED_S: slept}
                if link.across_rounds:
                    figures["round"] = self.st.round
                else:
                    figures |= {FRAMES: self.frames, BYTES: self.nbytes}
                out = migration.live_stage_reply(
                    [self.module],
                    MetricRecord(figures),
                    self.opt,
                    self.node.model_fn,
                    self.st,
                    self.keeps_optimizer,
                )
                return out, bool(head.get("release"))
            step = int(head.get("step", -1))
            if fault is not None and step > at_step:  # mid-step: the step's first frame
                at_step = step
                fault(step)
            error, size, s = answer_op(self, link, head, records, emu)
            if error is not None:
                return error, False
            self.frames, self.nbytes, slept = self.frames + 1, self.nbytes + size, slept + s
        raise StreamError(
            f"stage {self.index}: the endpoint ended the stream before the round's end"
        )

    def figures(self) -> dict[str, float]:
        """The session's op frames and bytes."""
        return {FRAMES: self.frames, BYTES: self.nbytes}

    def layers(self) -> tuple[nn.Module, torch.optim.Optimizer | None, torch.device]:
        """The live layers and optimizer."""
        return self.module, self.opt, self.device

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The data owner's batch of step ``step`` of this round."""
        return self.node.batch_fn(self.st.round, step)

    def objective(self) -> tuple[LossFn, MetricFn]:
        """The node's loss and metric."""
        return self.node.loss_fn, self.node.metric_fn

    def accumulated(self, group: P.MicroBatchGroup) -> int:
        """Micro-batches of ``group.step`` back-propagated, this group's included.

        Raises
        ------
        P.ProtocolError
            If another step's micro-batches are still accumulating.
        """
        step = group.step
        if self.acc_step not in (-1, step):
            raise P.ProtocolError(
                f"step {step} arrived while step {self.acc_step} still has "
                f"{self.st.microbatches - self.acc_done} micro-batches to back-propagate"
            )
        done = self.acc_done + group.count
        self.acc_step, self.acc_done = (-1, 0) if done >= self.st.microbatches else (step, done)
        return done


def run_stream_session(cfg: P.StreamConfig, node: NodeStage) -> RecordDict:
    """Serve this node's stage on the ``stream`` transport: the one round a per-round
    set-up begins (``cfg.across_rounds`` false), or every round of a stage session
    (:func:`~sky_flower.sky.node.stage_session.serve_session`) until the server's
    ``close``.

    The stage (a :class:`LiveStage`) connects outbound to the endpoint and answers its
    op frames. Emulation: the node's slowdown after each op's compute, its link delay
    per op (bytes in and out). A per-round set-up's ``end`` is answered by the Flower
    reply, a session's by an ``end`` frame (:meth:`LiveStage.play`).

    Returns
    -------
    RecordDict
        The Flower reply: a per-round set-up's result at ``end``; a session's figures
        (``rounds``, ``frames``, ``bytes``, ``compute_s``) at ``close``; or the
        :data:`~sky_flower.sky.protocol.STAGE_ERROR` of the stage's own error (also sent
        as a frame).

    Raises
    ------
    StageRefusedError
        If the message was planned for another node.
    StreamRefusedError
        A certificate other than the pinned one, a refused ticket, an endpoint not reached.
    StreamError
        If the stream breaks or ends before ``end`` / ``close`` (the server stopped, the
        deadline passed), or a frame is malformed (an op:
        :class:`~sky_flower.sky.node.stage_ops.MalformedOpError`).
    FaultInjected
        A session's fleet fault of the round it strikes in (:func:`faults.round_hook`; a
        per-round set-up's: around the handler).
    """
    st = cfg.stage
    stage = LiveStage(cfg, node)
    if st.is_first:  # the data owner's first draw loads its data: in the set-up
        node.batch_fn(st.round, 0)
    channel = StreamChannel(connect(cfg.link, st.stage), cfg.across_rounds)
    try:
        if channel.across_rounds:
            return serve_session(stage, channel, cfg.silence_s)
        emu = node.emulation_at(st.round)  # a freshly built stage: no begin
        return stage.play(
            {"round": st.round}, iter(channel.frames()), channel, emu, faults.step_hook()
        )[0]
    finally:
        channel.close()
