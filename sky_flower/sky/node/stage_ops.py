"""The stage interpreter: what one stage computes for one op of a step, on every
transport that runs Sky's own stage code.

An op is ``F`` (forward of the micro-batches ``first .. first + count - 1`` of step
``step``; on the last stage the loss and its backward too) or ``B`` (backward of such a
group from its stashed input). The relay (:class:`sky_flower.sky.node.client.SkyClient`:
one Flower message per op group, the stage rebuilt from ``context.state``) and the stream
(:class:`sky_flower.sky.node.stream_node.LiveStage`: one frame per op group, the stage
live in memory, per round or for a whole stage session) both call :func:`run_op`; they
differ only in where the stage, its stash and its accumulation live. ``direct`` runs
torch's own ``PipelineStage`` under ``torch.distributed.pipelining`` schedules.

The computation (:class:`sky_flower.pipeline.stage.StageExecutor`): forward without a
graph, the backward recomputes it, randomness keyed by ``(seed, round, step,
micro-batch, layer)``, buffers updated once per micro-batch in order, each
micro-batch's loss reduced for the step's ``M`` (and, ``weighted``, the step's label
weight), the optimizer stepping after the step's ``M``-th micro-batch: weights, buffers
and dropout masks equal the unsplit reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from sky_flower.pipeline.stage import LossFn, MetricFn, StageExecutor
from sky_flower.sky import protocol as P

Batch = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _array(records: RecordDict, key: str) -> torch.Tensor:
    """Array ``key`` of the array record ``key`` (act, grad, labels, label total)."""
    return records.array_records[key].to_torch_state_dict()[key]


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
            y = ex.forward(x)
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
