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
from typing import Any

from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from sky_flower.flower.exchange import Exchange
from sky_flower.pipeline.stage import slice_state
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.deadlines import stage_message_s
from sky_flower.sky.transport.hops import (
    StepState,
    file_reply,
    migrated_state,
    new_stats,
    pipelined_outcome,
    ready_ops,
    stage_config,
    step_orders,
    train_steps,
)
from sky_flower.sky.transport.runner import Pipeline, RoundOutcome, Runner, message


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
        stats = new_stats(plan.num_stages)
        try:
            ex.request(self.setup_messages(plan, arrays, server_round), self.s.deadline("setup"))
            trained = train_steps(steps, lambda i: self.step(ex, plan, i, group, stats))
            cfg = {P.CONFIG: self.ident.to_config_record()}
            cfg.update(migration.want_record() if self.s.optimizer_store is not None else {})
            msgs = [message(nid, P.COLLECT, cfg, group) for nid in plan.node_ids]
            collect = ex.request(msgs, self.s.deadline("collect"))
            return pipelined_outcome(self, ex, plan, collect, arrays, trained, stats)
        except Exception:  # not waited on: a later push to their nodes waits (Exchange)
            ex.abandon()
            raise

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
    ) -> StepState:
        """Run one step through the pipeline; its loss, correct and seen are summed over
        its groups in the returned state."""
        S, kind = plan.num_stages, self.s.schedule.kind
        G = self.s.schedule.microbatches // plan.group_size
        st = StepState(orders=step_orders(kind, S, G), ptr=[0] * S)
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

    def push_ready(
        self, ex: Exchange, plan: Pipeline, st: StepState, step: int, group: str
    ) -> None:
        """Push every stage's next op whose input has arrived (one in flight per stage)."""
        c = plan.group_size
        busy = {k for k, _, _ in st.inflight.values()}
        push, meta = [], []
        for k, op, g, payload in ready_ops(st, c, busy):
            mb = P.MicroBatchGroup(step, g * c, c, self.ident.round, self.ident.session)
            content: dict[str, Any] = {P.MB: mb.to_config_record(), **payload}
            push.append(
                message(plan.node_ids[k], P.FORWARD if op == "F" else P.BACKWARD, content, group)
            )
            meta.append((k, op, g))
        if push:
            budgets = [
                self.s.deadline("stage", stage_message_s(plan.predictions[k], plan.links[k][0]))
                for k, _, _ in meta
            ]
            for mid, m in zip(ex.push(push, budgets), meta, strict=True):
                st.inflight[mid] = m

    def take_reply(
        self,
        ex: Exchange,
        plan: Pipeline,
        st: StepState,
        reply: Message,
        stats: list[dict[str, Any]],
    ) -> None:
        """File one stage's reply: its payload for the next op, its figures."""
        k, op, g = st.inflight.pop(reply.metadata.reply_to_message_id)
        ex.raise_errors([reply])
        rows = plan.group_size * self.s.schedule.microbatch_size
        file_reply(ex, plan, st, (k, op, g), reply, stats[k], rows)
