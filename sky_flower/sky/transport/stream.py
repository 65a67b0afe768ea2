"""The stream runner: Flower sets a round up and collects it, a data plane carries it.

For each round the ServerApp hosts an endpoint (:class:`sky_flower.sky.transport.channel.Endpoint`:
gRPC, TLS with a fresh self-signed certificate) and pushes one ``train.sky_stream``
message per stage (its layer slice, :class:`~sky_flower.sky.protocol.StreamConfig`:
the endpoint's address, the stage's fresh ticket, the certificate and its fingerprint).
Each stage's ClientApp connects outbound (:mod:`sky_flower.sky.node.stream_node`) and the
server drives every step over the streams exactly as the relay drives it over Flower
messages (:mod:`sky_flower.sky.transport.hops`: the schedule's op order per stage, an op sent as
soon as its input has arrived, every reply checked and filed), except that a stage may
queue several ops: the stream keeps their order. Then an ``end`` frame to every stage
and the weights come back as the Flower replies. Two Flower messages per stage per round
(the set-up and its reply), every hop a frame.

Faults, each failing the pipeline by name within a bound: a stage that does not join
within ``stream.timeout_s`` (or whose Flower reply is an error first: a refused ticket
or certificate, before any tensor moves), a stream that closes or breaks mid-step, a
frame above the cap or malformed, a stage silent for ``stream.timeout_s`` while it owes
a reply.
"""

from __future__ import annotations

import time
from typing import Any

from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid

from sky_flower.flower.exchange import Exchange
from sky_flower.pipeline.stage import slice_state
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.channel import Endpoint
from sky_flower.sky.transport.endpoint_waits import EndpointWaits, FrameMeta, FrameReply
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
from sky_flower.sky.transport.session import SessionKey, StreamSession


def _op_id(k: int, op: str, g: int) -> str:
    return f"{k}:{op}:{g}"


class StreamRunner(EndpointWaits, Runner):
    """Runs a round on the stream transport (see the module docstring); every schedule
    kind of the relay (``sequential``, ``gpipe``, ``1f1b``) and every plan runs on it."""

    label = "stream"  # the benchmark times each node's link over the data plane

    def check_plan(self, plan: Pipeline) -> None:
        """Refuse a silence bound (``stream.timeout_s``) below the plan's
        predicted step: a healthy stage computing its share of a step would be blamed
        for silence and dropped.

        Raises
        ------
        ValueError
            Naming the setting and the smallest value that holds.
        """
        step = plan.plan.predicted_step_time_s
        if self.s.settings.stream.timeout_s < step:
            raise ValueError(
                f"stream.timeout_s={self.s.settings.stream.timeout_s:g} s (run config "
                f"stream-timeout-s) is below the plan's predicted step of {step:.3g} s: a "
                "stage still computing would be taken for a silent one and dropped. Raise "
                f"it well above the step (at least {step:.3g} s; the default is 30 s)"
            )

    @property
    def silence_s(self) -> float:
        """``stream.timeout_s``: a stage silent this long has failed."""
        return self.s.settings.stream.timeout_s

    def setup_round(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> RoundOutcome:
        """Host the endpoint, set the stages up over Flower, run ``steps`` steps over
        the streams, end them, merge the stages' weights (their Flower replies)."""
        s, S = self.s, plan.num_stages
        budget = self.stage_budget(plan, steps)
        ex = s.exchange(grid, timeout_s=budget + self.silence_s)
        stats = new_stats(S)
        t_start = time.perf_counter()
        try:
            with Endpoint(S, **s.stream_endpoint()) as ep:
                ids = ex.push(self.configure(plan, arrays, steps, server_round, ep, budget))
                self.got: dict[str, Message] = {}
                self._next_poll = 0.0
                self.join(ex, ep, plan, ids)
                setup_s = time.perf_counter() - t_start
                trained = train_steps(steps, lambda i: self.step(ex, ep, plan, ids, i, stats))
                for k in range(S):
                    ep.send(k, {"op": "end"})
                replies = self.collect(ex, plan, ids)
        except Exception:
            ex.abandon()
            raise
        extra = {"setup_s": setup_s, "wall_s": time.perf_counter() - t_start}
        extra["flower_messages"] = 2 * S  # the set-up messages and their replies
        extra["predicted_setup_s"] = plan.setup_s  # every round sets its stages up
        # no busy time: a stage's steps are frames on its stream, not Flower messages
        return pipelined_outcome(self, ex, plan, replies, arrays, trained, stats, False, extra)

    def configure(  # noqa: PLR0913
        self,
        plan: Pipeline,
        arrays: ArrayRecord,
        steps: int,
        server_round: int,
        ep: Endpoint,
        budget: float,
        across_rounds: bool = False,
    ) -> list[Message]:
        """One ``train.sky_stream`` per stage: its layer slice and :class:`StreamConfig`
        (``across_rounds``: a stage session's set-up, its call bounded by ``budget``)."""
        full, session = arrays.to_torch_state_dict(), P.new_session()
        msgs = []
        for k, st in enumerate(plan.plan.stages):
            cfg = P.StreamConfig(
                stage=stage_config(self.s, k, st.first_layer, st.last_layer, server_round, session),
                link=ep.link(k, budget + self.s.settings.stream.timeout_s),
                steps=steps,
                node_id=plan.node_ids[k],
                input_dtype=self.s.input_dtype if k == 0 else "float32",
                across_rounds=across_rounds,
                silence_s=self.s.settings.stream.timeout_s,
            )
            weights = ArrayRecord(slice_state(full, st.first_layer, st.last_layer))
            content: dict[str, Any] = {P.ARRAYS: weights, P.CONFIG: cfg.to_config_record()}
            content.update(migrated_state(self.s, plan, k))  # train.optimizer_state=keep
            if self.s.optimizer_store is not None:
                content.update(migration.want_record())
            msgs.append(message(plan.node_ids[k], P.STREAM, content, str(server_round)))
        return msgs

    # -- one step --------------------------------------------------------------------
    def step(  # noqa: PLR0913
        self,
        ex: Exchange,
        ep: Endpoint,
        plan: Pipeline,
        ids: list[str],
        step: int,
        stats: list[dict[str, Any]],
    ) -> StepState:
        """Run one step over the streams (the relay's order and checks,
        :mod:`sky_flower.sky.transport.hops`)."""
        S, kind, c = plan.num_stages, self.s.schedule.kind, plan.group_size
        st = StepState(orders=step_orders(kind, S, self.s.schedule.microbatches // c), ptr=[0] * S)
        rows = c * self.s.schedule.microbatch_size
        while not st.done():
            for k, op, g, payload in ready_ops(st, c):
                header = {"op": op, "step": step, "first": g * c, "count": c}
                self._send(ex, ep, plan, k, header, RecordDict(payload))
                st.inflight[_op_id(k, op, g)] = (k, op, g)
            if not st.inflight:  # cannot happen for GPipe / 1F1B orders
                raise ex.fail(f"{kind} schedule stalled at ops {st.ptr}")
            owing = sorted({k for k, _, _ in st.inflight.values()})
            k, header, records = self._inbound(ex, ep, plan, ids, owing)
            where = self._where(ex, plan, st, k, header, step)
            reply = FrameReply(
                records, FrameMeta(plan.node_ids[k], f"stream frame {header['op']}", "")
            )
            file_reply(ex, plan, st, where, reply, stats[k], rows)  # type: ignore[arg-type]
        return st

    @staticmethod
    def _where(
        ex: Exchange, plan: Pipeline, st: StepState, k: int, header: dict[str, Any], step: int
    ) -> tuple[int, str, int]:
        """The op a reply frame answers (removed from the in-flight ones).

        Raises
        ------
        SkyNodeError
            Naming the stage, for a frame that answers no op in flight.
        """
        try:
            op, first, c = str(header["op"]), int(header["first"]), plan.group_size
            key = _op_id(k, op, first // c)
            if int(header["step"]) != step or key not in st.inflight:
                raise KeyError(key)
        except (KeyError, TypeError, ValueError) as err:
            nid = plan.node_ids[k]
            raise ex.fail(
                f"stage {k} on {ex.name(nid)} sent a frame that answers no op in flight ({header})",
                [nid],
            ) from err
        return st.inflight.pop(key)

    def collect(self, ex: Exchange, plan: Pipeline, ids: list[str]) -> list[Message]:
        """Every stage's Flower reply (its weights), within ``stream.timeout_s`` plus the
        collect deadline after the ``end`` frames."""
        until = time.perf_counter() + self.s.deadline("collect") + self.s.settings.stream.timeout_s
        while len(self.got) < len(ids):
            self._flower(ex, plan, ids, force=True)
            if len(self.got) == len(ids):
                break
            if time.perf_counter() > until:
                missing = [k for k, mid in enumerate(ids) if mid not in self.got]
                names = ", ".join(f"stage {k} on {ex.name(plan.node_ids[k])}" for k in missing)
                raise ex.fail(
                    f"{names} sent no weights after the round's end",
                    [plan.node_ids[k] for k in missing],
                )
            time.sleep(max(ex.poll_interval_s, 0.01))
        return [self.got[mid] for mid in ids]

    # -- stage sessions (sky_flower.sky.transport.session) ------------------------------
    def session_key(self, plan: Pipeline) -> SessionKey:
        """What a session is set up for: a round whose pipeline differs needs another."""
        stages = tuple(
            stage_config(self.s, k, st.first_layer, st.last_layer, 0, 0)
            for k, st in enumerate(plan.plan.stages)
        )
        return SessionKey(plan.node_ids, (plan.group_size, self.s.input_dtype, stages))

    def open_session(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> StreamSession:
        """Set a session up (:meth:`EndpointWaits.host_session`): one
        ``train.sky_stream`` per stage, ``across_rounds``.

        Raises
        ------
        SkyNodeError
            Naming the stages that did not join or whose set-up failed.
        """
        return self.host_session(
            grid,
            plan,
            steps,
            lambda ep, life: self.configure(
                plan, arrays, steps, server_round, ep, life, across_rounds=True
            ),
        )

    def session_work(  # noqa: PLR0913
        self,
        session: StreamSession,
        plan: Pipeline,
        arrays: ArrayRecord,
        steps: int,
        server_round: int,
    ) -> RoundOutcome:
        """``begin`` with the changed weights, the steps, ``end`` with every stage's
        weights as frames."""
        S, pool, stats = plan.num_stages, self.s.sessions, new_stats(plan.num_stages)
        ex, ep, ids = session.ex, session.ep, session.ids
        full = arrays.to_torch_state_dict()
        slices = [slice_state(full, st.first_layer, st.last_layer) for st in plan.plan.stages]
        self.send_begins(session, plan, slices, server_round, steps)
        trained = train_steps(steps, lambda i: self.step(ex, ep, plan, ids, i, stats))
        release = [nid in pool.shared for nid in plan.node_ids]
        for k in range(S):
            self._send(ex, ep, plan, k, {"op": "end", "release": release[k]})
        replies = self.round_end(ex, ep, plan, ids, server_round)
        out = pipelined_outcome(self, ex, plan, replies, arrays, trained, stats, busy=False)
        session.keep(replies, release)
        return out

    def round_end(
        self, ex: Exchange, ep: Endpoint, plan: Pipeline, ids: list[str], server_round: int
    ) -> list[FrameReply]:
        """Every stage's ``end`` frame of the round (its weights, figures and, keep, its
        optimizer state), as replies in stage order, within ``stream.timeout_s``
        each.

        Raises
        ------
        SkyNodeError
            Naming the stage that sent another frame, broke its stream or stayed silent.
        """
        got: dict[int, FrameReply] = {}
        while len(got) < plan.num_stages:
            owing = [k for k in range(plan.num_stages) if k not in got]
            k, header, records = self._inbound(ex, ep, plan, ids, owing)
            if (
                header.get("op") != "end"
                or int(header.get("round", -1)) != server_round
                or k in got
            ):
                nid = plan.node_ids[k]
                raise ex.fail(
                    f"stage {k} on {ex.name(nid)} sent a frame that is not its end of "
                    f"round {server_round} ({header})",
                    [nid],
                )
            got[k] = FrameReply(records, FrameMeta(plan.node_ids[k], "stream frame end", ""))
        return [got[k] for k in range(plan.num_stages)]
