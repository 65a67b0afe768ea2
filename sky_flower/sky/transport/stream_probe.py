"""A node's stream link, measured over the data plane itself (``transport=stream``).

The server hosts an endpoint (:class:`sky_flower.sky.transport.channel.Endpoint`) and sends the
node one ``query.sky_stream_echo`` (:class:`~sky_flower.sky.protocol.StreamLink`); the
node connects outbound as a stage does and answers every ``echo`` frame with a payload
of the size the frame asks for (its emulated link slept per frame, as a stage's is:
:func:`echo_frames`). The server times round trips of three kinds (``small`` both
ways; ``big`` down, ``small`` up; ``small`` down, ``big`` up), the median of
``repeats`` each after one untimed warm-up (:func:`probe_link`):

* latency ``lat`` = the small round trip (what one op frame and its reply cost);
* bandwidth down ``(big - small) / (t_down - lat)``, up ``(big - small) / (t_up - lat)``
  (bytes/s; ``inf`` when the difference is below the clock's resolution).

The Flower overhead (the echo message and its reply) is not in these figures: it is
paid once per round, by the set-up and weights messages.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from sky_flower.emulation.devices import Emulation
from sky_flower.flower.exchange import Exchange
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.channel import Endpoint, connect
from sky_flower.sky.transport.runner import message

FRAMES = "frames"


def _payload(nbytes: int) -> RecordDict:
    return RecordDict(
        {P.PAYLOAD: ArrayRecord({"p": torch.zeros(max(nbytes, 1), dtype=torch.uint8)})}
    )


def echo_frames(link: P.StreamLink, emu: Emulation) -> RecordDict:
    """Node side of ``query.sky_stream_echo``: connect, answer every ``echo`` frame
    with ``reply_bytes`` bytes (after the emulated link's delay for the bytes both
    ways) until ``end``; the number of frames answered.

    Raises
    ------
    StreamRefusedError, StreamError
        As :class:`sky_flower.sky.transport.channel.StageLink`.
    """
    conn = connect(link, 0)
    frames = 0
    try:
        for header, records in conn.frames():
            if header.get("op") == "end":
                break
            reply = _payload(int(header.get("reply_bytes", 1)))
            nbytes = sum(r.count_bytes() for r in (*records.values(), *reply.values()))
            delay = emu.link_delay_s(nbytes)
            if delay > 0:
                time.sleep(delay)
            conn.send({"op": "echo", "seq": header.get("seq")}, reply)
            frames += 1
    finally:
        conn.close()
    return RecordDict({P.METRICS: MetricRecord({FRAMES: frames})})


@dataclass
class StreamLinkFigures:
    """A node's stream link: ``latency_s`` (small round trip), ``down_bps`` /
    ``up_bps`` (bytes/s, server to node / node to server), every timed round trip,
    ``rtts[(down_bytes, up_bytes)]``, ``join_s``, from the probe's Flower message's
    push until the node had connected to the endpoint: what a stage session's set-up
    costs but for its weights (seconds), and ``reply``, that message's Flower reply."""

    latency_s: float
    down_bps: float
    up_bps: float
    rtts: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    join_s: float = 0.0  # the probe's Flower message pushed until its stage joined
    reply: Message | None = None  # that message's Flower reply

    @property
    def bandwidth_bps(self) -> float:
        """One figure for the cost model, which charges a node's bytes in and out on one
        bandwidth: the harmonic mean of down and up."""
        inv = 0.5 * (1.0 / self.down_bps + 1.0 / self.up_bps)
        return 1.0 / inv if inv > 0 else float("inf")


def probe_link(  # noqa: PLR0913
    ex: Exchange,
    node_id: int,
    endpoint: Callable[[int], Endpoint],
    sizes: tuple[int, int] = (1024, 4 << 20),
    repeats: int = 7,
    group: str = "echo",
    timeout_s: float = 60.0,
    extra: tuple[tuple[int, int], ...] = (),
    carrier: tuple[str, dict[str, Any]] | None = None,
) -> StreamLinkFigures:
    """Time node ``node_id``'s stream link (see the module docstring).

    ``endpoint(n)``: a fresh, not yet entered endpoint for ``n`` stages (the run's
    stream settings). ``extra``: more ``(down, up)`` byte pairs to time (in ``rtts``
    only, e.g. ``(big, big)`` to set against a Flower echo). ``carrier``: the message
    type and content of another message that carries the link (under
    :data:`~sky_flower.sky.protocol.LINK`; the node answers the echoes first, e.g. the
    benchmark round's ``query.sky_profile``), instead of a ``query.sky_stream_echo``;
    its reply is ``reply``. Bounded: the node must connect and answer each frame within
    ``timeout_s``.

    Raises
    ------
    SkyNodeError
        Naming the node, if it fails, does not connect or stops answering.
    """
    small, big = sizes
    who = ex.name(node_id)
    with endpoint(1) as ep:
        link = ep.link(0, timeout_s + 60.0).to_config_record()
        mtype, content = P.STREAM_ECHO, {P.CONFIG: link}
        if carrier is not None:
            mtype, content = carrier[0], {**carrier[1], P.LINK: link}
        t_push = time.perf_counter()
        (mid,) = ex.push([message(node_id, mtype, content, group)])
        until = time.perf_counter() + timeout_s
        while not ep.joined:
            for reply in ex.poll([mid], raise_late=False):
                ex.raise_errors([reply])
                raise ex.fail(f"{who} answered the stream echo without connecting", [node_id])
            if time.perf_counter() > until:
                raise ex.fail(f"{who} did not connect to the stream endpoint", [node_id])
            time.sleep(0.01)
        join_s = time.perf_counter() - t_push
        rtts: dict[tuple[int, int], list[float]] = {}
        seq = 0
        for down, up in ((small, small), (big, small), (small, big), *extra):
            times = []
            for i in range(repeats + 1):
                seq += 1
                t0 = time.perf_counter()
                ep.send(0, {"op": "echo", "reply_bytes": up, "seq": seq}, _payload(down))
                try:
                    _, header, _, reason = ep.inbox.get(timeout=timeout_s)
                except Exception as err:  # queue.Empty
                    raise ex.fail(f"{who} stopped answering stream echoes", [node_id]) from err
                if header is None:
                    raise ex.fail(f"{who}: {reason} during the stream echo", [node_id])
                if i > 0:  # the first: warm-up
                    times.append(time.perf_counter() - t0)
            rtts[(down, up)] = times
        ep.send(0, {"op": "end"})
        (reply,) = ex.wait([mid])
    lat = statistics.median(rtts[(small, small)])

    def rate(key: tuple[int, int]) -> float:
        dt = statistics.median(rtts[key]) - lat
        return (big - small) / dt if dt > 1e-6 else float("inf")

    return StreamLinkFigures(lat, rate((big, small)), rate((small, big)), rtts, join_s, reply)
