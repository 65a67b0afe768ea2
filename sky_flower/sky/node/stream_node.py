"""The node's ``train.sky_stream`` handler body: one stage of a ``stream`` round.

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

from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from sky_flower.core.profile import default_optimizer_factory
from sky_flower.emulation import faults
from sky_flower.emulation.devices import EMULATED_S
from sky_flower.pipeline.stage import (
    LossFn,
    MetricFn,
    frozen_keys,
    make_stage_optimizer,
    trained_state,
)
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.node.channels import StreamChannel
from sky_flower.sky.node.stage_ops import NodeStage, OpStage, answer_op
from sky_flower.sky.node.stage_state import load_stage
from sky_flower.sky.transport.channel import StreamError, connect

FRAMES = "frames"  # metric keys of the reply: op frames handled, bytes both ways
BYTES = "bytes"


class StageRefusedError(RuntimeError):
    """A ``train.sky_stream`` message planned for another node."""


class LiveStage(OpStage):
    """A stage's layers, optimizer, stash and accumulation for one round, in memory
    (:meth:`~sky_flower.sky.node.stage_ops.OpStage.op` runs an op frame on it).

    Parameters
    ----------
    st : StageConfig
        The stage.
    module, optimizer
        Its layers and optimizer (None: no trainable parameters).
    batch_fn : callable
        ``(round, step) -> (x, labels)``: the data owner's batch (stage 0 only; a
        session's stage serves several rounds).
    loss_fn, metric_fn : callable
        The last stage's objective.
    """

    def __init__(  # noqa: PLR0913
        self,
        st: P.StageConfig,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        batch_fn: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
        loss_fn: LossFn,
        metric_fn: MetricFn,
        device: torch.device | str = "cpu",
    ) -> None:
        self.st, self.module, self.optimizer = st, module, optimizer
        self.batch_fn, self.loss_fn, self.metric_fn = batch_fn, loss_fn, metric_fn
        self.device = torch.device(device)
        self.stash: dict[int, torch.Tensor] = {}  # by a group's first micro-batch
        self.acc_step, self.acc_done = -1, 0
        self.compute_s = 0.0

    def layers(self) -> tuple[nn.Module, torch.optim.Optimizer | None, torch.device]:
        """The live layers and optimizer."""
        return self.module, self.optimizer, self.device

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The data owner's batch of step ``step`` of this round."""
        return self.batch_fn(self.st.round, step)

    def objective(self) -> tuple[LossFn, MetricFn]:
        """The node's loss and metric."""
        return self.loss_fn, self.metric_fn

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


def stage_result(  # noqa: PLR0913
    module: nn.Module,
    opt: torch.optim.Optimizer | None,
    figures: dict[str, Any],
    model_fn: Callable[[], nn.Module],
    st: P.StageConfig,
    keep: bool,
) -> RecordDict:
    """A stage's round result: its trainable weights and buffers
    (:data:`~sky_flower.sky.protocol.ARRAYS`), ``figures`` (:data:`METRICS`) and, with
    ``keep`` (``train.optimizer_state=keep``), its optimizer state by parameter name."""
    weights = ArrayRecord(trained_state(module.state_dict(), frozen_keys(module)))
    result = RecordDict({P.ARRAYS: weights, P.METRICS: MetricRecord(figures)})
    if keep:
        from sky_flower.pipeline.stage import optimizer_to_tensors

        local = ArrayRecord(optimizer_to_tensors(opt) if opt is not None else {})
        result[migration.OPTIM_KEY] = migration.global_optimizer_state(
            model_fn, st.first, st.last, local
        )
    return result


def _changed_entries(records: RecordDict) -> dict[str, torch.Tensor]:
    """The weights a ``begin`` frame carries (those that changed since the stage last
    had them), by model key; none if it carries none."""
    rec = records.array_records.get(P.ARRAYS)
    return {} if rec is None else rec.to_torch_state_dict()


def run_stream_session(cfg: P.StreamConfig, node: NodeStage) -> RecordDict:  # noqa: PLR0915
    """Serve this node's stage on the ``stream`` transport (the node's one stream loop):
    for the one round a per-round set-up begins (``cfg.across_rounds`` false), or for
    every round of a stage session (:mod:`sky_flower.sky.transport.session`) until the
    server's ``close`` frame.

    The set-up message carried the stage's layer slice (``node.weights``) and,
    with ``train.optimizer_state=keep``, its optimizer state (``node.optim``). The stage connects
    outbound to the endpoint and answers its op frames
    (:func:`~sky_flower.sky.node.stage_ops.answer_op` on a :class:`LiveStage`).
    Emulation: the node's slowdown after each op's compute, its link delay per op (bytes
    in and out). A per-round set-up's ``end`` is answered by the Flower reply: the
    weights (:data:`~sky_flower.sky.protocol.ARRAYS`), figures (:data:`METRICS`:
    ``compute_s``, ``frames``, ``bytes``, the emulated sleep) and (keep) the optimizer
    state by parameter name. In a session, per round: ``begin`` (``round``, ``steps``;
    the entries of the round's global weights that differ from what the stage holds),
    the op frames, then ``end``, answered by an ``end`` frame with the stage's trainable
    weights and buffers, its figures and (keep) its optimizer state. An ``end`` with
    ``release`` (the node runs stages of other pipelines too, which the plan runs one
    after another) frees the stage's layers and optimizer after the reply; the next
    ``begin`` then carries the whole slice (and, keep, the optimizer state) and the
    stage is rebuilt from it, so the node holds one pipeline's stage at a time, as the
    planner's memory budget assumes. Each round
    starts as a per-round set-up would: the global weights loaded, gradients cleared, a
    fresh optimizer (unless kept), the round's randomness key and data order, the
    node's emulation at that round (fleet drift): the session computes what per-round
    messages compute, bit for bit.

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
    from dataclasses import replace

    st0 = cfg.stage
    if cfg.node_id != int(node.node_id):
        raise StageRefusedError(
            f"stage {st0.stage} refused: it is planned for node {cfg.node_id}, not for "
            f"this node ({node.node_id})"
        )
    factory = default_optimizer_factory(st0.optimizer, st0.lr)
    device = node.emulation_at(st0.round).torch_device()  # frames carry CPU bytes
    keep = node.optim is not None

    def build(whole: ArrayRecord, state: ArrayRecord | None) -> tuple[Any, Any]:
        module, opt = load_stage(node.model_fn, st0.first, st0.last, (whole, None), factory, device)
        if keep and opt is not None:  # migrated (train.optimizer_state=keep), kept live
            from sky_flower.pipeline.stage import optimizer_from_tensors

            local = migration.local_optimizer_state(node.model_fn, st0.first, st0.last, state)
            optimizer_from_tensors(opt, local.to_torch_state_dict())
        return module, opt

    module, opt = build(node.weights, node.optim)
    if st0.is_first:  # the data owner's first draw loads its data: in the set-up
        node.batch_fn(st0.round, 0)
    channel = StreamChannel(connect(cfg.link, st0.stage), cfg.across_rounds)
    session = channel.across_rounds  # a stage session: begin / end per round until close
    live: LiveStage | None = None
    emu, hook, at_step, rnd = node.emulation_at(st0.round), None, -1, st0.round
    frames = nbytes = rounds = 0
    compute_total = slept = 0.0

    def begin(header: dict[str, Any], records: RecordDict) -> LiveStage:
        """A round's start, as a per-round set-up starts it (the global weights, no
        gradients, a fresh optimizer unless kept, the round's key and data order)."""
        nonlocal module, opt, emu, hook, at_step, rnd, slept
        rnd = int(header["round"])
        emu = node.emulation_at(rnd)
        if header.get("rebuild"):  # released after the last round: from the slice
            module, opt = build(
                records.array_records.get(P.ARRAYS, ArrayRecord()),
                records.array_records.get(migration.OPTIM_KEY),
            )
        elif loaded := _changed_entries(records):
            module.load_state_dict({k: v.to(device) for k, v in loaded.items()}, strict=False)
        for p in module.parameters():
            p.grad = None
        if not keep:  # a fresh optimizer every round
            opt = make_stage_optimizer(module, factory)
        stage = LiveStage(
            replace(st0, round=rnd),
            module,
            opt,
            node.batch_fn,
            node.loss_fn,
            node.metric_fn,
            device,
        )
        # faults: per round inside a session; a per-round set-up's come with its message
        hook = faults.round_hook(emu, P.STREAM, rnd, cfg.silence_s) if session else None
        hook, at_step, slept = hook or faults.step_hook(), -1, 0.0
        return stage

    if not session:  # the set-up begins its one round
        live = begin({"round": st0.round}, RecordDict())
    try:
        for header, records in channel.frames():
            op = header.get("op")
            if op == "close" and session:
                break
            if op == "begin" and session:
                live = begin(header, records)
                continue
            if live is None:
                raise StreamError(f"a {op!r} frame before the session's first begin")
            if op == "end":
                figures = {P.COMPUTE_S: live.compute_s, EMULATED_S: slept}
                if not session:  # the round's result is the Flower reply
                    figures |= {FRAMES: frames, BYTES: nbytes}
                    return stage_result(module, opt, figures, node.model_fn, st0, keep)
                out = stage_result(module, opt, {**figures, "round": rnd}, node.model_fn, st0, keep)
                faults.spoil_reply(emu, P.STREAM, rnd, out)
                channel.send({"op": "end", "round": rnd}, out)
                compute_total += live.compute_s
                rounds, live = rounds + 1, None
                if header.get("release"):  # the node serves another pipeline's stage too:
                    module = opt = None  # hold this one's memory only during its rounds
                continue
            step = int(header.get("step", -1))
            if hook is not None and step > at_step:  # mid-step: the step's first frame
                at_step = step
                hook(step)
            error, size, s = answer_op(live, channel, header, records, emu)
            if error is not None:
                return error
            frames, nbytes, slept = frames + 1, nbytes + size, slept + s
        else:
            what = "session's close" if session else "round's end"
            raise StreamError(f"stage {st0.stage}: the endpoint ended the stream before the {what}")
    finally:
        channel.close()
    figures = {"rounds": rounds, FRAMES: frames, BYTES: nbytes, P.COMPUTE_S: compute_total}
    return RecordDict({P.METRICS: MetricRecord(figures)})
