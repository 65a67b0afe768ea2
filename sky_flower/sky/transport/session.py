"""Stage sessions on the ``stream`` transport: one Flower message per stage node per
plan, every round driven over the session's stream. (``direct`` runs them too, its
stages' process group living as long: :mod:`sky_flower.sky.transport.direct`; what
follows says ``stream``'s.)

Flower 1.42 charges a deployed message seconds (a fresh ``flwr-clientapp`` process per
message, a SuperNode that sleeps 3 s after an empty pull), but a message may run as long
as its TTL (``flwr.app.DEFAULT_TTL``, 12 h). A session spends the set-up message once:

1. the first round of a plan (per data owner's pipeline) hosts an endpoint
   (:class:`sky_flower.sky.transport.channel.Endpoint`, a fresh certificate and fresh
   tickets: a ticket admits one session) and pushes one ``train.sky_stream`` message per
   stage with ``across_rounds`` (:class:`sky_flower.sky.protocol.StreamConfig`): the
   stage's layer slice, and its optimizer state under ``train.optimizer_state=keep``;
2. every round, the server sends each stage ``begin`` (the round, its steps, and the
   entries of the stage's slice of the round's global model that differ, bit for bit,
   from what the stage holds: after FedAvg across data owners, most of them; with one
   data owner, none), runs the steps over the streams exactly as a per-round set-up does
   (:class:`sky_flower.sky.transport.stream.StreamRunner`), then ``end``: each stage
   answers with an ``end`` frame holding its trainable weights and buffers and (keep)
   its optimizer state. FedAvg and evaluation follow on the server, as every round;
3. the session ends (``close``; its Flower replies come then, one per stage) when the
   plan of its pipeline changes (re-planning, a join, a dropped node), when a round of
   it fails (then at once: its endpoint closes, its stages' messages end with an error
   and are no longer waited for), when the run ends, or at a round's start when it
   could outlive ``stream.session_max_s`` or Flower's TTL: it hands over to a
   fresh session, which loses nothing because the server holds every stage's state at
   each round's end.

A node in several pipelines: deployed, a Flower 1.42 SuperNode handles one message at a
time (``supernode/start_client_internal.py``: ``_push_messages`` waits for a message's
reply before the next pull), so a node running a session takes no other message and
cannot hold two. The pipelines that share a node therefore set up every round
(:meth:`StreamSessions.usable_for`, ``per_node=1``), and a session whose pipeline's
nodes change ends before any new one is set up (:meth:`StreamSessions.retain`). The
simulation engine runs two messages to one node on two workers (``per_node=None``, the
Hydra job): there a shared node runs one session per pipeline at once and, as the plan
runs those pipelines one after another, each stage frees its layers after its round's
``end`` and is rebuilt from the next ``begin``'s whole slice (the node holds one
pipeline's stage at a time, as the planner's memory budget assumes). Session messages
are pushed ``concurrent`` (:meth:`sky_flower.flower.exchange.Exchange.push`) so that
they do not hold back other messages to their nodes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import DEFAULT_TTL, Message

from sky_flower.flower.exchange import Exchange
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.channel import Endpoint, StreamError

TTL_MARGIN_S = 600.0  # a session ends this long before its messages' TTL at the latest


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (dtype, shape, every byte: ``-0.0``
    and ``0.0`` differ, a NaN equals itself)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
        b.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
    )


@dataclass(frozen=True)
class SessionKey:
    """What a session is set up for: a round whose pipeline differs needs another.

    Attributes
    ----------
    nodes : tuple of int
        The stages' Flower node ids, shape (S,).
    setup : tuple
        The rest of the set-up, as the runner builds it (the stage configs without the
        round, the schedule, the links, ...).
    """

    nodes: tuple[int, ...]
    setup: tuple[Any, ...]


@dataclass
class StreamSession:
    """One pipeline's live session: its endpoint, the Exchange of its set-up messages,
    and what each stage holds.

    Attributes
    ----------
    key : SessionKey
        What the session was set up for: a round whose pipeline differs needs a new
        session.
    ep : Endpoint
        The session's endpoint (its streams, tickets, certificate).
    ex : Exchange
        The Exchange the set-up messages were pushed on (their replies come at close).
    ids : list of str
        The set-up messages' ids, shape (S,).
    held : list of dict
        Per stage, the model entries it holds (name -> tensor, CPU): what the set-up
        sent, updated by every round's ``end`` frame.
    released : list of bool
        Per stage, whether it freed its layers after the last round (``release``): the
        next ``begin`` rebuilds it from the whole slice.
    opened_s, ends_s : float
        ``time.monotonic()`` at the set-up and the stream call's deadline.
    rounds : int
        Rounds it has served.
    setup_s : float
        Seconds from the set-up messages' push until every stage had joined.
    got : dict
        Flower replies of its set-up messages that have come (an error ends it).
    host : RoundHost or None
        ``direct``: the session's rendezvous (its TCPStore), closed with it.
    """

    key: SessionKey
    ep: Endpoint
    ex: Exchange
    ids: list[str]
    held: list[dict[str, torch.Tensor]]
    released: list[bool]
    opened_s: float
    ends_s: float
    rounds: int = 0
    setup_s: float = 0.0
    got: dict[str, Message] = field(default_factory=dict)
    host: Any = None

    def fits(self, budget_s: float, timeout_s: float, max_age_s: float) -> bool:
        """Whether a round of ``budget_s`` (plus the silence bound ``timeout_s``) ends
        before the stream call's deadline and the session is younger than
        ``max_age_s``."""
        now = time.monotonic()
        return now - self.opened_s < max_age_s and now + budget_s + timeout_s < self.ends_s

    def changed(self, k: int, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The ``entries`` of stage ``k``'s slice whose bits differ from what it holds."""
        held = self.held[k]
        return {n: v for n, v in entries.items() if n not in held or not same_bits(v, held[n])}

    def keep(self, replies: list[Any], release: list[bool]) -> None:
        """After a round: what each stage holds now (its ``end`` reply's weights; nothing
        where it released its layers, so the next ``begin`` rebuilds it), and one round
        more served."""
        for k, reply in enumerate(replies):
            self.released[k] = release[k]
            if release[k]:
                self.held[k] = {}
            else:
                self.held[k].update(reply.content.array_records[P.ARRAYS].to_torch_state_dict())
        self.rounds += 1

    def close(self, graceful: bool, deadline_s: float) -> int:
        """End the session: ``close`` to every stage and their Flower replies within
        ``deadline_s`` (graceful), else (or when they do not come) the set-up messages
        are abandoned; the endpoint closes either way. Returns the replies pulled."""
        pulled = 0
        try:
            if graceful:
                for k in range(len(self.ids)):
                    try:
                        self.ep.send(k, {"op": "close"})
                    except StreamError:
                        pass
                until = time.monotonic() + deadline_s
                while len(self.got) < len(self.ids) and time.monotonic() < until:
                    for reply in self.ex.poll(self.ids, raise_late=False):
                        self.got[reply.metadata.reply_to_message_id] = reply
                    time.sleep(max(self.ex.poll_interval_s, 0.01))
                pulled = len(self.got)
        except Exception:  # noqa: BLE001, S110 - closing is best effort: abandoned below
            pass
        finally:
            self.ex.abandon()  # what has not come is no longer waited for
            self.ep.close()
            if self.host is not None:
                self.host.close()
        return pulled


class StreamSessions:
    """The run's live stage sessions, one per data owner's pipeline (thread-safe: each
    pipeline's runner takes its own, on its own thread).

    Parameters
    ----------
    max_age_s : float
        ``stream.session_max_s``: a session is handed over before this age.
    close_deadline_s : float
        How long a graceful close waits for the stages' Flower replies.
    capacity : int or None
        How many ClientApps the runtime runs at once (Flower's simulation engine: its
        workers, ``floor(CPUs / simulation.num_cpus_per_node)``); None: no bound (a
        deployment runs each message in a process of its own). Sessions hold one per
        stage of every pipeline for the whole run: a plan with more stages than this
        runs with a set-up per round instead (:meth:`usable`).
    per_node : int or None (default: 1)
        How many sessions one node runs at once. 1 deployed: Flower 1.42's SuperNode
        handles one message at a time (``supernode/start_client_internal.py``
        ``_push_messages`` waits for its reply before the next pull), so a node in
        several pipelines cannot hold a session for each, and no other message reaches
        a node while its session lives; the pipelines that share a node set their
        stages up every round instead (:meth:`usable_for`). None: no bound (the
        simulation engine runs two messages to one node on two workers).
    """

    def __init__(
        self,
        max_age_s: float,
        close_deadline_s: float,
        capacity: int | None = None,
        per_node: int | None = 1,
    ) -> None:
        self.max_age_s = min(max_age_s, DEFAULT_TTL - TTL_MARGIN_S)
        self.close_deadline_s = close_deadline_s
        self.capacity = capacity
        self.per_node = per_node
        self._by_owner: dict[str, StreamSession] = {}
        self._lock = threading.Lock()
        # Flower node ids that run stages of several pipelines: their stages free their
        # layers after each round (StreamSession's release), see the module docstring
        self.shared: set[int] = set()
        self.opened = 0  # sessions set up in the run

    def in_engine(self, workers: int) -> None:
        """The runtime is Flower's simulation engine, running ``workers`` ClientApps at
        once: that is :attr:`capacity`, and a node runs several sessions (the engine
        runs two messages to one node on two workers: ``per_node`` None)."""
        self.capacity, self.per_node = workers, None

    def take(self, owner: str) -> StreamSession | None:
        """``owner``'s session, out of the pool while a round uses it (None: none)."""
        with self._lock:
            return self._by_owner.pop(owner, None)

    def put(self, owner: str, session: StreamSession) -> None:
        """Give ``owner``'s session back after a round it served."""
        with self._lock:
            self._by_owner[owner] = session

    def end(self, session: StreamSession, graceful: bool) -> int:
        """Close ``session`` (see :meth:`StreamSession.close`); replies pulled."""
        return session.close(graceful, self.close_deadline_s)

    def ready(
        self,
        owner: str,
        key: SessionKey,
        fits: Callable[[StreamSession], bool],
        open_session: Callable[[], StreamSession],
    ) -> tuple[StreamSession, int, float]:
        """``owner``'s session for a round (out of the pool until :meth:`put` back): its
        own if it was set up for ``key`` and ``fits`` the round, else a fresh one from
        ``open_session`` (the old one closed first, gracefully).

        Returns
        -------
        (StreamSession, int, float)
            The session, the Flower messages this cost (replies pulled at a close, one
            set-up per stage) and the set-up's seconds (0 for a session reused).
        """
        messages, session = 0, self.take(owner)
        if session is not None and (session.key != key or not fits(session)):
            messages += self.end(session, graceful=True)
            session = None
        if session is not None:
            return session, messages, 0.0
        session = open_session()
        return session, messages + len(session.ids), session.setup_s

    def plan(self, node_ids: list[tuple[int, ...]]) -> None:
        """The round's pipelines (their stages' node ids): which nodes several share."""
        seen: set[int] = set()
        shared: set[int] = set()
        for ids in node_ids:
            shared |= seen & set(ids)
            seen |= set(ids)
        self.shared = shared

    def usable_for(self, node_ids: tuple[int, ...] | list[int]) -> bool:
        """Whether a pipeline of ``node_ids`` may run in a session: always with no
        bound per node, else only if none of its nodes is in another pipeline too
        (:attr:`shared`, from :meth:`plan`)."""
        return self.per_node is None or not set(node_ids) & self.shared

    def drop(self, owner: str) -> int:
        """End ``owner``'s session, if it has one (gracefully: its pipeline runs
        without one from now on); replies pulled."""
        session = self.take(owner)
        return 0 if session is None else self.end(session, graceful=True)

    def usable(self, stages: int) -> bool:
        """Whether sessions for ``stages`` stages (over every pipeline) fit the runtime's
        :attr:`capacity`."""
        return self.capacity is None or stages <= self.capacity

    def retain(self, nodes: dict[str, tuple[int, ...]]) -> None:
        """Close (gracefully) the sessions of data owners no longer planned and those
        whose pipeline's nodes changed (``nodes``: each planned owner's), before any new
        session is set up, so that no node is asked for a second session while an old
        one holds it."""
        with self._lock:
            gone = [
                o
                for o, s in self._by_owner.items()
                if o not in nodes or tuple(s.key.nodes) != tuple(nodes[o])
            ]
            ended = [self._by_owner.pop(o) for o in gone]
        for session in ended:
            self.end(session, graceful=True)

    def close_all(self) -> None:
        """Close every session (the run's end): no endpoint, port or thread is left."""
        self.retain({})

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_owner)
