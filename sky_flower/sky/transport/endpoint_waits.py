"""The server's side of a stream endpoint (:class:`sky_flower.sky.transport.channel.
Endpoint`), for the runners that host one: ``stream`` (every hop a frame) and a
``direct`` stage session (its control streams): waiting on the stages' joins, frames and
Flower replies, and a stage session's hosting, round start and figures
(:class:`EndpointWaits`); frames dressed as Flower replies for the shared checks
(:class:`FrameReply`).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import DEFAULT_TTL, ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid

from sky_flower.flower.exchange import Exchange, short_reason
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.channel import Endpoint, StreamError
from sky_flower.sky.transport.hops import migrated_state
from sky_flower.sky.transport.runner import Pipeline, RoundOutcome
from sky_flower.sky.transport.session import TTL_MARGIN_S, SessionKey, StreamSession

FLOWER_POLL_S = 0.5  # how often a wait looks at the stages' Flower replies


@dataclass
class FrameMeta:
    src_node_id: int
    message_type: str
    reply_to_message_id: str


@dataclass
class FrameReply:
    """A stage's reply frame dressed as a Flower reply for the shared checks
    (:mod:`sky_flower.sky.transport.hops`, :mod:`sky_flower.sky.transport.guard`): ``content`` and
    ``metadata`` (``src_node_id``, ``message_type``, ``reply_to_message_id``)."""

    content: RecordDict
    metadata: FrameMeta = field(default_factory=lambda: FrameMeta(0, "", ""))

    def has_error(self) -> bool:
        """Never: a frame that fails is a stage error or a closed stream."""
        return False


class EndpointWaits:
    """Waiting on a round's or session's stream endpoint, for the runners that host
    one (:class:`StreamRunner`; a ``direct`` stage session's control streams,
    :class:`sky_flower.sky.transport.direct.DirectRunner`): the stages' joins, their
    frames, their Flower replies. Uses ``self.s`` (:class:`RunSettings`), ``self.got``
    (the Flower replies that came) and ``self._next_poll``."""

    s: Any
    got: dict[str, Message]
    _next_poll: float

    # -- waiting ---------------------------------------------------------------------
    def _flower(self, ex: Exchange, plan: Pipeline, ids: list[str], force: bool = False) -> None:
        """Look at the stages' Flower replies (every :data:`FLOWER_POLL_S`): an error
        reply (or a stage error) fails the round naming the stage."""
        now = time.perf_counter()
        if not force and now < self._next_poll:
            return
        self._next_poll = now + FLOWER_POLL_S
        for reply in ex.poll(ids, raise_late=False):
            self.got[reply.metadata.reply_to_message_id] = reply
        for k, mid in enumerate(ids):
            reply = self.got.get(mid)
            if reply is None:
                continue
            who = f"stage {k} on {ex.name(plan.node_ids[k])}"
            if reply.has_error():
                reason = short_reason(reply.error.reason)
                raise ex.fail(f"{who} failed: {reason}", [plan.node_ids[k]])
            if P.STAGE_ERROR in reply.content.config_records:
                error = reply.content.config_records[P.STAGE_ERROR].get("error")
                raise ex.fail(f"{who} raised {error}", [])

    def _inbound(
        self, ex: Exchange, ep: Endpoint, plan: Pipeline, ids: list[str], owing: list[int]
    ) -> tuple[int, dict[str, Any], RecordDict]:
        """The next frame, within ``stream.timeout_s``.

        Raises
        ------
        SkyNodeError
            Naming the stage whose stream closed, broke or sent a bad frame, whose Flower
            reply is an error, or the stages that owed a reply (``owing``) and stayed
            silent. A silent stage's node is blamed (dropped, as a node that stalls is)
            when it alone owed a reply: every other stage had answered what it was sent,
            so the silence is its own; when several owe, none is blamed.
        """
        waiting = ", ".join(f"stage {k} on {ex.name(plan.node_ids[k])}" for k in owing)
        silent = [plan.node_ids[owing[0]]] if len(owing) == 1 else None
        until = time.perf_counter() + self.s.settings.stream.timeout_s
        while True:
            if self.s.stop.is_set():
                raise ex.fail("the run was stopped")
            try:
                k, header, records, reason = ep.inbox.get(timeout=0.05)
            except queue.Empty:
                self._flower(ex, plan, ids)
                if time.perf_counter() > until:
                    raise ex.fail(
                        f"{waiting} sent nothing for {self.s.settings.stream.timeout_s:g} s "
                        "(stream-timeout-s)",
                        silent,
                    ) from None
                continue
            if header is None:  # the stream ended: its Flower reply may say why too
                raise ex.fail(self._ended(ex, plan, ids, k, str(reason)), [plan.node_ids[k]])
            return k, header, records  # type: ignore[return-value]

    def _ended(self, ex: Exchange, plan: Pipeline, ids: list[str], k: int, reason: str) -> str:
        """Why stage ``k``'s stream ended mid-round: the endpoint's reason, and its
        node's own (its Flower error reply) if it comes within 0.5 s."""
        text = f"stage {k} on {ex.name(plan.node_ids[k])}: {reason} mid-round"
        until = time.perf_counter() + FLOWER_POLL_S
        while ids[k] not in self.got and time.perf_counter() < until:
            for reply in ex.poll(ids, raise_late=False):
                self.got[reply.metadata.reply_to_message_id] = reply
            time.sleep(0.02)
        reply = self.got.get(ids[k])
        if reply is not None and reply.has_error():
            text += f" (the node: {short_reason(reply.error.reason)})"
        return text

    def join(self, ex: Exchange, ep: Endpoint, plan: Pipeline, ids: list[str]) -> None:
        """Wait until every stage has connected (``stream.timeout_s`` after the set-up
        messages arrived; a stage's error reply fails the round at once)."""
        until = time.perf_counter() + self.s.deadline("setup") + self.s.settings.stream.timeout_s
        while len(ep.joined) < plan.num_stages:
            self._flower(ex, plan, ids)
            if time.perf_counter() > until:
                missing = [
                    f"stage {k} on {ex.name(plan.node_ids[k])}"
                    for k in range(plan.num_stages)
                    if k not in ep.joined
                ]
                refused = f" (refused: {'; '.join(ep.refused)})" if ep.refused else ""
                raise ex.fail(
                    f"{', '.join(missing)} did not connect to the stream endpoint "
                    f"{ep.address}{refused}",
                    [plan.node_ids[k] for k in range(plan.num_stages) if k not in ep.joined],
                )
            time.sleep(0.01)

    def _send(  # noqa: PLR0913
        self,
        ex: Exchange,
        ep: Endpoint,
        plan: Pipeline,
        k: int,
        header: dict[str, Any],
        records: RecordDict | None = None,
    ) -> None:
        """A frame to stage ``k``; a stream that is gone fails the round by name."""
        try:
            ep.send(k, header, records)
        except StreamError as err:
            raise ex.fail(f"stage {k} on {ex.name(plan.node_ids[k])}: {err}") from err

    def stage_budget(self, plan: Pipeline, steps: int) -> float:
        """Seconds the stages' work of a round of ``steps`` steps may take (the
        ``stage`` deadline of the plan's predicted steps)."""
        return self.s.deadline("stage", steps * plan.plan.predicted_step_time_s)

    def run_round(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> RoundOutcome:
        """The round in ``plan``'s stage session (:meth:`session_round`) where it may
        run in one, else with a set-up of its own (:meth:`setup_round`; a pipeline with
        a node shared with another ends its session first): see
        :meth:`Runner.run_round`."""
        pool = self.s.sessions
        if pool is not None and pool.usable_for(plan.node_ids):
            return self.session_round(grid, plan, arrays, steps, server_round)
        if pool is not None:  # a node shared with another pipeline: set up every round
            pool.drop(plan.plan.stages[0].node)
        return self.setup_round(grid, plan, arrays, steps, server_round)

    # -- the runner's own --------------------------------------------------------------
    silence_s: float  # a stage silent this long while it owes a frame has failed

    def setup_round(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> RoundOutcome:
        """A round set up for itself alone (its own set-up messages)."""
        raise NotImplementedError

    def session_key(self, plan: Pipeline) -> SessionKey:
        """What a session is set up for: a pipeline that differs needs another."""
        raise NotImplementedError

    def open_session(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> StreamSession:
        """Set ``plan``'s session up (through :meth:`host_session`)."""
        raise NotImplementedError

    def session_work(  # noqa: PLR0913
        self,
        session: StreamSession,
        plan: Pipeline,
        arrays: ArrayRecord,
        steps: int,
        server_round: int,
    ) -> RoundOutcome:
        """A round's work in ``session`` (its begins, steps and ends;
        ``session.keep`` at the end)."""
        raise NotImplementedError

    # -- a stage session (sky_flower.sky.transport.session) -----------------------------

    def host_session(
        self,
        grid: Grid,
        plan: Pipeline,
        steps: int,
        messages: Callable[[Endpoint, float], list[Message]],
        host: Any = None,  # noqa: ANN401 - direct: the session's RoundHost
    ) -> StreamSession:
        """Host a session's endpoint, push its set-up messages (``messages(endpoint,
        life_s)``, one per stage, each carrying the stage's layer slice under
        :data:`~sky_flower.sky.protocol.ARRAYS`), wait until every stage has joined.
        The session's calls live ``life_s``: its maximum age plus two rounds of the
        stage budget of ``steps`` steps, below Flower's TTL; its Exchange waits
        :attr:`silence_s` longer.

        Raises
        ------
        SkyNodeError
            Naming the stages that did not join or whose set-up failed (the endpoint
            and ``host`` are closed and the messages abandoned).
        """
        s, pool = self.s, self.s.sessions
        life = min(pool.max_age_s + 2 * self.stage_budget(plan, steps), DEFAULT_TTL - TTL_MARGIN_S)
        ex = s.exchange(grid, timeout_s=life + self.silence_s)
        t0 = time.perf_counter()
        ep = None
        try:
            ep = Endpoint(plan.num_stages, **s.stream_endpoint()).__enter__()
            msgs = messages(ep, life)
            ids = ex.push(msgs, concurrent=True)
            session = StreamSession(
                key=self.session_key(plan),
                ep=ep,
                ex=ex,
                ids=ids,
                held=[m.content.array_records[P.ARRAYS].to_torch_state_dict() for m in msgs],
                released=[False] * plan.num_stages,
                opened_s=time.monotonic(),
                ends_s=time.monotonic() + life,
                host=host,
            )
            self.got, self._next_poll = session.got, 0.0
            self.join(ex, ep, plan, ids)
        except BaseException:
            ex.abandon()
            if ep is not None:
                ep.close()
            if host is not None:
                host.close()
            raise
        session.setup_s = time.perf_counter() - t0
        pool.opened += 1
        return session

    def send_begins(  # noqa: PLR0913
        self,
        session: StreamSession,
        plan: Pipeline,
        slices: list[dict[str, Any]],
        server_round: int,
        steps: int,
        release: list[bool] | None = None,
    ) -> None:
        """Each stage's ``begin`` of round ``server_round``: its ``steps`` and the entries
        of its slice of the round's global model (``slices[k]``) whose bits differ from
        what it holds; where it released its layers after its last round (``rebuild``),
        the whole slice and (``train.optimizer_state=keep``) its optimizer state;
        ``release`` (``direct``: known at the round's start) where given."""
        ex, ep = session.ex, session.ep
        for k in range(plan.num_stages):
            changed, rebuild = session.changed(k, slices[k]), session.released[k]
            header = {"op": "begin", "round": server_round, "steps": steps, "rebuild": rebuild}
            if release is not None:
                header["release"] = release[k]
            content: dict[str, Any] = {}
            if changed or rebuild:
                content[P.ARRAYS] = ArrayRecord(changed)
            if rebuild:
                content.update(migrated_state(self.s, plan, k))
            self._send(ex, ep, plan, k, header, RecordDict(content) if content else None)
            session.held[k].update(changed)

    def session_round(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> RoundOutcome:
        """Round ``server_round`` of ``plan`` in its pipeline's stage session: the
        session (:meth:`StreamSessions.ready`: reused if set up for this pipeline and
        young enough for a round of the stage budget plus :attr:`silence_s`, else a
        fresh one from :meth:`open_session`), the round's :meth:`session_work`, then
        the session back in the pool and the round's session figures in ``extra``: the
        set-up's seconds (0 when reused) and its prediction (charged to the round that
        set the session up), the Flower messages the round cost, the session's round,
        the wall time; the outcome as a per-round set-up's. A round that fails ends its
        session at once."""
        pool = self.s.sessions
        owner = plan.plan.stages[0].node
        budget = self.stage_budget(plan, steps)
        t_start = time.perf_counter()
        session = None
        try:
            session, messages, setup_s = pool.ready(
                owner,
                self.session_key(plan),
                lambda old: old.fits(budget, self.silence_s, pool.max_age_s),
                lambda: self.open_session(grid, plan, arrays, steps, server_round),
            )
            session.ex.grid = grid  # this round's (locked) grid
            self.got, self._next_poll = session.got, 0.0
            out = self.session_work(session, plan, arrays, steps, server_round)
        except BaseException:
            if session is not None:
                pool.end(session, graceful=False)
            raise
        pool.put(owner, session)
        out.extra.update(
            setup_s=setup_s,
            flower_messages=messages,
            session_round=session.rounds,
            wall_s=time.perf_counter() - t_start,
            predicted_setup_s=plan.setup_s if setup_s > 0 else 0.0,
        )
        return out
