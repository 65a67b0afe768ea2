"""The direct runner: one round peer to peer in a ``torch.distributed.pipelining``
schedule (GPipe or 1F1B, :mod:`sky_flower.pipeline.direct` runs it on the nodes).

The server hosts the round's TCPStore, pushes one ``train.sky_direct`` message per stage
(its layer slice, settings, rank, the node it is planned for and the round's
rendezvous: only these messages carry it), and waits for every stage's weights and
timings.

With stage sessions (``stream.sessions``, on by default;
:mod:`sky_flower.sky.transport.session`) those messages start a session instead: each
also carries a :class:`~sky_flower.sky.protocol.SessionLink`, the stage's control stream
to a stream endpoint the server hosts (TLS, the certificate pinned, a ticket per
stage). The TCPStore and the stages' process group then live across rounds; every round
the server sends each stage a ``begin`` frame (the round, its steps, the weights that
changed) and each stage answers, after its steps peer to peer, with an ``end`` frame
(its weights, timings and, keep, optimizer state). The Flower replies come when the
session ends. A round that fails ends its session (its group is unusable): the next
round sets a fresh one up.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from sky_flower.core.cost import Schedule
from sky_flower.emulation.devices import EMULATED_S
from sky_flower.flower.exchange import Exchange, short_reason
from sky_flower.pipeline.device import direct_backend
from sky_flower.pipeline.direct import PEER_FAILURE, RoundHost, stage_input_shapes
from sky_flower.pipeline.engine import MULTI_CHUNK
from sky_flower.pipeline.stage import slice_state
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.channel import Endpoint
from sky_flower.sky.transport.endpoint_waits import EndpointWaits, FrameMeta, FrameReply
from sky_flower.sky.transport.guard import check_stages
from sky_flower.sky.transport.hops import migrated_state, optimizer_records, stage_config
from sky_flower.sky.transport.records import StageRecord
from sky_flower.sky.transport.runner import Pipeline, RoundOutcome, Runner, message
from sky_flower.sky.transport.session import SessionKey, StreamSession


def plan_kind(plan: Pipeline, schedule: Schedule) -> str:
    """The schedule a pipeline runs: the one its plan records (``auto`` picked it), else
    the configured one."""
    return str(plan.plan.schedule.get("kind", schedule.kind))


def kinds_label(runner_cls: Any, runs: Sequence[Any], schedule: Schedule) -> str:  # noqa: ANN401
    """``"<runner_cls.label>, <kinds>"`` for the round log: the schedule kinds the pipelines of
    ``runs`` (each with a ``pipeline``) run, i.e. what ``auto`` picked, not ``auto``
    (``"direct, 1f1b"``, ``"direct, gpipe/1f1b"``)."""
    kinds = sorted({plan_kind(r.pipeline, schedule) for r in runs})
    return f"{runner_cls.label}, {'/'.join(kinds) or schedule.kind}"


def chunk_plan(plan: Pipeline, s: Any, S: int) -> list[dict[str, str]] | None:  # noqa: ANN401
    """Per rank, the :class:`~sky_flower.sky.protocol.DirectConfig` chunk fields of a
    chunked plan (``interleaved``, ``zero_bubble``: chunk ``c`` on rank ``c mod S``),
    or None for one stage per rank."""
    layers = plan.plan.schedule.get("chunk_layers")
    if plan_kind(plan, s.schedule) not in MULTI_CHUNK or not layers:
        return None
    bounds = [(int(a), int(b)) for a, b in layers]
    shapes = stage_input_shapes(s.model_fn, list(s.input_shape), bounds, s.input_dtype)
    out = []
    for k in range(S):
        mine = range(k, len(bounds), S)
        layers_k = [v for c in mine for v in (c, *bounds[c])]
        shapes_k = [v for c in mine for v in (len(shapes[c]), *shapes[c])]
        out.append(
            {
                "chunk_layers": " ".join(map(str, layers_k)),
                "chunk_shapes": " ".join(map(str, shapes_k)),
            }
        )
    return out


def reply_status(reply: Any) -> tuple[str, str]:  # noqa: ANN401 - a Message, a FrameReply or None
    """A stage's round as :meth:`DirectRunner.raise_failures` reads it: ``("missing",
    "")`` (no reply), ``("failed", reason)`` (an error reply: the node's failure or a
    peer's), ``("raised", error)`` (the stage's own error,
    :data:`~sky_flower.sky.protocol.STAGE_ERROR`) or ``("ok", "")``."""
    if reply is None:
        return "missing", ""
    if reply.has_error():
        return "failed", short_reason(reply.error.reason)
    if P.STAGE_ERROR in reply.content.config_records:
        return "raised", str(reply.content[P.STAGE_ERROR]["error"])
    return "ok", ""


def stage_weights(
    full: dict[str, Any],
    chunked: dict[str, str] | None,
    st: Any,  # noqa: ANN401 - a StagePlan
) -> dict[str, Any]:
    """A rank's layers' entries of the full model ``full``: its chunks' (``chunked``,
    :func:`chunk_plan`'s entry) or its stage's ``st.first_layer .. st.last_layer``."""
    if not chunked:
        return slice_state(full, st.first_layer, st.last_layer)
    parts = [int(v) for v in chunked["chunk_layers"].split()]
    return {
        key: v
        for c in range(0, len(parts), 3)
        for key, v in slice_state(full, parts[c + 1], parts[c + 2]).items()
    }


class DirectRunner(EndpointWaits, Runner):
    """Runs a round on the direct transport.

    Waits at most ``failure.message_timeout_s`` plus ``deadlines.stage_multiple`` x the
    predicted round (:mod:`sky_flower.sky.transport.deadlines`); once one stage has
    failed, at most ``direct.timeout_s`` + 5 s more for the others (they stop within
    ``direct.timeout_s`` mid-round: gloo's timeout, or at once when a peer's sockets
    close).

    """

    label = "direct"
    peer_links = True  # stages talk peer to peer: the benchmark takes the emulated links
    calibrate = True  # and times the gloo step's fixed costs (issue 16)

    @staticmethod
    def check_schedule(schedule: Schedule) -> None:
        """Refuse ``schedule.kind=sequential`` (torch's pipelining runs gpipe, 1f1b,
        interleaved, zero_bubble; ``auto`` picks one).

        Raises
        ------
        ValueError
            Naming every kind/transport pair that runs.
        """
        if schedule.kind == "sequential":
            raise ValueError(
                "schedule.kind=sequential runs on transport=relay, gpipe and 1f1b on "
                "transport=direct (torch.distributed.pipelining, with interleaved, "
                "zero_bubble and auto) and on relay: got "
                "kind=sequential, transport=direct"
            )

    def check_plan(self, plan: Pipeline) -> None:
        """Refuse ``1f1b`` with fewer micro-batches than stages, and a peer timeout
        (``direct.timeout_s``) below the plan's predicted step.

        Raises
        ------
        ValueError
            Saying how to fix it.
        """
        S, M = plan.num_stages, self.s.schedule.microbatches
        step = plan.plan.predicted_step_time_s
        if self.s.settings.direct.timeout_s < step:
            raise ValueError(
                f"direct.timeout_s={self.s.settings.direct.timeout_s:g} s (run config "
                f"direct-timeout-s) is below the plan's predicted step of {step:.3g} s: a "
                "peer still computing would be taken for a stalled one. Raise it well above "
                f"the step (at least {step:.3g} s)"
            )
        if plan_kind(plan, self.s.schedule) == "1f1b" and M < S:
            raise ValueError(
                f"schedule.kind=1f1b needs at least as many micro-batches as stages: the "
                f"plan has {S} stages, schedule.microbatches={M}. Raise "
                f"schedule.microbatches to >= {S} (dividing schedule.batch_size) or use "
                "schedule.kind=gpipe"
            )

    @property
    def silence_s(self) -> float:
        """``direct.timeout_s``: the stages' peer timeout."""
        return self.s.settings.direct.timeout_s

    def host(self, plan: Pipeline) -> RoundHost:
        """The rendezvous of ``plan``'s stages (not yet started), NCCL where every stage
        is on a GPU (:func:`~sky_flower.pipeline.device.direct_backend`)."""
        d = self.s.settings.direct
        backend = direct_backend([d for _, d in plan.devices], [h for h, _ in plan.devices])
        return RoundHost(plan.num_stages, d.timeout_s, d.host, d.join_timeout_s, backend)

    def setup_round(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> RoundOutcome:
        """Host the rendezvous, run the round on the stages, merge their weights. An
        error names the stage(s) that failed or did not answer first, then those that
        stopped waiting for them; ``nodes`` holds only the former."""
        budget = self.stage_budget(plan, steps)
        ex = self.s.exchange(grid, timeout_s=budget)
        t0 = time.perf_counter()
        with self.host(plan) as host:
            ids = ex.push(self.configure(plan, arrays, steps, server_round, host))
            got = self.collect(ex, ids)
        wall = time.perf_counter() - t0
        self.raise_failures(ex, plan, [reply_status(got.get(m)) for m in ids], budget)
        return self.parse(ex, plan, [got[m] for m in ids], arrays, steps, wall)

    def configure(
        self, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int, host: RoundHost
    ) -> list[Message]:
        """One ``train.sky_direct`` message per stage: :class:`DirectConfig` and its
        weights."""
        full = arrays.to_torch_state_dict()
        stages, session = plan.plan.stages, P.new_session()
        bounds = [(st.first_layer, st.last_layer) for st in stages]
        shapes = stage_input_shapes(
            self.s.model_fn, list(self.s.input_shape), bounds, self.s.input_dtype
        )

        def link(k: int) -> tuple[float, float]:
            return plan.links[k] if 0 <= k < len(stages) else (0.0, 0.0)

        kind = plan_kind(plan, self.s.schedule)
        chunked = chunk_plan(plan, self.s, S=len(stages))
        msgs = []
        for k, st in enumerate(stages):
            (lat, bw), (nlat, nbw), (plat, pbw) = link(k), link(k + 1), link(k - 1)
            cfg = P.DirectConfig(
                stage=stage_config(self.s, k, st.first_layer, st.last_layer, server_round, session),
                rendezvous=host.rendezvous(k),
                links=P.DirectLinks(lat, bw, nlat, nbw, plat, pbw),
                kind=kind,
                steps=steps,
                input_shape=tuple(shapes[k]),
                node_id=plan.node_ids[k],
                input_dtype=self.s.input_dtype if k == 0 else "float32",  # activations
                **(chunked[k] if chunked else {}),
            )
            weights = ArrayRecord(stage_weights(full, chunked[k] if chunked else None, st))
            content = {P.ARRAYS: weights, P.CONFIG: cfg.to_config_record()}
            content.update(migrated_state(self.s, plan, k))  # train.optimizer_state=keep
            msgs.append(message(plan.node_ids[k], P.DIRECT, content, str(server_round)))
        return msgs

    def collect(self, ex: Exchange, ids: Sequence[str]) -> dict[str, Message]:
        """Every stage's reply, or those that came before the deadline (a stage's error
        shortens the others' deadlines to ``direct.timeout_s`` + 5 s)."""
        got: dict[str, Message] = {}
        while len(got) < len(ids):
            for reply in ex.poll(ids, raise_late=False):
                got[reply.metadata.reply_to_message_id] = reply
                if reply.has_error():  # the others stop within direct.timeout_s
                    ex.shorten(self.silence_s + 5.0)
            if ex.late(ids):  # the missing ones are named by the caller
                return got
            if len(got) < len(ids) and ex.poll_interval_s > 0:
                time.sleep(ex.poll_interval_s)
        return got

    @staticmethod
    def raise_failures(
        ex: Exchange, plan: Pipeline, statuses: Sequence[tuple[str, str]], budget: float
    ) -> None:
        """Raise one error naming the stages that failed or stayed silent, then those
        that stopped because of them (``nodes``: the former only). ``statuses``: per
        stage, :func:`reply_status`'s ``(kind, text)``."""
        culprits, waited, causes = [], [], []
        for k, (kind, text) in enumerate(statuses):
            nid = plan.node_ids[k]
            who = f"stage {k} on {ex.name(nid)}"
            if kind == "missing":
                culprits.append(f"{who} did not answer within {budget:g} s")
                causes.append(nid)
            elif kind == "failed":
                peer = PEER_FAILURE in text
                (waited if peer else culprits).append(f"{who} failed: {text}")
                if not peer:
                    causes.append(nid)
            elif kind == "raised":  # the stage's own error, not the node's
                culprits.append(f"{who} raised {text}")
        if culprits or waited:
            raise ex.fail("; ".join(culprits + waited), causes or None)

    def parse(
        self,
        ex: Exchange,
        plan: Pipeline,
        replies: list[Message],
        arrays: ArrayRecord,
        steps: int,
        wall: float,
    ) -> RoundOutcome:
        """Check and merge the stages' replies (weights of the shapes sent, metrics for
        every step).

        Raises
        ------
        SkyNodeError
            Naming the node whose reply is malformed (or, for a reply malformed
            otherwise, the error).
        """
        try:
            return self._parse(ex, plan, replies, arrays, steps, wall)
        except (KeyError, TypeError, ValueError, IndexError) as err:  # a malformed reply
            raise ex.fail(f"a stage sent a malformed reply: {type(err).__name__}: {err}") from err

    def _parse(  # noqa: PLR0913
        self,
        ex: Exchange,
        plan: Pipeline,
        replies: list[Any],
        arrays: ArrayRecord,
        steps: int,
        wall: float,
    ) -> RoundOutcome:
        sent = {k: tuple(v.shape) for k, v in arrays.items()}
        metrics, slept = [], []
        for reply in replies:
            src = reply.metadata.src_node_id
            rec = reply.content.array_records.get(P.ARRAYS)
            for key in rec.keys() if rec is not None else ():
                if key not in sent or tuple(rec[key].shape) != sent[key]:
                    raise ex.fail(
                        f"{ex.name(src)}: weight {key!r} has shape {tuple(rec[key].shape)}, "
                        f"expected {sent.get(key)}",
                        [src],
                    )
            try:
                rec = reply.content.metric_records.get(P.METRICS)
                metrics.append(P.DirectMetrics.from_record(rec))
                slept.append(rec.get(EMULATED_S) if rec is not None else None)
            except P.ProtocolError as err:
                raise ex.fail(f"{ex.name(src)}: reply lacks metrics ({err})", [src]) from err
        new_arrays, sent, full = self.merge(replies, ex, arrays)
        check_stages(ex, plan, replies)  # finite or rejected (sky_flower.sky.transport.guard)
        outcome = self.outcome(ex, plan, new_arrays, metrics, steps, wall, slept)
        outcome.weights_bytes, outcome.full_weights_bytes = sent, full
        if self.s.optimizer_store is not None:  # each layer's state, for the next set-up
            self.s.optimizer_store.put(plan.plan.stages[0].node, optimizer_records(ex, replies))
        return outcome

    def outcome(
        self,
        ex: Exchange,
        plan: Pipeline,
        new_arrays: ArrayRecord,
        metrics: list[P.DirectMetrics],
        steps: int,
        wall: float,
        slept: list | None = None,
    ) -> RoundOutcome:
        """The round's outcome from the stages' metrics (the last stage's losses);
        ``slept``: per stage, the seconds its emulated slowdown slept where it said (its
        slowdown this round), else its compute times the benchmark's slowdown."""
        S, last = plan.num_stages, metrics[-1]
        times = np.array([list(m.step_times_s) for m in metrics], dtype=float)
        if times.shape != (S, steps) or len(last.losses) != steps:
            raise ex.fail(
                f"stages reported {times.shape} step times and {len(last.losses)} losses "
                f"for {S} stages x {steps} steps"
            )
        M = self.s.schedule.microbatches
        stages = [
            StageRecord(
                stage=k,
                node=st.node,
                measured_compute_s=(
                    m.compute_s + slept[k]
                    if slept and slept[k] is not None
                    else m.compute_s * (1.0 + plan.slowdowns[k])
                )
                / steps,
                predicted_compute_s=M * st.compute_s,
                median_step_s=float(np.median(times[k])),
            )
            for k, (st, m) in enumerate(zip(plan.plan.stages, metrics, strict=True))
        ]
        return RoundOutcome(
            arrays=new_arrays,
            losses=list(last.losses),
            correct=last.correct,
            seen=last.n,
            step_times=[float(t) for t in times.max(axis=0)],
            stages=stages,
            extra={"setup_s": max(m.setup_s for m in metrics), "wall_s": wall},
        )

    # -- stage sessions (sky_flower.sky.transport.session) ------------------------------
    def session_key(self, plan: Pipeline) -> SessionKey:
        """What a session is set up for: a round whose pipeline differs needs another
        (nodes, stage configs without the round, schedule, chunks, links)."""
        stages = tuple(
            stage_config(self.s, k, st.first_layer, st.last_layer, 0, 0)
            for k, st in enumerate(plan.plan.stages)
        )
        chunks = chunk_plan(plan, self.s, S=plan.num_stages)
        kind = plan_kind(plan, self.s.schedule)
        setup = (stages, kind, str(chunks), tuple(plan.links), self.s.input_dtype)
        return SessionKey(plan.node_ids, setup)

    def open_session(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> StreamSession:
        """Set a session up (:meth:`EndpointWaits.host_session`): host its rendezvous (a
        TCPStore for the session's life) and push one ``train.sky_direct`` per stage with
        a :data:`~sky_flower.sky.protocol.SESSION` record, the stage's control link.

        Raises
        ------
        SkyNodeError
            Naming the stages that did not join or whose set-up failed (the store is
            closed too).
        """
        host, silence = self.host(plan), self.silence_s

        def messages(ep: Endpoint, life: float) -> list[Message]:
            msgs = self.configure(plan, arrays, steps, server_round, host)
            for k, msg in enumerate(msgs):
                link = P.SessionLink(ep.link(k, life + silence), silence)
                msg.content[P.SESSION] = link.to_config_record()
            return msgs

        return self.host_session(grid, plan, steps, messages, host)

    def session_work(  # noqa: PLR0913
        self,
        session: StreamSession,
        plan: Pipeline,
        arrays: ArrayRecord,
        steps: int,
        server_round: int,
    ) -> RoundOutcome:
        """``begin`` to every stage with the changed weights, the steps peer to peer in
        the session's process group, every stage's ``end`` frame (a round that fails
        ends its session: its group is unusable)."""
        budget = self.stage_budget(plan, steps)
        full, chunked = arrays.to_torch_state_dict(), chunk_plan(plan, self.s, S=plan.num_stages)
        slices = [
            stage_weights(full, chunked[k] if chunked else None, st)
            for k, st in enumerate(plan.plan.stages)
        ]
        release = [nid in self.s.sessions.shared for nid in plan.node_ids]
        t0 = time.perf_counter()
        self.send_begins(session, plan, slices, server_round, steps, release)
        statuses, replies = self.round_frames(session, plan, server_round, budget)
        wall = time.perf_counter() - t0
        self.raise_failures(session.ex, plan, statuses, budget)
        out = self.parse(session.ex, plan, replies, arrays, steps, wall)
        session.keep(replies, release)
        return out

    def round_frames(
        self, session: StreamSession, plan: Pipeline, server_round: int, budget: float
    ) -> tuple[list[tuple[str, str]], list[FrameReply]]:
        """Every stage's ``end`` frame of round ``server_round``, within ``budget``
        (after a stage's failure, ``direct.timeout_s`` + 5 s more for the others: they
        stop within the group's timeout). Per stage :func:`reply_status`'s ``(kind,
        text)``, and the replies (all of them when every stage is ``ok``).

        Raises
        ------
        SkyNodeError
            Naming the stage that sent a frame other than its ``end`` of the round.
        """
        ex, ep, S = session.ex, session.ep, plan.num_stages
        statuses: dict[int, tuple[str, str]] = {}
        replies: dict[int, FrameReply] = {}
        until = time.perf_counter() + budget
        while len(statuses) < S and time.perf_counter() < until:
            if self.s.stop.is_set():
                raise ex.fail("the run was stopped")
            try:
                k, header, records, reason = ep.inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            nid = plan.node_ids[k]
            if header is None:  # its control stream ended: the node's process is gone
                statuses.setdefault(k, ("failed", f"its control stream ended: {reason}"))
            elif header.get("op") != "end" or int(header.get("round", -1)) != server_round:
                raise ex.fail(
                    f"stage {k} on {ex.name(nid)} sent a frame that is not its end of "
                    f"round {server_round} ({header})",
                    [nid],
                )
            elif k in statuses:
                continue  # after its stream ended (cannot send) or a second end: the first counts
            else:
                reply = FrameReply(records, FrameMeta(nid, "direct frame end", ""))
                if P.STAGE_ERROR in records.config_records:  # its own error
                    statuses[k] = reply_status(reply)
                elif header.get("error"):  # a peer's failure, a fault: its group is gone
                    statuses[k] = ("failed", str(header["error"]))
                else:
                    statuses[k], replies[k] = ("ok", ""), reply
            if statuses[k][0] != "ok":  # the others stop within the group's timeout
                until = min(until, time.perf_counter() + self.silence_s + 5.0)
        out = [statuses.get(k, ("missing", "")) for k in range(S)]
        return out, [replies[k] for k in range(S) if k in replies]
