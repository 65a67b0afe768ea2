"""A stage's channels: where the ops it serves come from and where its replies go.

The node runs a pipeline stage's ops through one interpreter
(:func:`sky_flower.sky.node.stage_ops.answer_op`) over any :class:`StageChannel`, one
implementation per transport:

=================  ======================================================================
relay              :class:`MessageChannel`: one Flower message carries one op (its
                   :data:`~sky_flower.sky.protocol.MB` record the op's micro-batch
                   group, its records the op's inputs); the reply becomes the content of
                   the Flower reply. It lives for one message: the stage is rebuilt from
                   ``context.state`` for each op and saved back after it.
stream             :class:`StreamChannel`: a gRPC stream to the round's or the session's
                   endpoint (:class:`sky_flower.sky.transport.channel.StageLink`), one
                   frame per op and per reply. It lives for the ``train.sky_stream``
                   message that opened it: one round, or every round of a stage session
                   (``across_rounds``); the stage stays in memory meanwhile.
direct             no channel here: a ``direct`` stage runs torch's own schedule
                   interpreter (``torch.distributed.pipelining``: the schedule's
                   ``_Action`` list, point to point over gloo) for a whole round
                   (:mod:`sky_flower.sky.node.direct_node`), not Sky's stage code.
=================  ======================================================================

A stage session is a property of the channel (:attr:`StageChannel.across_rounds`); so is
where the node's emulated link delay is slept (:attr:`StageChannel.link_per_op`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flwr.app import RecordDict

from sky_flower.sky import protocol as P

if TYPE_CHECKING:
    from sky_flower.sky.transport.channel import StageLink

Header = dict[str, Any]


@runtime_checkable
class StageChannel(Protocol):
    """What a stage's ops travel over, as the interpreter sees it.

    An op is a header (``op``: ``"F"`` or ``"B"``; ``step``, ``first``, ``count``: the
    micro-batch group) and its records (``act``, ``labels``, ``label_total``, ``grad``:
    :func:`sky_flower.sky.node.stage_ops.run_op`); so is its reply.
    """

    #: whether the channel lives across rounds (a ``stream`` stage session: ``begin`` and
    #: ``close`` frames between the ops), rather than for the one Flower message that
    #: opened it (the relay's: one op; a per-round ``stream`` set-up's: one round)
    across_rounds: bool
    #: whether the interpreter sleeps the node's emulated link delay per op, on the bytes
    #: of the op and its reply (``stream``); else the transport emulates the link around
    #: its whole message (the relay's handler, every message type alike)
    link_per_op: bool

    def frames(self) -> Iterator[tuple[Header, RecordDict]]:
        """The frames that arrive, in order, until the channel ends.

        Raises
        ------
        StreamError
            ``stream``: if the stream breaks or a frame is malformed.
        """
        ...

    def send(self, header: Header, records: RecordDict) -> int:
        """Send a reply (``header`` as the op's, plus ``"error": True`` for a
        :data:`~sky_flower.sky.protocol.STAGE_ERROR`); its size in bytes."""
        ...

    def close(self) -> None:
        """End the channel (nothing more is received or sent)."""
        ...


class MessageChannel:
    """The relay's channel: the one op that a ``train.sky_forward`` /
    ``train.sky_backward`` message carries; its reply, :attr:`reply`, is the content of
    the Flower reply (the handler returns it).

    Parameters
    ----------
    op : {"F", "B"}
        The op the message's type names.
    content : RecordDict
        The message's content: its :data:`~sky_flower.sky.protocol.MB` group (the
        header's ``step``, ``first``, ``count``) and the op's input records.
    """

    across_rounds = False  # the channel lives for one message (one op)
    link_per_op = False  # the handler sleeps the link delay of every message, ops' included

    def __init__(self, op: str, content: RecordDict) -> None:
        self.op, self.content = op, content
        self.reply: RecordDict | None = None
        self._pending = True

    def frames(self) -> Iterator[tuple[Header, RecordDict]]:
        """The message's op, once: header ``{"op": op, **MB record}``, the content."""
        if not self._pending:
            return
        self._pending = False
        group = self.content.config_records.get(P.MB)
        yield {"op": self.op, **(dict(group) if group is not None else {})}, self.content

    def send(self, header: Header, records: RecordDict) -> int:
        """Keep ``records`` as the reply (the header travels in the Flower reply's
        metadata: it answers the message); the records' bytes.

        Raises
        ------
        RuntimeError
            On a second reply to the one message.
        """
        if self.reply is not None:
            raise RuntimeError("a relay message has one reply")
        self.reply = records
        return sum(rec.count_bytes() for rec in records.values())

    def close(self) -> None:
        """Nothing to close: the message ends with its reply."""
        self._pending = False


class StreamChannel:
    """The ``stream`` transport's channel: the frames of a stage's gRPC stream
    (:class:`sky_flower.sky.transport.channel.StageLink`: connected, its ticket sent).

    Parameters
    ----------
    link : StageLink
        The stage's link to its endpoint.
    across_rounds : bool
        Whether it serves a stage session (``begin`` / ``end`` per round until
        ``close``) or the one round of a per-round set-up (``StreamConfig``'s).
    """

    link_per_op = True  # each op's frames are the link's traffic

    def __init__(self, link: StageLink, across_rounds: bool) -> None:
        self.link, self.across_rounds = link, bool(across_rounds)

    def frames(self) -> Iterator[tuple[Header, RecordDict]]:
        """The endpoint's frames (:meth:`StageLink.frames`)."""
        return self.link.frames()

    def send(self, header: Header, records: RecordDict) -> int:
        """Queue a frame to the endpoint; its size in bytes."""
        return self.link.send(header, records)

    def close(self) -> None:
        """End this side of the stream and close the gRPC channel."""
        self.link.close()
