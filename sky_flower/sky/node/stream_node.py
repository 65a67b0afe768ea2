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
                x, labels = self.batch_fn(step)
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
