"""One federated round: every data owner's pipeline runs, then FedAvg across them.

The joint planner (:func:`sky_flower.core.federated.plan_federation`) gives each data
owner its own pipeline (stage 0 on the owner, helpers after it) and orders pipelines
that share a node (``after``). Here every pipeline of a round runs on its own thread
with its own runner (a runner keeps no per-round state and builds its own
:class:`~sky_flower.flower.exchange.Exchange`; ``direct`` rounds each host their own
TCPStore on a free port); a pipeline starts once those in its ``after`` have finished,
so pipelines that run at once are node-disjoint and a node's ``context.state`` holds
one stage at a time. Each pipeline's runner reassembles its owner's full model; the
round's global model is their FedAvg (McMahan et al. 2017, "Communication-Efficient
Learning of Deep Networks from Decentralized Data", arXiv 1602.05629, Alg. 1:
``w = sum_k n_k / n * w_k`` over the pipelines that finished, ``n_k`` the samples
pipeline ``k`` trained this round), computed by Flower's own
``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords``.

BatchNorm (``train.bn_policy``, :class:`LocalBatchNorm`): ``average`` (default) averages
BatchNorm layers like every other entry; ``local`` is FedBN (Li et al., "FedBN:
Federated Learning on Non-IID Features via Local Batch Normalization", ICLR 2021, arXiv
2102.07623): each data owner's BatchNorm parameters and running statistics stay its own
between rounds (its pipeline starts every round from the global model with the owner's
own BatchNorm entries, kept by the server from the owner's last finished round, since
the layers may sit on helpers); only the other entries are averaged into the model the
owners train from. The global model's BatchNorm entries are still the FedAvg of the
owners' (what server-side evaluation and an owner without its own state use); they
never overwrite an owner's own.

A pipeline that fails drops out of its round's average (its owner's update is lost,
the others kept) and is recorded in the round row; the round fails only when every
pipeline failed, or when its aggregate or training loss is non-finite or diverged
(:class:`sky_flower.sky.transport.guard.RoundGuard`; a pipeline whose reply was non-finite has
already failed by name, :mod:`sky_flower.sky.transport.guard`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from sky_flower.sky.planning.planning import PipelineRun
from sky_flower.sky.rounds.records import (
    FailedPipeline,
    PipelineRecord,
    RoundFailure,
    RoundRecord,
    RoundResult,
    pipelines_failure,
)
from sky_flower.sky.transport.guard import NonFiniteReply, RoundGuard
from sky_flower.sky.transport.runner import RoundOutcome, Runner, SkyNodeError

WEIGHT_KEY = "num-examples"  # Flower's FedAvg weighting key
BN_POLICIES = ("average", "local")  # train.bn_policy


def batchnorm_keys(model: Any) -> frozenset[str]:  # noqa: ANN401 - an nn.Module
    """State-dict keys of ``model``'s BatchNorm layers (``torch.nn.modules.batchnorm.
    _BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm): their ``weight``, ``bias``,
    ``running_mean``, ``running_var`` and ``num_batches_tracked``."""
    from torch.nn.modules.batchnorm import _BatchNorm

    keys = set(model.state_dict())
    # a converted model (sky_flower.pipeline.graph.as_sequential) names its own: its
    # traced units hold no _BatchNorm modules
    out = set(getattr(model, "batchnorm_state_keys", ()))
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            prefix = f"{name}." if name else ""
            out |= {k for k in keys if k.startswith(prefix) and "." not in k[len(prefix) :]}
    return frozenset(out)


class LocalBatchNorm:
    """FedBN's local BatchNorm (``train.bn_policy=local``; Li et al. ICLR 2021, arXiv
    2102.07623, Alg. 1: BatchNorm parameters and statistics are excluded from the
    average and kept per client).

    The server keeps, per data owner, the BatchNorm entries its pipeline returned in
    the last round it finished (the layers may be on helpers, so the owner's node
    cannot keep them itself); :meth:`start` gives that owner's starting model.

    Parameters
    ----------
    keys : collection of str
        The BatchNorm entries of the model's state dict (:func:`batchnorm_keys`).

    Raises
    ------
    ValueError
        If ``keys`` is empty (a model without BatchNorm: ``local`` would be
        ``average``; say ``train.bn_policy=average``).
    """

    def __init__(self, keys: frozenset[str] | set[str]) -> None:
        if not keys:
            raise ValueError(
                "train.bn_policy=local keeps BatchNorm layers local, but the model has "
                "none: use train.bn_policy=average"
            )
        self.keys = frozenset(keys)
        self.by_owner: dict[str, dict[str, Any]] = {}

    def start(self, owner: str, arrays: ArrayRecord) -> ArrayRecord:
        """The model ``owner``'s pipeline starts from: ``arrays`` with the owner's own
        BatchNorm entries, if it has finished a round (else ``arrays`` as is)."""
        own = self.by_owner.get(owner)
        if own is None:
            return arrays
        return ArrayRecord({k: own.get(k, v) for k, v in arrays.items()})

    def keep(self, owner: str, arrays: ArrayRecord) -> None:
        """Remember ``owner``'s BatchNorm entries from the model its pipeline returned."""
        self.by_owner[owner] = {k: v for k, v in arrays.items() if k in self.keys}


@dataclass
class PipelineResult:
    """What one pipeline did in a round: its outcome, or the error that ended it."""

    run: PipelineRun
    outcome: RoundOutcome | None = None
    error: SkyNodeError | None = None
    started_s: float = 0.0  # seconds from the round's start
    wall_s: float = 0.0


class _LockedGrid:
    """A Grid whose push / pull / node-list calls are serialised (pipelines of one
    round share the ServerApp's Grid from several threads)."""

    def __init__(self, grid: Grid) -> None:
        self._grid, self._lock = grid, threading.Lock()

    def push_messages(self, messages: Sequence[Message]) -> list[str]:
        with self._lock:
            return list(self._grid.push_messages(messages))

    def pull_messages(self, message_ids: Sequence[str]) -> list[Message]:
        with self._lock:
            return list(self._grid.pull_messages(message_ids))

    def get_node_ids(self) -> list[int]:
        with self._lock:
            return list(self._grid.get_node_ids())


def run_pipelines(
    grid: Grid,
    runs: Sequence[PipelineRun],
    make_runner: Callable[[], Runner],
    arrays: ArrayRecord,
    server_round: int,
    start: Callable[[PipelineRun, ArrayRecord], ArrayRecord] | None = None,
) -> list[PipelineResult]:
    """Run every pipeline of round ``server_round`` from the global model ``arrays``
    (or from ``start(run, arrays)``, e.g. :meth:`LocalBatchNorm.start` of its owner),
    each on its own thread and runner, each starting once its ``after`` pipelines have
    finished (failed or not).

    Returns
    -------
    list of PipelineResult
        One per run, in ``runs`` order; a pipeline that raised :class:`SkyNodeError`
        has ``error`` set.

    Raises
    ------
    ValueError
        If an ``after`` index is out of range or not earlier-finishing (a cycle).
    Exception
        Any other exception a runner raised (a bug, not a node's failure), after every
        thread has ended.
    """
    n = len(runs)
    for i, r in enumerate(runs):
        if any(not 0 <= j < n or j == i for j in r.after):
            raise ValueError(f"pipeline {i} ({r.owner}) waits on {r.after}: not in 0..{n - 1}")
    shared = _LockedGrid(grid)
    done = [threading.Event() for _ in runs]
    results = [PipelineResult(run=r) for r in runs]
    bugs: list[BaseException] = []
    t0 = time.perf_counter()

    def body(i: int) -> None:
        try:
            for j in runs[i].after:
                done[j].wait()
            res = results[i]
            res.started_s = time.perf_counter() - t0
            try:
                res.outcome = make_runner().run_round(
                    shared,  # type: ignore[arg-type]
                    runs[i].pipeline,
                    arrays if start is None else start(runs[i], arrays),
                    runs[i].steps,
                    server_round,
                )
            except SkyNodeError as err:
                res.error = err
            res.wall_s = time.perf_counter() - t0 - res.started_s
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            bugs.append(err)
        finally:
            done[i].set()

    threads = [
        threading.Thread(target=body, args=(i,), name=f"sky-pipeline-{i}", daemon=True)
        for i in range(n)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if bugs:
        raise bugs[0]
    return results


def fedavg(
    outcomes: Sequence[RoundOutcome],
    frozen: frozenset[str] | set[str] = frozenset(),
    start: ArrayRecord | None = None,
) -> ArrayRecord:
    """FedAvg of the pipelines' reassembled models, weighted by the samples each
    trained this round (``RoundOutcome.seen``): ``sum_k n_k / n * w_k`` (McMahan et al.
    2017, Alg. 1). The model's ``frozen`` parameters (``requires_grad=False``: no
    stage trains or returns them) are not averaged: they keep ``start``'s entries, the
    global model the round started from, bit for bit. Every array keeps the dtype and
    shape of the model's state dict:

    * floating arrays: Flower's ``aggregate_arrayrecords`` (float arithmetic), cast
      back to their dtype;
    * integer and boolean arrays (BatchNorm's ``num_batches_tracked``, counters,
      masks): the exact weighted mean ``sum_k n_k w_k / n`` in integer arithmetic,
      rounded to the nearest integer, halves to even (:func:`integer_mean`); never
      truncated (a float mean of three 7s is 6.999..., which a cast makes 6).

    Raises
    ------
    ValueError
        If ``outcomes`` is empty or no pipeline trained a sample, or ``frozen`` is not
        empty and ``start`` is not given.
    """
    if not outcomes or sum(o.seen for o in outcomes) <= 0:
        raise ValueError("FedAvg needs at least one pipeline that trained samples")
    if frozen and start is None:
        raise ValueError("frozen parameters keep the global model's entries: give start")

    def trained(arrays: ArrayRecord) -> ArrayRecord:
        return ArrayRecord({k: v for k, v in arrays.items() if k not in frozen})

    records = [
        RecordDict(
            {
                "arrays": trained(o.arrays) if frozen else o.arrays,
                "metrics": MetricRecord({WEIGHT_KEY: o.seen}),
            }
        )
        for o in outcomes
    ]
    avg = aggregate_arrayrecords(records, WEIGHT_KEY)
    first = outcomes[0].arrays
    out = {}
    for key, value in first.items():
        if key in frozen:
            out[key] = start[key]  # type: ignore[index]
            continue
        ref = value.numpy()
        if ref.dtype.kind in "biu":  # bool, signed, unsigned: exact, rounded
            parts = [o.arrays[key].numpy() for o in outcomes]
            mean = integer_mean(parts, [int(o.seen) for o in outcomes])
        else:
            mean = avg[key].numpy()
        out[key] = type(value)(np.asarray(mean, dtype=ref.dtype).reshape(ref.shape))
    return ArrayRecord(out)


def integer_mean(arrays: Sequence[np.ndarray], weights: Sequence[int]) -> np.ndarray:
    """The weighted mean ``sum_k n_k a_k / sum_k n_k`` of integer (or boolean) arrays
    of one shape, computed exactly (Python integers: no overflow, no float rounding)
    and rounded to the nearest integer, halves to even (as ``round`` and ``np.rint``).

    Parameters
    ----------
    arrays : sequence of np.ndarray
        Integer or boolean arrays, all of one shape.
    weights : sequence of int
        ``n_k >= 0``, not all zero (samples each model trained).

    Returns
    -------
    np.ndarray
        Of the shape of ``arrays[0]``, dtype object (Python ints): cast it to the
        model's dtype (a boolean mean is then the weighted majority, a tie False).

    Raises
    ------
    ValueError
        If the weights are negative or sum to zero, or the shapes differ.
    """
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be >= 0 and not all zero, got {list(weights)}")
    shapes = {np.shape(a) for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"arrays of different shapes {sorted(shapes)} cannot be averaged")
    total = sum(int(w) for w in weights)
    num = sum(np.asarray(a).astype(object) * int(w) for a, w in zip(arrays, weights, strict=True))
    flat = [round(Fraction(int(v), total)) for v in np.asarray(num, dtype=object).reshape(-1)]
    return np.asarray(flat, dtype=object).reshape(np.shape(arrays[0]))


def predicted_setups(results: Sequence[PipelineResult]) -> list[tuple[float, float]]:
    """What the stage-session set-ups of a round add to its predicted timeline, per
    pipeline (in ``results`` order): ``(shift_s, setup_s)`` in seconds, how far its
    predicted start moves (the largest ``shift_s + setup_s`` of the pipelines it waits
    for, ``after``) and its own predicted set-up this round (``stream``: its outcome's
    ``predicted_setup_s``, non-zero only in a round that set a session up; 0 for a
    pipeline that failed). All 0 in a round that set no session up.

    Raises
    ------
    ValueError
        If an ``after`` index is out of range (as :func:`run_pipelines`).
    """
    own = [
        float(r.outcome.extra.get("predicted_setup_s", 0.0)) if r.outcome is not None else 0.0
        for r in results
    ]
    shift: dict[int, float] = {}

    def moved(i: int) -> float:  # the planner's after: earlier pipelines only, no cycle
        if i not in shift:
            after = results[i].run.after
            if any(not 0 <= j < len(results) or j == i for j in after):
                raise ValueError(f"pipeline {i} waits on {after}: not in 0..{len(results) - 1}")
            shift[i] = max((moved(j) + own[j] for j in after), default=0.0)
        return shift[i]

    return [(moved(i), own[i]) for i in range(len(results))]


def pipeline_row(res: PipelineResult, setup: tuple[float, float] = (0.0, 0.0)) -> PipelineRecord:
    """One pipeline's entry of a round record: owner, nodes, samples trained, steps,
    loss, predicted and measured time (s), and its error if it failed. ``setup``: its
    :func:`predicted_setups` entry (the prediction's start moves by the first, its
    duration grows by the second: a session set up this round)."""
    run, out = res.run, res.outcome
    shift_s, setup_s = setup
    return PipelineRecord(
        owner=run.owner,
        nodes=[st.node for st in run.pipeline.plan.stages],
        samples=run.samples,
        steps=run.steps,
        samples_trained=out.seen if out is not None else 0,
        train_loss=float(np.mean(out.losses)) if out is not None and out.losses else None,
        predicted_time_s=run.time_s + setup_s,
        measured_time_s=res.wall_s,
        predicted_start_s=run.start_s + shift_s,
        measured_start_s=res.started_s,
        predicted_step_time_s=run.pipeline.plan.predicted_step_time_s,
        measured_step_time_s=float(np.median(out.step_times)) if out is not None else None,
        error=None if res.error is None else str(res.error),
        failed_nodes=None if res.error is None else list(res.error.nodes or []),
    )


def round_row(server_round: int, results: Sequence[PipelineResult], seconds: float) -> RoundRecord:
    """The round's record (before the server's evaluation adds its ``test`` metrics)
    from the pipelines that finished: loss and accuracy over every sample trained, the
    slowest pipeline's step times, the bytes of weights their replies carried against
    full fine-tuning's, every pipeline's stages (each with its ``owner``),
    one :class:`PipelineRecord` per pipeline (:func:`pipeline_row`) and
    ``failed_pipelines`` (:func:`failed_pipeline`) for those that failed.

    ``predicted_round_time_s`` is the plan's round, ``max(start_s + time_s)`` over the
    pipelines, plus, in a round that set a ``stream`` stage session up, the predicted
    set-ups (:func:`predicted_setups`: ``max(start_s + shift_s + setup_s + time_s)``);
    a session's steady-state rounds are charged no set-up.

    Raises
    ------
    ValueError
        If no pipeline finished.
    """
    ok = [r for r in results if r.outcome is not None]
    if not ok:
        raise ValueError("no pipeline finished the round")
    outs = [r.outcome for r in ok if r.outcome is not None]
    seen = sum(o.seen for o in outs)
    losses = [loss for o in outs for loss in o.losses]
    weights = [o.seen / max(len(o.losses), 1) for o in outs for _ in o.losses]
    setups = predicted_setups(results)
    extra: dict[str, Any] = {}
    for o in outs:
        for key, value in o.extra.items():
            if key == "flower_messages":  # a count: every pipeline's
                extra[key] = extra.get(key, 0) + value
            else:
                extra[key] = max(extra.get(key, value), value)
    return RoundRecord(
        round=server_round,
        train_loss=float(np.average(losses, weights=weights)),
        train_accuracy=sum(o.correct for o in outs) / max(seen, 1),
        measured_step_time_s=max(float(np.median(o.step_times)) for o in outs),
        predicted_step_time_s=max(r.run.pipeline.plan.predicted_step_time_s for r in ok),
        steps=max(r.run.steps for r in ok),
        samples_trained=seen,
        round_time_s=seconds,
        predicted_round_time_s=max(
            r.run.start_s + shift + setup + r.run.time_s
            for r, (shift, setup) in zip(results, setups, strict=True)
        ),
        weights_sent_bytes=sum(o.weights_bytes for o in outs),
        full_weights_bytes=sum(o.full_weights_bytes for o in outs),
        **extra,
        stages=[
            dataclasses.replace(st, owner=r.run.owner)
            for r in ok
            for st in r.outcome.stages  # type: ignore[union-attr]
        ],
        pipelines=[pipeline_row(r, su) for r, su in zip(results, setups, strict=True)],
        failed_pipelines=[failed_pipeline(r) for r in results if r.error is not None],
    )


def describe(err: SkyNodeError, stage: str) -> RoundFailure:
    """``err`` described (type, message, where, the nodes it names, the non-finite
    stages of a :class:`sky_flower.sky.transport.guard.NonFiniteReply`)."""
    return RoundFailure(
        type=type(err).__name__,
        message=str(err),
        stage=stage,
        nodes=tuple(err.nodes or ()),
        node_ids=None if err.node_ids is None else tuple(err.node_ids),
        nonfinite_stages=err.stages if isinstance(err, NonFiniteReply) else (),
    )


def failed_pipeline(res: PipelineResult) -> FailedPipeline:
    """The record of a pipeline that failed (``res.error`` set)."""
    info = describe(res.error, "pipeline")  # type: ignore[arg-type]
    return FailedPipeline(
        res.run.owner, list(info.nodes), info.message, list(info.nonfinite_stages)
    )


def federated_round(
    grid: Grid,
    runs: Sequence[PipelineRun],
    make_runner: Callable[[], Runner],
    arrays: ArrayRecord,
    server_round: int,
    guard: RoundGuard | None = None,
    local_bn: LocalBatchNorm | None = None,
    frozen: frozenset[str] | set[str] = frozenset(),
) -> RoundResult:
    """Round ``server_round``: every owner's pipeline (:func:`run_pipelines`), then
    FedAvg across those that finished (:func:`fedavg`), checked by ``guard``
    (:class:`sky_flower.sky.transport.guard.RoundGuard`; default: finite only, no divergence
    guard). With ``local_bn`` (``train.bn_policy=local``), each pipeline starts from
    its owner's own BatchNorm entries and, once the round is accepted, each owner that
    finished keeps those it returned (a failed round or pipeline changes none). The
    model's ``frozen`` parameters (:func:`sky_flower.pipeline.stage.frozen_keys`) keep
    ``arrays``' entries (:func:`fedavg`).

    Returns
    -------
    RoundResult
        The round's record (:func:`round_row`) and the new global model; when every
        pipeline failed, or the guard fails the round (a non-finite aggregate or
        training loss, a diverged loss), a record with only ``round`` and
        ``round_time_s``, no model, and the :class:`RoundFailure` (one pipeline's
        error; every failed pipeline's, naming every owner and node; or the guard's
        reason).
    """
    t0 = time.perf_counter()
    start = None if local_bn is None else (lambda run, a: local_bn.start(run.owner, a))
    results = run_pipelines(grid, runs, make_runner, arrays, server_round, start)
    seconds = time.perf_counter() - t0
    ok = [r.outcome for r in results if r.outcome is not None]
    if not ok:
        failed = [r for r in results if r.error is not None]
        if len(results) == 1:  # one data owner: its pipeline's error, as it was
            failure = describe(failed[0].error, "pipeline")  # type: ignore[arg-type]
        else:
            failure = pipelines_failure(
                [failed_pipeline(r) for r in failed],
                [nid for r in failed for nid in (r.error.node_ids or ())],  # type: ignore[union-attr]
            )
        return RoundResult(RoundRecord(server_round, seconds), None, failure)
    new = ok[0].arrays if len(ok) == 1 else fedavg(ok, frozen, arrays)
    row = round_row(server_round, results, seconds)
    text = (guard or RoundGuard()).check(server_round, row.train_loss, new)
    if text:  # the global model stays the last finite one; no node is blamed
        failure = RoundFailure("SkyNodeError", text, "guard", (), (), diverged=text)
        return RoundResult(RoundRecord(server_round, seconds), None, failure)
    for res in results if local_bn is not None else ():
        if res.outcome is not None:
            local_bn.keep(res.run.owner, res.outcome.arrays)  # type: ignore[union-attr]
    return RoundResult(row, new)
