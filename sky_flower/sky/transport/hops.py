"""What the transports that pass through the server share: ``relay`` (every hop a
Flower message) and ``stream`` (every hop a frame on the round's data plane,
:mod:`sky_flower.sky.transport.stream`), and what ``direct`` shares with them.

The server drives a step the same way on both: each stage runs its message groups in
the schedule's order (:func:`step_orders`; GPipe: all forwards, then all backwards,
Huang et al. 2019, arXiv 1811.06965; 1F1B: PipeDream-Flush, Narayanan et al. 2021,
arXiv 2006.09503; the last stage runs forward, loss and backward of a group at once),
an op is sent as soon as its input has arrived (:func:`ready_ops`), and every reply is
checked and filed where the next op finds it (:func:`file_reply`). A reply is a Flower
``Message`` on the relay, a frame dressed as one on the stream
(:class:`sky_flower.sky.transport.endpoint_waits.FrameReply`): the checks (:func:`take`,
:func:`metrics`, :mod:`sky_flower.sky.transport.guard`) read ``content`` and
``metadata`` only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message

from sky_flower.core.simulate import stage_order
from sky_flower.core.virtual import Action
from sky_flower.emulation.devices import EMULATED_S
from sky_flower.flower.exchange import Exchange
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.guard import check_reply, check_stages
from sky_flower.sky.transport.records import StageRecord
from sky_flower.sky.transport.runner import Pipeline, RoundOutcome, Runner, RunSettings


@dataclass
class StepState:
    """One step's state on the server: the ops still to push and the payloads waiting
    for them."""

    orders: list[list[Action]]
    ptr: list[int]
    acts: dict[tuple[int, int], ArrayRecord] = field(default_factory=dict)  # (stage, group)
    grads: dict[tuple[int, int], ArrayRecord] = field(default_factory=dict)
    labels: dict[int, ArrayRecord] = field(default_factory=dict)
    total: ArrayRecord | None = None  # reduction "weighted": the step's label weight
    in_shape: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    inflight: dict[str, tuple[int, str, int]] = field(default_factory=dict)  # id -> k, op, g
    loss: float = 0.0
    correct: int = 0
    seen: int = 0

    def done(self) -> bool:
        return not self.inflight and all(
            p >= len(o) for p, o in zip(self.ptr, self.orders, strict=True)
        )


def step_orders(kind: str, num_stages: int, groups: int) -> list[list[Action]]:
    """Every stage's ops of one step, :class:`~sky_flower.core.virtual.Action` ``(op,
    stage, group)`` in the order it runs them, the cost model's own list
    (:func:`sky_flower.core.simulate.stage_order`); the last stage's backward runs
    inside its forward, so it has forwards only."""
    S = num_stages
    return [
        [a for a in order if k < S - 1 or a.op == "F"]
        for k, order in enumerate(stage_order(kind, S, groups, interleave_last=True))
    ]


def ready_ops(
    st: StepState, group_size: int, busy: set[int] | None = None
) -> Iterator[tuple[int, str, int, dict[str, ArrayRecord]]]:
    """The next op of every stage whose input has arrived: ``(k, op, g, payload)``
    with ``payload`` the records it carries (activations, labels for the last stage,
    gradients); each op yielded advances its stage's pointer. Stages in ``busy`` (the
    relay: one message in flight per stage) are skipped; without ``busy`` a stage's
    ops are yielded as far as their inputs allow (the stream: a stage queues them)."""
    S = len(st.orders)
    for k in range(S):
        while st.ptr[k] < len(st.orders[k]) and (busy is None or k not in busy):
            op, _, g = st.orders[k][st.ptr[k]]
            payload: dict[str, ArrayRecord] = {}
            if op == "F" and k > 0:
                if (k, g) not in st.acts or (k == S - 1 and g not in st.labels):
                    break
                payload[P.ACT] = st.acts.pop((k, g))
                if k == S - 1:
                    payload[P.LABELS] = st.labels.pop(g)
                    if st.total is not None:  # stage 0 sent it with its first group
                        payload[P.LABEL_TOTAL] = st.total
            elif op == "B":
                if (k, g) not in st.grads:
                    break
                payload[P.GRAD] = st.grads.pop((k, g))
            st.ptr[k] += 1
            yield k, op, g, payload
            if busy is not None:
                break


def file_reply(  # noqa: PLR0913
    ex: Exchange,
    plan: Pipeline,
    st: StepState,
    where: tuple[int, str, int],
    reply: Message,
    stat: dict[str, Any],
    rows: int,
) -> None:
    """File stage ``k``'s reply to its op ``where = (k, op, g)``: checked (a stage's
    own error, finite, shapes: ``rows`` activations per group), its payload kept for
    the next op, its figures added to ``stat``.

    Raises
    ------
    SkyNodeError
        Naming the stage and its node.
    """
    k, op, g = where
    if P.STAGE_ERROR in reply.content.config_records:  # the stage's, not the node's
        error = reply.content.config_records[P.STAGE_ERROR].get("error")
        raise ex.fail(f"stage {k} on {ex.name(plan.node_ids[k])} raised {error}", [])
    check_reply(ex, plan, k, reply)  # finite or rejected (sky_flower.sky.transport.guard)
    note(stat, reply, plan.slowdowns[k])
    S = plan.num_stages
    if op == "F" and k < S - 1:
        act = take(ex, reply, P.ACT)
        shape = tuple(act[P.ACT].shape)
        if shape[0] != rows:
            src = reply.metadata.src_node_id
            raise ex.fail(f"{ex.name(src)} sent {shape[0]} activations, not {rows}", [src])
        st.acts[(k + 1, g)], st.in_shape[(k + 1, g)] = act, shape
        if k == 0:
            st.labels[g] = take(ex, reply, P.LABELS, (rows,), leading=True)
            if P.LABEL_TOTAL in reply.content.array_records:
                st.total = take(ex, reply, P.LABEL_TOTAL, ())
    elif op == "F":  # last stage: loss and backward done
        m = metrics(ex, reply)
        st.loss, st.correct, st.seen = st.loss + m.loss, st.correct + m.correct, st.seen + m.n
        if S > 1:
            st.grads[(k - 1, g)] = take(ex, reply, P.GRAD, st.in_shape[(k, g)])
    elif k > 0:
        st.grads[(k - 1, g)] = take(ex, reply, P.GRAD, st.in_shape[(k, g)])


def migrated_state(s: RunSettings, plan: Pipeline, k: int) -> dict[str, ArrayRecord]:
    """Stage ``k``'s set-up entry with its layers' optimizer state from the server's
    store (``train.optimizer_state=keep``; :mod:`sky_flower.sky.migration`), else none."""
    if s.optimizer_store is None:
        return {}
    st = plan.plan.stages[k]
    rec = s.optimizer_store.stage_record(plan.plan.stages[0].node, st.first_layer, st.last_layer)
    return {migration.OPTIM_KEY: rec}


def optimizer_records(ex: Exchange, replies: list[Message]) -> list[ArrayRecord]:
    """Every stage's optimizer state (by parameter name) from its reply.

    Raises
    ------
    SkyNodeError
        Naming the node whose reply lacks it.
    """
    out = []
    for reply in replies:
        rec = reply.content.array_records.get(migration.OPTIM_KEY)
        if rec is None:
            src = reply.metadata.src_node_id
            raise ex.fail(f"{ex.name(src)}: reply lacks its optimizer state", [src])
        out.append(rec)
    return out


def stage_config(  # noqa: PLR0913
    s: RunSettings, k: int, first: int, last: int, server_round: int, session: int = 0
) -> P.StageConfig:
    """Stage ``k``'s :class:`StageConfig` for a round (layers ``first..last``; the
    objective's ``loss`` / ``metric`` by reference) and set-up ``session``."""
    return P.StageConfig(
        stage=k,
        first=first,
        last=last,
        is_first=k == 0,
        is_last=last == s.num_layers - 1,
        microbatches=s.schedule.microbatches,
        batch_size=s.schedule.batch_size,
        optimizer=s.settings.train.optimizer,
        lr=s.settings.train.lr,
        round=server_round,
        seed=s.settings.seed,
        session=session,
        **s.objective(),
    )


def take(
    ex: Exchange,
    reply: Message,
    key: str,
    shape: tuple[int, ...] | None = None,
    leading: bool = False,
) -> ArrayRecord:
    """Array record ``key`` of a stage's reply, checked: present, holding array ``key``,
    of ``shape`` when given (with ``leading``: of a shape that starts with ``shape``,
    e.g. ``(B, T)`` labels of a language model against ``(B,)``; a malformed reply
    fails the round by name).

    Raises
    ------
    SkyNodeError
        Naming the node, if the record is missing or of another shape.
    """
    src = reply.metadata.src_node_id
    rec = reply.content.array_records.get(key)
    if rec is None or key not in rec:
        raise ex.fail(
            f"{ex.name(src)}: reply to {reply.metadata.message_type} lacks {key!r}", [src]
        )
    got = tuple(rec[key].shape)
    if shape is not None and (got[: len(shape)] if leading else got) != tuple(shape):
        raise ex.fail(
            f"{ex.name(src)}: {key!r} has shape {tuple(rec[key].shape)}, expected {tuple(shape)}",
            [src],
        )
    return rec


def metrics(ex: Exchange, reply: Message) -> P.StepMetrics:
    """The last stage's :class:`StepMetrics`, checked (naming the node if missing)."""
    src = reply.metadata.src_node_id
    try:
        return P.StepMetrics.from_record(reply.content.metric_records.get(P.METRICS))
    except P.ProtocolError as err:
        raise ex.fail(f"{ex.name(src)}: reply lacks metrics ({err})", [src]) from err


def note(stat: dict[str, Any], reply: Message, slowdown: float) -> None:
    """Add a stage's reply to its round figures: one message, its reported compute
    (times ``1 + slowdown``: the emulated device's compute) and busy seconds."""
    stat["messages"] += 1
    m = reply.content.metric_records.get(P.METRICS)
    if m is not None:
        own = float(m.get(P.COMPUTE_S, 0.0))  # + what the node's emulation slept, if told
        slept = m.get(EMULATED_S)
        compute = own + float(slept) if slept is not None else own * (1.0 + slowdown)
        stat["compute_s"] += compute
        stat.setdefault("per_message", []).append(compute)
        stat["busy_s"] += float(m.get(P.BUSY_S, 0.0))


def median_per_step(stat: dict[str, Any], steps: int) -> float:
    """A stage's compute per step, robust to a stray slow message: the median message's
    compute times the messages per step (seconds; 0 without messages)."""
    per = stat.get("per_message") or [0.0]
    return float(np.median(per)) * stat["messages"] / max(steps, 1)


def stage_rows(
    plan: Pipeline, stats: list[dict[str, Any]], steps: int, busy: bool = True
) -> list[StageRecord]:
    """Measured against predicted, per stage and step (seconds): ``compute_s``,
    ``busy_s`` (only with ``busy``: a transport whose nodes time each stage message in
    a Flower handler, the relay) and ``messages``."""
    return [
        StageRecord(
            stage=k,
            node=pred["node"],
            messages=got["messages"] / steps,
            predicted_messages=pred["messages"],
            measured_compute_s=got["compute_s"] / steps,
            median_compute_s=median_per_step(got, steps),
            predicted_compute_s=pred["compute_s"],
            measured_busy_s=got["busy_s"] / steps if busy else None,
            predicted_busy_s=pred["busy_s"] if busy else None,
        )
        for k, (pred, got) in enumerate(zip(plan.predictions, stats, strict=True))
    ]


def new_stats(num_stages: int) -> list[dict[str, Any]]:
    """Per stage, its round figures before the first reply (:func:`note` adds to them)."""
    return [{"messages": 0, "compute_s": 0.0, "busy_s": 0.0} for _ in range(num_stages)]


@dataclass
class Trained:
    """A round's steps as the server saw them: per-step losses and wall seconds, shape
    (steps,), correct predictions and samples over the round."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    correct: int = 0
    seen: int = 0


def train_steps(steps: int, step: Callable[[int], StepState]) -> Trained:
    """Run ``steps`` steps, one ``step(i)`` each (its summed loss, correct, seen)."""
    out = Trained()
    for i in range(steps):
        t0 = time.perf_counter()
        st = step(i)
        out.step_times.append(time.perf_counter() - t0)
        out.losses.append(st.loss)
        out.correct, out.seen = out.correct + st.correct, out.seen + st.seen
    return out


def pipelined_outcome(  # noqa: PLR0913
    runner: Runner,
    ex: Exchange,
    plan: Pipeline,
    replies: list[Any],
    arrays: ArrayRecord,
    trained: Trained,
    stats: list[dict[str, Any]],
    busy: bool = True,
    extra: dict[str, Any] | None = None,
) -> RoundOutcome:
    """A relay or stream round's outcome from the stages' weight replies (Flower
    replies, or a session's ``end`` frames): merged (:meth:`Runner.merge`), checked
    finite (:func:`~sky_flower.sky.transport.guard.check_stages`), each layer's
    optimizer state kept for the next set-up (``train.optimizer_state=keep``); the
    stage rows from ``stats`` (:func:`stage_rows`, ``busy``)."""
    new, sent, full = runner.merge(replies, ex, arrays)
    check_stages(ex, plan, replies)  # finite or rejected (sky_flower.sky.transport.guard)
    store = runner.s.optimizer_store
    if store is not None:
        store.put(plan.plan.stages[0].node, optimizer_records(ex, replies))
    return RoundOutcome(
        arrays=new,
        losses=trained.losses,
        correct=trained.correct,
        seen=trained.seen,
        step_times=trained.step_times,
        stages=stage_rows(plan, stats, len(trained.step_times), busy=busy),
        extra={"microbatches_per_message": plan.group_size, **(extra or {})},
        weights_bytes=sent,
        full_weights_bytes=full,
    )
