"""The node's ``train.sky_stream`` handler body: one stage of a ``stream`` round.

The stage connects outbound to the round's endpoint (:class:`sky_flower.sky.transport.channel.
StageLink`: the certificate pinned by the fingerprint of the set-up message, its ticket
in the first frame), keeps its layers, optimizer and stashed inputs **live** for the
round (no ``context.state`` round trip per op, unlike the relay), and answers every op
frame the server forwards: ``F`` (forward of micro-batches ``first .. first+count-1`` of
step ``step``; the last stage: loss and backward too), ``B`` (backward of a group from
its stash), until ``end``. Then it replies over Flower with its weights.

The computation is the relay's (:class:`sky_flower.pipeline.stage.StageExecutor`:
forward without a graph, the backward recomputes it, randomness keyed by ``(seed, round,
step, micro-batch, layer)``, buffers updated once per micro-batch in order, the loss
divided by the step's ``M``, the optimizer stepping after the step's ``M``-th
micro-batch): weights, buffers and dropout masks equal the unsplit reference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from sky_flower.core.profile import default_optimizer_factory
from sky_flower.emulation import faults
from sky_flower.emulation.devices import EMULATED_S, Emulation
from sky_flower.pipeline.stage import (
    LossFn,
    MetricFn,
    RngKey,
    StageExecutor,
    frozen_keys,
    make_stage_optimizer,
    trained_state,
)
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.node.stage_state import load_stage, stage_reduction
from sky_flower.sky.transport.channel import StreamError, connect

FRAMES = "frames"  # metric keys of the reply: op frames handled, bytes both ways
BYTES = "bytes"
# stages that share one process (threads: an in-process grid, a test) run their ops one
# at a time: forward_layers seeds the process-wide CPU generator for each layer, so two
# at once would draw each other's dropout masks
_RNG_LOCK = threading.Lock()


class StageRefusedError(RuntimeError):
    """A ``train.sky_stream`` message planned for another node."""


class LiveStage:
    """A stage's layers, optimizer, stash and accumulation for one round, in memory.

    Parameters
    ----------
    st : StageConfig
        The stage.
    module, optimizer
        Its layers and optimizer (None: no trainable parameters).
    batch_fn : callable
        ``step -> (x, labels)``: the data owner's batch (stage 0 only).
    loss_fn, metric_fn : callable
        The last stage's objective.
    """

    def __init__(  # noqa: PLR0913
        self,
        st: P.StageConfig,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        loss_fn: LossFn,
        metric_fn: MetricFn,
        device: torch.device | str = "cpu",
    ) -> None:
        self.st, self.module, self.optimizer = st, module, optimizer
        self.batch_fn, self.loss_fn, self.metric_fn = batch_fn, loss_fn, metric_fn
        # a session's stage serves several rounds: the data owner's batch of round r
        self.round_batch_fn: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None
        self.device = torch.device(device)
        self.reduction = stage_reduction(st)
        self.stash: dict[tuple[int, int], torch.Tensor] = {}
        self.acc_step, self.acc_done = -1, 0
        self.compute_s = 0.0

    def _executor(self, step: int, first: int, count: int) -> StageExecutor:
        key = RngKey(self.st.seed, self.st.round, step)
        return StageExecutor(
            self.module,
            self.optimizer,
            count,
            self.st.microbatches,
            key,
            first,
            self.device,
            self.reduction,
        )

    def _accumulated(self, step: int, count: int) -> int:
        """Micro-batches of ``step`` back-propagated, this group's included.

        Raises
        ------
        P.ProtocolError
            If another step's micro-batches are still accumulating.
        """
        if self.acc_step not in (-1, step):
            raise P.ProtocolError(
                f"step {step} arrived while step {self.acc_step} still has "
                f"{self.st.microbatches - self.acc_done} micro-batches to back-propagate"
            )
        done = self.acc_done + count
        self.acc_step, self.acc_done = (-1, 0) if done >= self.st.microbatches else (step, done)
        return done

    def op(self, header: dict[str, Any], records: RecordDict) -> RecordDict:
        """Run one op frame; the records of the reply frame (compute seconds in
        :data:`~sky_flower.sky.protocol.METRICS`)."""
        st, op = self.st, header["op"]
        step, first, count = int(header["step"]), int(header["first"]), int(header["count"])
        P.MicroBatchGroup(step, first, count, st.round, st.session).check(st.microbatches)
        ex = self._executor(step, first, count)
        out: dict[str, Any] = {}
        total = None  # reduction "weighted": the whole step's label weight
        if op == "F":
            if st.is_first:
                x, labels = (
                    self.batch_fn(step)
                    if self.round_batch_fn is None
                    else self.round_batch_fn(st.round, step)
                )
                total = self.reduction.total(labels)
                rows = slice(
                    first * st.batch_size // st.microbatches,
                    (first + count) * st.batch_size // st.microbatches,
                )
                x, labels = x[rows], labels[rows]
            else:
                x = records.array_records[P.ACT].to_torch_state_dict()[P.ACT]
                labels = (
                    records.array_records[P.LABELS].to_torch_state_dict()[P.LABELS]
                    if st.is_last
                    else None
                )
                if st.is_last and self.reduction.kind == "weighted":
                    total = float(records.array_records[P.LABEL_TOTAL][P.LABEL_TOTAL].numpy())
            t0 = time.perf_counter()
            if st.is_last:
                done = self._accumulated(step, count)
                grad, loss, correct = ex.forward_backward_loss(
                    x,
                    labels,
                    input_grad=not st.is_first,
                    loss_fn=self.loss_fn,
                    step=done >= st.microbatches,
                    metric_fn=self.metric_fn,
                    total=total,
                )
                compute = time.perf_counter() - t0
                n = int(labels.numel())
                out[P.METRICS] = P.StepMetrics(loss, correct, n, compute).to_record()
            else:
                y = ex.forward(x)
                compute = time.perf_counter() - t0
                self.stash[(step, first)] = x
                grad = None
                out[P.ACT] = ArrayRecord({P.ACT: y})
                if st.is_first:
                    out[P.LABELS] = ArrayRecord({P.LABELS: labels})
                    if total is not None:
                        out[P.LABEL_TOTAL] = ArrayRecord(
                            {P.LABEL_TOTAL: torch.tensor(total, dtype=torch.float64)}
                        )
                out[P.METRICS] = MetricRecord({P.COMPUTE_S: compute})
        elif op == "B":
            x = self.stash.pop((step, first), None)
            if x is None:
                raise P.ProtocolError(f"no stashed input for micro-batch {first}: forward first")
            g = records.array_records[P.GRAD].to_torch_state_dict()[P.GRAD]
            done = self._accumulated(step, count)
            t0 = time.perf_counter()
            grad = ex.backward(x, g, input_grad=not st.is_first, step=done >= st.microbatches)
            compute = time.perf_counter() - t0
            out[P.METRICS] = MetricRecord({P.COMPUTE_S: compute})
        else:
            raise P.ProtocolError(f"unknown op {op!r} in a stream frame")
        if grad is not None:
            out[P.GRAD] = ArrayRecord({P.GRAD: grad})
        self.compute_s += compute
        return RecordDict(out)


def run_stream_stage(  # noqa: PLR0913
    cfg: P.StreamConfig,
    weights: ArrayRecord,
    model_fn: Callable[[], nn.Module],
    node_id: int,
    emu: Emulation,
    batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    metric_fn: MetricFn,
    optim: ArrayRecord | None = None,
) -> RecordDict:
    """Run this node's stage for one whole round on the ``stream`` transport.

    Connect to the endpoint, answer its op frames until ``end``, reply with the weights
    (:data:`~sky_flower.sky.protocol.ARRAYS`), figures (:data:`METRICS`: ``compute_s``,
    ``frames``, ``bytes``, the emulated sleep) and, with ``optim`` (``train.
    optimizer_state=keep``), the optimizer state by parameter name. Emulation: the
    node's slowdown after each op's compute, its link delay per op (bytes in and out).
    A stage whose own computation raises sends a ``STAGE_ERROR`` frame and replies with it.

    Raises
    ------
    StageRefusedError
        If the message was planned for another node.
    StreamRefusedError
        A certificate other than the pinned one, a refused ticket, an endpoint not reached.
    StreamError
        If the stream breaks before ``end`` (the server stopped, the deadline passed).
    FaultInjected
        A fleet fault (``crash`` / ``stall`` before step ``fail_step``: the stream closes).
    """
    st = cfg.stage
    if cfg.node_id != int(node_id):
        raise StageRefusedError(
            f"stage {st.stage} refused: it is planned for node {cfg.node_id}, not for "
            f"this node ({node_id})"
        )
    module, opt = load_stage(
        model_fn,
        st.first,
        st.last,
        (weights, None),
        default_optimizer_factory(st.optimizer, st.lr),
        emu.torch_device(),  # the node's device: frames carry CPU bytes, moved at the edges
    )
    if optim is not None and opt is not None:  # migrated (train.optimizer_state=keep)
        from sky_flower.pipeline.stage import optimizer_from_tensors

        local = migration.local_optimizer_state(model_fn, st.first, st.last, optim)
        optimizer_from_tensors(opt, local.to_torch_state_dict())
    live = LiveStage(st, module, opt, batch_fn, loss_fn, metric_fn, emu.torch_device())
    if st.is_first:  # the data owner's first draw loads its data: in the set-up, not step 0
        batch_fn(0)
    link = connect(cfg.link, st.stage)
    hook, frames, nbytes, slept, at_step = faults.step_hook(), 0, 0, 0.0, -1
    ended = False
    try:
        for header, records in link.frames():
            if header.get("op") == "end":
                ended = True
                break
            step = int(header.get("step", -1))
            if hook is not None and step > at_step:  # mid-step: the step's first frame is here
                at_step = step
                hook(step)
            try:
                with _RNG_LOCK:
                    out = live.op(header, records)
            except (P.ProtocolError, KeyError) as err:  # a malformed frame: the server's
                raise StreamError(f"a malformed op frame: {err}") from err
            except Exception as err:  # noqa: BLE001 - the stage's own error, reported
                link.send(
                    {**header, "error": True}, RecordDict({P.STAGE_ERROR: P.stage_error(err)})
                )
                return RecordDict({P.STAGE_ERROR: P.stage_error(err)})
            compute = float(out.metric_records[P.METRICS][P.COMPUTE_S])
            s = emu.after_compute(compute)
            slept += s
            out.metric_records[P.METRICS][EMULATED_S] = s
            size = link.send(header, out)
            delay = emu.link_delay_s(size + sum(r.count_bytes() for r in records.values()))
            if delay > 0:
                time.sleep(delay)
            frames, nbytes = frames + 1, nbytes + size
    finally:
        link.close()
    if not ended:
        raise StreamError(f"stage {st.stage}: the endpoint ended the stream before the round's end")
    weights_out = ArrayRecord(trained_state(module.state_dict(), frozen_keys(module)))
    metrics = MetricRecord(
        {P.COMPUTE_S: live.compute_s, EMULATED_S: slept, FRAMES: frames, BYTES: nbytes}
    )
    result = RecordDict({P.ARRAYS: weights_out, P.METRICS: metrics})
    if optim is not None:
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


def run_stream_session(  # noqa: PLR0913, PLR0915
    cfg: P.StreamConfig,
    weights: ArrayRecord,
    model_fn: Callable[[], nn.Module],
    node_id: int,
    emulation_at: Callable[[int], Emulation],
    round_batch_fn: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    metric_fn: MetricFn,
    optim: ArrayRecord | None = None,
) -> RecordDict:
    """Serve this node's stage for every round of a stage session on ``stream``
    (:mod:`sky_flower.sky.transport.session`), until the server's ``close`` frame.

    The set-up message carried the stage's layer slice (``weights``) and, with
    ``train.optimizer_state=keep``, its optimizer state (``optim``). Over the stream,
    per round: ``begin`` (``round``, ``steps``; the entries of the round's global
    weights that differ from what the stage holds), the op frames exactly as in
    :func:`run_stream_stage` (:meth:`LiveStage.op`), then ``end``, answered by an
    ``end`` frame with the stage's trainable weights and buffers, its figures and (keep)
    its optimizer state. An ``end`` with ``release`` (the node runs stages of other
    pipelines too, which the plan runs one after another) frees the stage's layers and
    optimizer after the reply; the next ``begin`` then carries the whole slice (and, keep,
    the optimizer state) and the stage is rebuilt from it, so the node holds one
    pipeline's stage at a time, as the planner's memory budget assumes. Each round
    starts as a per-round set-up would: the global weights loaded, gradients cleared, a
    fresh optimizer (unless kept), the round's randomness key and data order, the
    node's emulation at that round (fleet drift): the session computes what per-round
    messages compute, bit for bit.

    Returns
    -------
    RecordDict
        The Flower reply at ``close``: figures over the session (``rounds``, ``frames``,
        ``bytes``, ``compute_s``), or the :data:`~sky_flower.sky.protocol.STAGE_ERROR` of
        the stage's own error (also sent as a frame).

    Raises
    ------
    StageRefusedError
        If the message was planned for another node.
    StreamRefusedError
        A certificate other than the pinned one, a refused ticket, an endpoint not reached.
    StreamError
        If the stream breaks or ends before ``close``, or a frame is malformed.
    FaultInjected
        A fleet fault of the round it strikes in (:func:`faults.round_hook`).
    """
    from dataclasses import replace

    from sky_flower.pipeline.stage import optimizer_to_tensors

    st0 = cfg.stage
    if cfg.node_id != int(node_id):
        raise StageRefusedError(
            f"stage {st0.stage} refused: it is planned for node {cfg.node_id}, not for "
            f"this node ({node_id})"
        )
    factory = default_optimizer_factory(st0.optimizer, st0.lr)
    device = emulation_at(st0.round).torch_device()
    module, opt = load_stage(model_fn, st0.first, st0.last, (weights, None), factory, device)
    keep = optim is not None
    if keep and opt is not None:  # migrated (train.optimizer_state=keep), then kept live
        from sky_flower.pipeline.stage import optimizer_from_tensors

        local = migration.local_optimizer_state(model_fn, st0.first, st0.last, optim)
        optimizer_from_tensors(opt, local.to_torch_state_dict())
    if st0.is_first:  # the data owner's first draw loads its data: in the set-up
        round_batch_fn(st0.round, 0)
    link = connect(cfg.link, st0.stage)
    live: LiveStage | None = None
    emu, hook, at_step, rnd = emulation_at(st0.round), None, -1, st0.round
    frames = nbytes = rounds = 0
    compute_total = slept = 0.0
    closed = False
    try:
        for header, records in link.frames():
            op = header.get("op")
            if op == "close":
                closed = True
                break
            if op == "begin":
                rnd = int(header["round"])
                emu = emulation_at(rnd)
                if header.get("rebuild"):  # released after the last round: from the slice
                    whole = records.array_records.get(P.ARRAYS, ArrayRecord())
                    module, opt = load_stage(
                        model_fn, st0.first, st0.last, (whole, None), factory, device
                    )
                    if keep and opt is not None:
                        from sky_flower.pipeline.stage import optimizer_from_tensors

                        local = migration.local_optimizer_state(
                            model_fn,
                            st0.first,
                            st0.last,
                            records.array_records[migration.OPTIM_KEY],
                        )
                        optimizer_from_tensors(opt, local.to_torch_state_dict())
                elif loaded := _changed_entries(records):
                    module.load_state_dict(
                        {k: v.to(device) for k, v in loaded.items()}, strict=False
                    )
                for p in module.parameters():
                    p.grad = None
                if not keep:  # a fresh optimizer every round, as a per-round set-up
                    opt = make_stage_optimizer(module, factory)
                live = LiveStage(
                    replace(st0, round=rnd), module, opt, lambda step: (None, None), loss_fn,
                    metric_fn, device,
                )  # fmt: skip
                live.round_batch_fn = round_batch_fn
                hook, at_step = faults.round_hook(emu, P.STREAM, rnd, cfg.silence_s), -1
                slept = 0.0
                continue
            if live is None:
                raise StreamError(f"a {op!r} frame before the session's first begin")
            if op == "end":
                out = RecordDict(
                    {
                        P.ARRAYS: ArrayRecord(
                            trained_state(module.state_dict(), frozen_keys(module))
                        ),
                        P.METRICS: MetricRecord(
                            {P.COMPUTE_S: live.compute_s, EMULATED_S: slept, "round": rnd}
                        ),
                    }
                )
                if keep:
                    local = ArrayRecord(optimizer_to_tensors(opt) if opt is not None else {})
                    out[migration.OPTIM_KEY] = migration.global_optimizer_state(
                        model_fn, st0.first, st0.last, local
                    )
                faults.spoil_reply(emu, P.STREAM, rnd, out)
                link.send({"op": "end", "round": rnd}, out)
                compute_total += live.compute_s
                rounds, live = rounds + 1, None
                if header.get("release"):  # the node serves another pipeline's stage too:
                    module = opt = None  # hold this one's memory only during its rounds
                continue
            step = int(header.get("step", -1))
            if hook is not None and step > at_step:  # mid-step: the step's first frame
                at_step = step
                hook(step)
            try:
                with _RNG_LOCK:
                    out = live.op(header, records)
            except (P.ProtocolError, KeyError) as err:
                raise StreamError(f"a malformed op frame: {err}") from err
            except Exception as err:  # noqa: BLE001 - the stage's own error, reported
                link.send(
                    {**header, "error": True}, RecordDict({P.STAGE_ERROR: P.stage_error(err)})
                )
                return RecordDict({P.STAGE_ERROR: P.stage_error(err)})
            compute = float(out.metric_records[P.METRICS][P.COMPUTE_S])
            s = emu.after_compute(compute)
            slept += s
            out.metric_records[P.METRICS][EMULATED_S] = s
            size = link.send(header, out)
            delay = emu.link_delay_s(size + sum(r.count_bytes() for r in records.values()))
            if delay > 0:
                time.sleep(delay)
            frames, nbytes = frames + 1, nbytes + size
    finally:
        link.close()
    if not closed:
        raise StreamError(
            f"stage {st0.stage}: the endpoint ended the stream before the session's close"
        )
    return RecordDict(
        {
            P.METRICS: MetricRecord(
                {"rounds": rounds, FRAMES: frames, BYTES: nbytes, P.COMPUTE_S: compute_total}
            )
        }
    )
