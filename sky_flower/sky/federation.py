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

A pipeline that fails drops out of its round's average (its owner's update is lost,
the others kept) and is recorded in the round row; the round fails only when every
pipeline failed, or when its aggregate or training loss is non-finite or diverged
(:class:`sky_flower.sky.guard.RoundGuard`; a pipeline whose reply was non-finite has
already failed by name, :mod:`sky_flower.sky.guard`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from sky_flower.sky.blame import Failure
from sky_flower.sky.guard import RoundGuard
from sky_flower.sky.runner import Pipeline, RoundOutcome, Runner, SkyNodeError

WEIGHT_KEY = "num-examples"  # Flower's FedAvg weighting key


@dataclass(frozen=True)
class PipelineRun:
    """One owner's pipeline as a round runs it.

    Attributes
    ----------
    owner : str
        The data owner (stage 0).
    samples : int
        The owner's training samples.
    steps : int
        Training steps this pipeline runs per round.
    pipeline : Pipeline
        What the runner executes.
    after : tuple[int, ...]
        Indices of the pipelines that must finish before this one starts.
    start_s, time_s : float
        Predicted start (seconds from the round's start) and duration.
    """

    owner: str
    samples: int
    steps: int
    pipeline: Pipeline
    after: tuple[int, ...] = ()
    start_s: float = 0.0
    time_s: float = 0.0


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
) -> list[PipelineResult]:
    """Run every pipeline of round ``server_round`` from the global model ``arrays``,
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
                    arrays,
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


def fedavg(outcomes: Sequence[RoundOutcome]) -> ArrayRecord:
    """FedAvg of the pipelines' reassembled models, weighted by the samples each
    trained this round (``RoundOutcome.seen``): ``sum_k n_k / n * w_k`` (McMahan et al.
    2017, Alg. 1), by Flower's ``aggregate_arrayrecords``; every array keeps its dtype.

    Raises
    ------
    ValueError
        If ``outcomes`` is empty or no pipeline trained a sample.
    """
    if not outcomes or sum(o.seen for o in outcomes) <= 0:
        raise ValueError("FedAvg needs at least one pipeline that trained samples")
    records = [
        RecordDict({"arrays": o.arrays, "metrics": MetricRecord({WEIGHT_KEY: o.seen})})
        for o in outcomes
    ]
    avg = aggregate_arrayrecords(records, WEIGHT_KEY)
    first = outcomes[0].arrays
    return ArrayRecord(
        {k: type(v)(np.asarray(avg[k].numpy(), dtype=v.numpy().dtype)) for k, v in first.items()}
    )


def pipeline_row(res: PipelineResult) -> dict[str, Any]:
    """One pipeline's entry of a round row: owner, nodes, samples trained, steps, loss,
    predicted and measured time (s), and its error if it failed."""
    run, out = res.run, res.outcome
    row: dict[str, Any] = {
        "owner": run.owner,
        "nodes": [st.node for st in run.pipeline.plan.stages],
        "samples": run.samples,
        "steps": run.steps,
        "samples_trained": out.seen if out is not None else 0,
        "train_loss": float(np.mean(out.losses)) if out is not None and out.losses else None,
        "predicted_time_s": run.time_s,
        "measured_time_s": res.wall_s,
        "predicted_start_s": run.start_s,
        "measured_start_s": res.started_s,
        "predicted_step_time_s": run.pipeline.plan.predicted_step_time_s,
        "measured_step_time_s": float(np.median(out.step_times)) if out is not None else None,
        "error": None if res.error is None else str(res.error),
    }
    if res.error is not None:
        row["failed_nodes"] = list(res.error.nodes or [])
    return row


def round_row(server_round: int, results: Sequence[PipelineResult], seconds: float) -> dict:
    """The round's row of ``results.json`` (before the server's evaluation adds its
    ``test_*`` entries) from the pipelines that finished: loss and accuracy over every
    sample trained, the slowest pipeline's step times, every pipeline's stages (each
    with its ``owner``), one ``pipelines`` entry per pipeline (:func:`pipeline_row`)
    and ``failed_pipelines`` (owner, nodes, error) for those that failed.

    Raises
    ------
    ValueError
        If no pipeline finished.
    """
    ok = [r for r in results if r.outcome is not None]
    if not ok:
        raise ValueError("no pipeline finished the round")
    seen = sum(r.outcome.seen for r in ok)  # type: ignore[union-attr]
    losses = [loss for r in ok for loss in r.outcome.losses]  # type: ignore[union-attr]
    weights = [r.outcome.seen / max(len(r.outcome.losses), 1) for r in ok for _ in r.outcome.losses]  # type: ignore[union-attr]
    extra: dict[str, Any] = {}
    for r in ok:
        for key, value in r.outcome.extra.items():  # type: ignore[union-attr]
            extra[key] = max(extra.get(key, value), value)
    return {
        "round": server_round,
        "train_loss": float(np.average(losses, weights=weights)),
        "train_accuracy": sum(r.outcome.correct for r in ok) / max(seen, 1),  # type: ignore[union-attr]
        "measured_step_time_s": max(float(np.median(r.outcome.step_times)) for r in ok),  # type: ignore[union-attr]
        "predicted_step_time_s": max(r.run.pipeline.plan.predicted_step_time_s for r in ok),
        "steps": max(r.run.steps for r in ok),
        "samples_trained": seen,
        "round_time_s": seconds,
        "predicted_round_time_s": max(r.run.start_s + r.run.time_s for r in results),
        **extra,
        "stages": [
            {"owner": r.run.owner, **st}
            for r in ok
            for st in r.outcome.stages  # type: ignore[union-attr]
        ],
        "pipelines": [pipeline_row(r) for r in results],
        "failed_pipelines": [
            {
                "owner": r.run.owner,
                "nodes": list(r.error.nodes or []),
                "error": str(r.error),
                "nonfinite_stages": list(getattr(r.error, "stages", ())),
            }
            for r in results
            if r.error is not None
        ],
    }


def pipelines_error(
    failed: Sequence[dict[str, Any]], node_ids: Sequence[int] | None = None
) -> SkyNodeError:
    """One :class:`SkyNodeError` for the failed pipelines ``failed`` (each ``owner``,
    ``error`` and ``nodes``: the nodes that caused it, and ``nonfinite_stages`` where
    its replies held ``NaN``/``inf``), naming every owner and node; ``node_ids``: their
    Flower node ids where known. Its ``failures`` are what
    :func:`sky_flower.sky.blame.judge` reads."""
    text = "; ".join(f"pipeline of {f['owner']} failed: {f['error']}" for f in failed)
    nodes = sorted({n for f in failed for n in (f.get("nodes") or ())})
    err = SkyNodeError(text, nodes=nodes or None, node_ids=list(node_ids) if node_ids else None)
    err.failures = [  # type: ignore[attr-defined]
        Failure(f["owner"], tuple(f.get("nodes") or ()), tuple(f.get("nonfinite_stages") or ()))
        for f in failed
    ]
    return err


def federated_round(
    grid: Grid,
    runs: Sequence[PipelineRun],
    make_runner: Callable[[], Runner],
    arrays: ArrayRecord,
    server_round: int,
    guard: RoundGuard | None = None,
) -> tuple[dict[str, Any], ArrayRecord | None]:
    """Round ``server_round``: every owner's pipeline (:func:`run_pipelines`), then
    FedAvg across those that finished (:func:`fedavg`), checked by ``guard``
    (:class:`sky_flower.sky.guard.RoundGuard`; default: finite only, no divergence
    guard).

    Returns
    -------
    (dict, ArrayRecord or None)
        The round row (:func:`round_row`) and the new global model; when every pipeline
        failed, or the guard fails the round (a non-finite aggregate or training loss,
        a diverged loss), ``{"round", "error": SkyNodeError naming every owner and node
        or the guard's reason, "round_time_s"}`` and None.
    """
    t0 = time.perf_counter()
    results = run_pipelines(grid, runs, make_runner, arrays, server_round)
    seconds = time.perf_counter() - t0
    ok = [r.outcome for r in results if r.outcome is not None]
    if not ok:
        failed = [r for r in results if r.error is not None]
        if len(results) == 1:  # one data owner: its pipeline's error, as it was
            return {"round": server_round, "error": failed[0].error, "round_time_s": seconds}, None
        err = pipelines_error(
            [
                {
                    "owner": r.run.owner,
                    "error": str(r.error),
                    "nodes": r.error.nodes,  # type: ignore[union-attr]
                    "nonfinite_stages": getattr(r.error, "stages", ()),
                }
                for r in failed
            ],
            [nid for r in failed for nid in (r.error.node_ids or ())],  # type: ignore[union-attr]
        )
        return {"round": server_round, "error": err, "round_time_s": seconds}, None
    new = ok[0].arrays if len(ok) == 1 else fedavg(ok)
    row = round_row(server_round, results, seconds)
    err = (guard or RoundGuard()).check(server_round, row, new)
    if err is not None:  # the global model stays the last finite one
        return {"round": server_round, "error": err, "round_time_s": seconds}, None
    return row, new
