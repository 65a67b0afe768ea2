"""The stage interpreter: what one stage computes for one op of a step, and how the op
is served over a channel, on every transport that runs Sky's own stage code.

An op is ``F`` (forward of the micro-batches ``first .. first + count - 1`` of step
``step``; on the last stage the loss and its backward too) or ``B`` (backward of such a
group from its stashed input). :func:`answer_op` serves one op that arrived over a
:class:`~sky_flower.sky.node.channels.StageChannel` on an :class:`OpStage`: it runs
:meth:`OpStage.op` (:func:`run_op`), applies the node's slowdown, sends the reply, and
tells the server's fault (a malformed op: :class:`MalformedOpError`, raised) from the
stage's own (a :data:`~sky_flower.sky.protocol.STAGE_ERROR` reply). The relay
(:class:`sky_flower.sky.node.client.SkyClient`: a
:class:`~sky_flower.sky.node.channels.MessageChannel` per Flower message, the stage
rebuilt from ``context.state``) and the stream
(:class:`sky_flower.sky.node.stream_node.LiveStage` over a
:class:`~sky_flower.sky.node.channels.StreamChannel`: one frame per op, the stage live
in memory, per round or for a whole stage session) differ only in their channel and in
where the stage, its stash and its accumulation live. ``direct`` runs torch's own
``PipelineStage`` under ``torch.distributed.pipelining`` schedules.

The computation (:class:`sky_flower.pipeline.stage.StageExecutor`): forward without a
graph, the backward recomputes it, randomness keyed by ``(seed, round, step,
micro-batch, layer)``, buffers updated once per micro-batch in order, each
micro-batch's loss reduced for the step's ``M`` (and, ``weighted``, the step's label
weight), the optimizer stepping after the step's ``M``-th micro-batch: weights, buffers
and dropout masks equal the unsplit reference.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn

from sky_flower.emulation.devices import EMULATED_S, Emulation
from sky_flower.pipeline.stage import LossFn, MetricFn, RngKey, StageExecutor
from sky_flower.sky import protocol as P
from sky_flower.sky.node.channels import StageChannel
from sky_flower.sky.node.stage_state import NodeStateError, stage_reduction
from sky_flower.sky.transport.stream_tls import StreamError

Batch = Callable[[], tuple[torch.Tensor, torch.Tensor]]
# stages that share one process (threads: an in-process grid, a test) run their ops one
# at a time: forward_layers seeds the process-wide CPU generator for each layer, so two
# at once would draw each other's dropout masks
_RNG_LOCK = threading.Lock()


@dataclass(frozen=True)
class NodeStage:
    """What the node gives a stage that stays live for a round or a stage session
    (``direct``, ``stream``): the set-up message's ``weights`` (the stage's layers, keys
    of the full model) and (``train.optimizer_state=keep``) ``optim``, its optimizer
    state by parameter name (:mod:`sky_flower.sky.migration`; None: a fresh
    optimizer); the ``model_fn``; the Flower ``node_id`` (a stage planned for another
    node is refused); ``emulation_at(round)``, the node's emulated device in a round;
    ``batch_fn(round, step) -> (x, labels)``, the data owner's batch (stage 0 only);
    the last stage's ``loss_fn`` and ``metric_fn``."""

    weights: ArrayRecord
    model_fn: Callable[[], nn.Module]
    node_id: int
    emulation_at: Callable[[int], Emulation]
    batch_fn: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: LossFn
    metric_fn: MetricFn
    optim: ArrayRecord | None = None

    def refuse_unless_planned(self, node_id: int, stage: str, error: type[Exception]) -> None:
        """Raise ``error`` if ``stage`` (``"stage 1"``, ``"rank 1"``) is planned for node
        ``node_id``, not for this one."""
        if node_id != int(self.node_id):
            raise error(
                f"{stage} refused: it is planned for node {node_id}, not for this node "
                f"({self.node_id})"
            )


class MalformedOpError(P.ProtocolError, StreamError):
    """An op the server framed wrongly (a group outside the step's micro-batches, a
    header or input record missing, an unknown op, a backward before its forward on a
    live stage): the server's fault, not the stage's, on every channel. A
    :class:`~sky_flower.sky.protocol.ProtocolError` (the relay's handler raises it:
    Flower's error reply) and a :class:`~sky_flower.sky.transport.stream_tls.
    StreamError` (the stream's data plane failed)."""


def _array(records: RecordDict, key: str) -> torch.Tensor:
    """Array ``key`` of the array record ``key`` (act, grad, labels, label total).

    Raises
    ------
    P.ProtocolError
        If the op's records lack it.
    """
    rec = records.array_records.get(key)
    if rec is None or key not in rec:
        raise P.ProtocolError(f"the op's records lack {key!r}")
    return rec.to_torch_state_dict()[key]


def run_op(  # noqa: PLR0913
    op: str,
    st: P.StageConfig,
    ex: StageExecutor,
    records: RecordDict,
    group: P.MicroBatchGroup,
    batch: Batch | None,
    stash: MutableMapping[int, torch.Tensor],
    accumulated: Callable[[], int],
    loss_fn: LossFn,
    metric_fn: MetricFn,
    missing: type[Exception] = P.ProtocolError,
) -> tuple[dict[str, Any], float, int]:
    """Run op ``op`` of micro-batch group ``group`` on stage ``st``.

    Parameters
    ----------
    op : {"F", "B"}
        Forward (the last stage: loss and backward too) or backward.
    ex : StageExecutor
        The stage's layers and optimizer for this group.
    records : RecordDict
        The op's inputs: ``act`` (a later stage's forward, shape ``(rows, ...)``),
        ``labels`` and ``label_total`` (the last stage), ``grad`` (a backward).
    batch : callable or None
        Stage 0: ``() -> (x, labels)``, the step's whole batch (its group's rows are
        taken); None on the other stages.
    stash : mutable mapping
        The stage's stashed forward inputs, by the group's first micro-batch.
    accumulated : callable
        ``() -> int``: micro-batches of the step back-propagated, this group's included
        (raises if another step is still accumulating).
    missing : exception class
        Raised when a backward finds no stashed input.

    Returns
    -------
    (dict, float, int)
        The reply's records (``act``, ``labels``, ``label_total``, ``grad``,
        :data:`~sky_flower.sky.protocol.METRICS` with ``compute_s``; the last stage's
        :class:`~sky_flower.sky.protocol.StepMetrics`), the compute seconds, and the
        micro-batches accumulated (-1 after a forward that back-propagates nothing).

    Raises
    ------
    P.ProtocolError
        On an unknown op.
    """
    out: dict[str, Any] = {}
    done, grad = -1, None
    if op == "F":
        total = None  # reduction "weighted": the whole step's label weight
        if st.is_first:  # drawn before the timer: a worker's first draw loads the data
            x, labels = batch()  # type: ignore[misc]
            total = ex.reduction.total(labels)
            rows = slice(
                group.first * st.batch_size // st.microbatches,
                (group.first + group.count) * st.batch_size // st.microbatches,
            )
            x, labels = x[rows], labels[rows]
        else:
            x = _array(records, P.ACT)
            labels = _array(records, P.LABELS) if st.is_last else None
            if st.is_last and ex.reduction.kind == "weighted":
                total = float(_array(records, P.LABEL_TOTAL))
        t0 = time.perf_counter()
        if st.is_last:
            done = accumulated()
            grad, loss, correct = ex.forward_backward_loss(
                x,
                labels,
                input_grad=not st.is_first,
                loss_fn=loss_fn,
                step=done >= st.microbatches,
                metric_fn=metric_fn,
                total=total,
            )
            compute = time.perf_counter() - t0
            n = int(labels.numel())  # labels counted: tokens for an LM (accuracy = correct / n)
            out[P.METRICS] = P.StepMetrics(loss, correct, n, compute).to_record()
        else:
            y = ex.forward(x, input_grad=not st.is_first)
            compute = time.perf_counter() - t0
            stash[group.first] = x
            out[P.ACT] = ArrayRecord({P.ACT: y})
            if st.is_first:
                out[P.LABELS] = ArrayRecord({P.LABELS: labels})
                if total is not None:
                    out[P.LABEL_TOTAL] = ArrayRecord(
                        {P.LABEL_TOTAL: torch.tensor(total, dtype=torch.float64)}
                    )
            out[P.METRICS] = MetricRecord({P.COMPUTE_S: compute})
    elif op == "B":
        x = stash.pop(group.first, None)
        if x is None:
            raise missing(f"no stashed input for micro-batch {group.first}: forward first")
        g = _array(records, P.GRAD)
        done = accumulated()
        t0 = time.perf_counter()
        grad = ex.backward(x, g, input_grad=not st.is_first, step=done >= st.microbatches)
        compute = time.perf_counter() - t0
        out[P.METRICS] = MetricRecord({P.COMPUTE_S: compute})
    else:
        raise P.ProtocolError(f"unknown op {op!r}")
    if grad is not None:
        out[P.GRAD] = ArrayRecord({P.GRAD: grad})
    return out, compute, done


def op_group(header: dict[str, Any], st: P.StageConfig) -> P.MicroBatchGroup:
    """The micro-batch group of an op's ``header`` (``step``, ``first``, ``count``) in
    stage ``st``'s set-up (its ``round`` and ``session``), checked against its ``M``.

    Raises
    ------
    P.ProtocolError
        If a field is missing or not an int, or the group lies outside ``M``.
    """
    group = P.MicroBatchGroup.from_config_record(
        {**header, "round": st.round, "session": st.session}
    )
    group.check(st.microbatches)
    return group


class OpStage(ABC):
    """A stage that ops run on: its config, layers and optimizer (:meth:`executor`), its
    stashed forward inputs and its accumulation; the relay's lives in ``context.state``
    (:class:`sky_flower.sky.node.client.ContextStage`), the stream's in memory
    (:class:`sky_flower.sky.node.stream_node.LiveStage`).

    Attributes
    ----------
    st : P.StageConfig
        The stage (its set-up's round and session).
    stash : mutable mapping
        Stashed forward inputs, by a group's first micro-batch.
    missing : exception class
        Raised by a backward that finds no stashed input (the relay's
        :class:`NodeStateError`: its state was lost; else a malformed op).
    compute_s : float
        Compute seconds of the ops run so far.
    """

    st: P.StageConfig
    stash: MutableMapping[int, torch.Tensor]
    missing: type[Exception] = P.ProtocolError
    compute_s: float = 0.0

    @abstractmethod
    def layers(self) -> tuple[nn.Module, torch.optim.Optimizer | None, torch.device]:
        """The stage's layers, optimizer (None: no trainable parameters) and device."""

    def executor(self, group: P.MicroBatchGroup) -> StageExecutor:
        """The stage's :meth:`layers` for the ``group.count`` micro-batches of
        ``group``: each micro-batch's loss scaled by the reduction for the step's ``M``
        (:func:`~sky_flower.sky.node.stage_state.stage_reduction`), the randomness keyed
        by the run's seed, the round, the step and the micro-batches' indices."""
        module, opt, device = self.layers()
        st = self.st
        key = RngKey(st.seed, st.round, group.step)
        reduction = stage_reduction(st)
        return StageExecutor(
            module, opt, group.count, st.microbatches, key, group.first, device, reduction
        )

    @abstractmethod
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0: step ``step``'s whole batch ``(x, labels)``."""

    @abstractmethod
    def accumulated(self, group: P.MicroBatchGroup) -> int:
        """Micro-batches of ``group.step`` back-propagated, this group's included
        (raises if another step's are still accumulating)."""

    @abstractmethod
    def objective(self) -> tuple[LossFn, MetricFn]:
        """The last stage's loss and metric."""

    def keep(self, ex: StageExecutor, group: P.MicroBatchGroup, done: int) -> None:
        """After a back-propagating op (``done`` micro-batches of the step): keep what it
        changed (a live stage keeps it in memory: nothing to do)."""
        return

    def op(self, header: dict[str, Any], records: RecordDict) -> RecordDict:
        """Run one op (:func:`run_op`); the reply's records (compute seconds in
        :data:`~sky_flower.sky.protocol.METRICS`).

        Raises
        ------
        P.ProtocolError
            If the op is malformed (its group, its inputs, an unknown op).
        """
        st = self.st
        group = op_group(header, st)
        ex = self.executor(group)
        loss_fn, metric_fn = self.objective()
        out, compute, done = run_op(
            str(header.get("op")),
            st,
            ex,
            records,
            group,
            (lambda: self.batch(group.step)) if st.is_first else None,
            self.stash,
            lambda: self.accumulated(group),
            loss_fn,
            metric_fn,
            missing=self.missing,
        )
        if done >= 0:  # back-propagated: the accumulation (or the stepped stage) kept
            self.keep(ex, group, done)
        self.compute_s += compute
        return RecordDict(out)


def answer_op(
    stage: OpStage,
    channel: StageChannel,
    header: dict[str, Any],
    records: RecordDict,
    emu: Emulation,
) -> tuple[RecordDict | None, int, float]:
    """Serve one op that arrived over ``channel``: run it on ``stage``
    (:meth:`OpStage.op`, one op at a time in the process), apply the node's slowdown
    after its compute (:data:`~sky_flower.emulation.devices.EMULATED_S` in the reply's
    figures), where the channel says so
    (:attr:`~sky_flower.sky.node.channels.StageChannel.link_per_op`) sleep the node's
    link delay on the op's bytes both ways, then send the reply: the delay holds the
    reply back, as a real link's latency does and as the stream-link probe that the
    cost model's per-op charge comes from sleeps it
    (:func:`sky_flower.sky.transport.stream_probe.echo_frames`).

    Returns
    -------
    (RecordDict or None, int, float)
        ``None`` (or the :data:`~sky_flower.sky.protocol.STAGE_ERROR` record of the
        stage's own error, sent as the reply too, its header marked ``"error": True``),
        the reply's bytes and the emulated seconds slept.

    Raises
    ------
    MalformedOpError
        On a malformed op (the server's fault, not the stage's).
    NodeStateError
        If the stage lacks the state the op needs (the relay's node lost it).
    """
    try:
        with _RNG_LOCK:
            out = stage.op(header, records)
    except NodeStateError:
        raise
    except P.ProtocolError as err:  # a malformed op: the server's
        raise MalformedOpError(f"a malformed op: {err}") from err
    except Exception as err:  # noqa: BLE001 - the stage's own error, reported
        error = RecordDict({P.STAGE_ERROR: P.stage_error(err)})
        channel.send({**header, "error": True}, error)
        return error, 0, 0.0
    slept = emu.after_compute(float(out.metric_records[P.METRICS][P.COMPUTE_S]))
    out.metric_records[P.METRICS][EMULATED_S] = slept
    if channel.link_per_op:  # the link delays the reply's delivery, as a real link does
        nbytes = sum(r.count_bytes() for r in (*records.values(), *out.values()))
        delay = emu.link_delay_s(nbytes)
        if delay > 0:
            time.sleep(delay)
    return None, channel.send(header, out), slept
