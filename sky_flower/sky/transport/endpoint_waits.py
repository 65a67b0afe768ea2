"""The server's side of a stream endpoint (:class:`sky_flower.sky.transport.channel.
Endpoint`), for the runners that host one: ``stream`` (every hop a frame) and a
``direct`` stage session (its control streams): waiting on the stages' joins, frames and
Flower replies (:class:`EndpointWaits`), and frames dressed as Flower replies for the
shared checks (:class:`FrameReply`).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, RecordDict

from sky_flower.flower.exchange import Exchange, short_reason
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.channel import Endpoint, StreamError
from sky_flower.sky.transport.runner import Pipeline

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
        """The next frame, within ``stream_timeout_s``.

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
        """Wait until every stage has connected (``stream_timeout_s`` after the set-up
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
