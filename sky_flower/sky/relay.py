"""The relay runner: every hop of a step is a Flower message through the server.

One pipelined path for every ``schedule.kind``. A step's ``M`` micro-batches travel in
``G = M / c`` message groups of ``c`` (:attr:`Pipeline.group_size`); ``sequential`` is
one group (``c = M``). Each stage runs its groups in the schedule's order
(:func:`sky_flower.core.simulate.stage_order`; GPipe: all forwards, then all backwards,
Huang et al. 2019, arXiv 1811.06965; 1F1B: PipeDream-Flush, Narayanan et al. 2021, arXiv
2006.09503); the last stage runs forward, loss and backward of a group in one message.
The server pushes a stage's next op as soon as its input has arrived, so stage
``k + 1`` works on group ``g`` while stage ``k`` works on ``g + 1``. At most one message
is in flight per stage: Flower's simulation engine dispatches a node's queued messages to
different workers with the same ``context.state`` and keeps the last write (flwr
``vce_api.worker``), so concurrent messages to one node would lose updates.

A round: ``train.sky_setup`` to every stage, the steps, ``train.sky_collect``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from sky_flower.core.simulate import stage_order
from sky_flower.emulation.devices import EMULATED_S
from sky_flower.flower.exchange import Exchange
from sky_flower.pipeline.stage import slice_state
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.deadlines import stage_message_s
from sky_flower.sky.guard import check_reply, check_stages
from sky_flower.sky.runner import (
    Pipeline,
    RoundOutcome,
    Runner,
    RunSettings,
    merge_weights,
    message,
)


@dataclass
class _Step:
    """One step's state on the server: the ops still to push and the payloads waiting
    for them."""

    orders: list[list[tuple[str, int]]]
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


class RelayRunner(Runner):
    """Runs a round on the relay transport (see the module docstring); every schedule
    kind and plan runs on it."""

    label = "relay"
    ident: P.SessionId  # the round's set-up (setup_messages): every step message carries it

    # -- the round ---------------------------------------------------------------------
    def run_round(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> RoundOutcome:
        """Set up every stage, run ``steps`` steps, collect the stages' weights (see
        :meth:`Runner.run_round`)."""
        ex = self.s.exchange(grid)
        group = str(server_round)
        stats = [{"messages": 0, "compute_s": 0.0, "busy_s": 0.0} for _ in plan.node_ids]
        losses, step_times, correct, seen = [], [], 0, 0
        try:
            ex.request(self.setup_messages(plan, arrays, server_round), self.s.deadline("setup"))
            for step in range(steps):
                t0 = time.perf_counter()
                st = self.step(ex, plan, step, group, stats)
                step_times.append(time.perf_counter() - t0)
                losses.append(st.loss)
                correct, seen = correct + st.correct, seen + st.seen
            store = self.s.optimizer_store
            cfg = {P.CONFIG: self.ident.to_config_record()}
            cfg.update(migration.want_record() if store is not None else {})
            msgs = [message(nid, P.COLLECT, cfg, group) for nid in plan.node_ids]
            collect = ex.request(msgs, self.s.deadline("collect"))
            new = merge_weights(collect, ex, self.expected, P.ARRAYS)
            check_stages(ex, plan, collect)  # finite or rejected (sky_flower.sky.guard)
            if store is not None:  # each layer's optimizer state, for the next set-up
                store.put(plan.plan.stages[0].node, optimizer_records(ex, collect))
        except Exception:  # not waited on: a later push to their nodes waits (Exchange)
            ex.abandon()
            raise
        return RoundOutcome(
            arrays=new,
            losses=losses,
            correct=correct,
            seen=seen,
            step_times=step_times,
            stages=stage_rows(plan, stats, steps),
            extra={"microbatches_per_message": plan.group_size},
        )

    def setup_messages(
        self, plan: Pipeline, arrays: ArrayRecord, server_round: int
    ) -> list[Message]:
        """One ``train.sky_setup`` per stage: its layer slice and :class:`StageConfig`,
        of a fresh set-up session (``self.ident``: what the round's messages carry)."""
        self.ident = P.SessionId(server_round, P.new_session())
        full = arrays.to_torch_state_dict()
        msgs = []
        for k, st in enumerate(plan.plan.stages):
            cfg = stage_config(
                self.s, k, st.first_layer, st.last_layer, server_round, self.ident.session
            )
            weights = ArrayRecord(slice_state(full, st.first_layer, st.last_layer))
            content = {P.ARRAYS: weights, P.CONFIG: cfg.to_config_record()}
            content.update(migrated_state(self.s, plan, k))
            msgs.append(message(plan.node_ids[k], P.SETUP, content, str(server_round)))
        return msgs

    # -- one step ----------------------------------------------------------------------
    def step(
        self, ex: Exchange, plan: Pipeline, step: int, group: str, stats: list[dict[str, Any]]
    ) -> _Step:
        """Run one step through the pipeline; its loss, correct and seen are summed over
        its groups in the returned state."""
        S, kind = plan.num_stages, self.s.schedule.kind
        G = self.s.schedule.microbatches // plan.group_size
        orders = [  # the last stage's backward runs inside its forward message
            [op for op in order if k < S - 1 or op[0] == "F"]
            for k, order in enumerate(stage_order(kind, S, G, interleave_last=True))
        ]
        st = _Step(orders=orders, ptr=[0] * S)
        while not st.done():
            self.push_ready(ex, plan, st, step, group)
            if not st.inflight:  # cannot happen for GPipe / 1F1B orders
                raise ex.fail(f"{kind} schedule stalled at ops {st.ptr}")
            got = ex.poll(list(st.inflight))
            for reply in got:
                self.take_reply(ex, plan, st, reply, stats)
            if not got and ex.poll_interval_s > 0:
                time.sleep(ex.poll_interval_s)
        return st

    def push_ready(self, ex: Exchange, plan: Pipeline, st: _Step, step: int, group: str) -> None:
        """Push every stage's next op whose input has arrived (one in flight per stage)."""
        c, S = plan.group_size, plan.num_stages
        busy = {k for k, _, _ in st.inflight.values()}
        push, meta = [], []
        for k in range(S):
            if k in busy or st.ptr[k] >= len(st.orders[k]):
                continue
            op, g = st.orders[k][st.ptr[k]]
            mb = P.MicroBatchGroup(step, g * c, c, self.ident.round, self.ident.session)
            content: dict[str, Any] = {P.MB: mb.to_config_record()}
            if op == "F" and k > 0:
                if (k, g) not in st.acts or (k == S - 1 and g not in st.labels):
                    continue
                content[P.ACT] = st.acts.pop((k, g))
                if k == S - 1:
                    content[P.LABELS] = st.labels.pop(g)
                    if st.total is not None:  # stage 0 sent it with its first group
                        content[P.LABEL_TOTAL] = st.total
            elif op == "B":
                if (k, g) not in st.grads:
                    continue
                content[P.GRAD] = st.grads.pop((k, g))
            push.append(
                message(plan.node_ids[k], P.FORWARD if op == "F" else P.BACKWARD, content, group)
            )
            meta.append((k, op, g))
            st.ptr[k] += 1
        if push:
            budgets = [
                self.s.deadline("stage", stage_message_s(plan.predictions[k], plan.links[k][0]))
                for k, _, _ in meta
            ]
            for mid, m in zip(ex.push(push, budgets), meta, strict=True):
                st.inflight[mid] = m

    def take_reply(
        self, ex: Exchange, plan: Pipeline, st: _Step, reply: Message, stats: list[dict[str, Any]]
    ) -> None:
        """File one stage's reply: its payload for the next op, its figures."""
        k, op, g = st.inflight.pop(reply.metadata.reply_to_message_id)
        ex.raise_errors([reply])
        if P.STAGE_ERROR in reply.content.config_records:  # the stage's, not the node's
            error = reply.content.config_records[P.STAGE_ERROR].get("error")
            raise ex.fail(f"stage {k} on {ex.name(plan.node_ids[k])} raised {error}", [])
        check_reply(ex, plan, k, reply)  # finite or rejected (sky_flower.sky.guard)
        note(stats[k], reply, plan.slowdowns[k])
        S, rows = plan.num_stages, plan.group_size * self.s.schedule.microbatch_size
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
        optimizer=s.optimizer,
        lr=s.lr,
        round=server_round,
        seed=s.seed,
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


def stage_rows(plan: Pipeline, stats: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Measured against predicted, per stage and step (seconds): ``compute_s``,
    ``busy_s`` and ``messages``."""
    return [
        {
            "stage": k,
            "node": pred["node"],
            "messages": got["messages"] / steps,
            "predicted_messages": pred["messages"],
            "measured_compute_s": got["compute_s"] / steps,
            "median_compute_s": median_per_step(got, steps),
            "predicted_compute_s": pred["compute_s"],
            "measured_busy_s": got["busy_s"] / steps,
            "predicted_busy_s": pred["busy_s"],
        }
        for k, (pred, got) in enumerate(zip(plan.predictions, stats, strict=True))
    ]
