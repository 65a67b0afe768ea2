"""The stream endpoint (:class:`sky_flower.sky.transport.channel.Endpoint`) against
connections that never send a hello: they cannot keep the real stages out, each is
dropped after ``hello_timeout_s``, the oldest goes first when too many are pending, and
nothing of the endpoint is left after ``close()``.

Real parts only: the endpoint's gRPC server with TLS on 127.0.0.1, the stages'
:class:`StageLink` and raw gRPC channels (each on its own connection) whose request
iterator blocks, so their call opens but no frame ever comes. Bounds are generous (a
loaded 2-core machine); the assertions are on outcomes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from sky_flower.sky.transport.channel import METHOD, Endpoint, connect
from sky_flower.sky.transport.stream_tls import SERVER_NAME

BOUND_S = 20.0  # every outcome within this (each is expected in well under a second)


class Silent:
    """``n`` calls to the endpoint, each on a connection of its own, that never send a
    frame (the request iterator blocks until :meth:`close`)."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.release = threading.Event()
        self.channels: list[grpc.Channel] = []
        self.calls: list[grpc.Call] = []

    def _blocked(self) -> Iterator[bytes]:
        self.release.wait(BOUND_S * 3)
        yield from ()

    def open(self) -> grpc.Call:
        """One more silent call (it returns once the call is started)."""
        creds = grpc.ssl_channel_credentials(root_certificates=self.ep.cert_pem.encode())
        opts = [
            ("grpc.ssl_target_name_override", SERVER_NAME),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        channel = grpc.secure_channel(self.ep.address, creds, options=opts)
        self.channels.append(channel)
        call = channel.stream_stream(METHOD)(self._blocked(), timeout=BOUND_S * 3)
        self.calls.append(call)
        return call

    def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()
        for channel in self.channels:
            channel.close()


def _until(what: Callable[[], bool], bound_s: float = BOUND_S) -> float:
    """Wait until ``what()`` holds; the seconds it took (fails past ``bound_s``)."""
    t0 = time.perf_counter()
    while not what():
        assert time.perf_counter() - t0 < bound_s, "not within the bound"
        time.sleep(0.02)
    return time.perf_counter() - t0


def _code(call: grpc.Call) -> grpc.StatusCode:
    """The call's status once it has ended (within the bound)."""
    _until(call.done)
    return call.code()


def _endpoint_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sky-stream")]


@pytest.fixture
def silent() -> Iterator[Callable[[Endpoint], Silent]]:
    made: list[Silent] = []

    def make(ep: Endpoint) -> Silent:
        made.append(Silent(ep))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _exchange(ep: Endpoint, num_stages: int) -> None:
    """The stages connect with their tickets, join, and a frame goes each way."""
    links = [connect(ep.link(k, BOUND_S), k) for k in range(num_stages)]
    try:
        assert ep.joined == set(range(num_stages))
        for k, link in enumerate(links):
            ep.send(k, {"op": "ping", "stage": k})
            header, _ = next(link.frames())
            assert header == {"op": "ping", "stage": k}
            link.send({"op": "pong", "stage": k})
        got = sorted(ep.inbox.get(timeout=BOUND_S)[:2] for _ in range(num_stages))
        assert got == [(k, {"op": "pong", "stage": k}) for k in range(num_stages)]
    finally:
        for link in links:
            link.close()


def test_silent_connections_do_not_keep_the_stages_out(silent):
    """32 calls that never send a hello (before: 6 kept both stages of a 2-stage
    endpoint out until DEADLINE_EXCEEDED): still pending (their deadline is far off),
    the two stages join at once and exchange a frame each way."""
    with Endpoint(2, tls=True, hello_timeout_s=60.0) as ep:
        attacker = silent(ep)
        for _ in range(32):
            attacker.open()
        _until(lambda: len(ep._pending) == 32)
        t0 = time.perf_counter()
        _exchange(ep, 2)
        assert time.perf_counter() - t0 < BOUND_S
        assert not any(call.done() for call in attacker.calls)  # still pending: not timed out
        assert ep.refused == []
        attacker.close()
    assert not _endpoint_threads()


def test_a_silent_connection_is_dropped_after_the_hello_timeout(silent):
    with Endpoint(1, tls=True, hello_timeout_s=1.0) as ep:
        t0 = time.perf_counter()
        call = silent(ep).open()
        assert _code(call) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.perf_counter() - t0 >= 0.9  # not before its timeout
        assert "no hello within 1 s" in call.details()
        _until(lambda: bool(ep.refused))
        assert ep.refused == ["a connection without a hello within 1 s"]
        _exchange(ep, 1)  # the endpoint still serves its stage
        assert ep.refused == ["a connection without a hello within 1 s"]


def test_over_the_pending_bound_the_oldest_is_dropped(silent):
    """At most ``max_pending`` calls wait for their hello: one more drops the oldest
    (never the newcomer), so a real stage, which sends its hello at once, gets in."""
    with Endpoint(2, tls=True, hello_timeout_s=60.0, max_pending=4) as ep:
        attacker = silent(ep)
        for n in range(6):  # one at a time: the server sees them in this order
            attacker.open()
            _until(lambda n=n: len(ep._pending) == min(n + 1, 4))
            if n >= 4:
                _until(lambda n=n: len(ep.refused) == n - 3)
        first, second, *rest = attacker.calls
        assert _code(first) == _code(second) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not any(call.done() for call in rest)
        assert (
            ep.refused
            == ["a connection without a hello, dropped for a newer one (over 4 pending)"] * 2
        )
        # stage 0's call, a fifth pending one, drops the oldest silent call and joins;
        # stage 1 then finds 3 pending (stage 0's hello came at once) and drops none
        _exchange(ep, 2)
        assert _code(rest[0]) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not any(call.done() for call in rest[1:])
        assert len(ep.refused) == 3


def test_close_leaves_no_thread_loop_or_port(silent):
    before = {t.ident for t in threading.enumerate()}
    with Endpoint(2, tls=True, hello_timeout_s=60.0) as ep:
        attacker = silent(ep)
        for _ in range(4):
            attacker.open()
        _until(lambda: len(ep._pending) == 4)
        link = connect(ep.link(0, BOUND_S), 0)
        assert ep.joined == {0}
        assert _endpoint_threads()
        loop, port = ep._loop, ep.port
    t0 = time.perf_counter()
    ep.close()  # again: idempotent
    assert time.perf_counter() - t0 < 1.0
    assert not _endpoint_threads()
    assert loop is not None and loop.is_closed()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    # the stage saw its stream end, the silent calls were ended by the endpoint
    assert list(link.frames()) == []
    assert all(_code(c) != grpc.StatusCode.OK for c in attacker.calls)
    link.close()
    attacker.close()
    # and nothing the endpoint started runs on (gRPC's poller thread included)
    _until(lambda: {t.ident for t in threading.enumerate()} <= before, 10.0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="hello_timeout_s"):
        Endpoint(1, hello_timeout_s=0)
    with pytest.raises(ValueError, match="max_pending"):
        Endpoint(1, max_pending=0)


def test_refusals_past_the_cap_are_counted_not_kept():
    """A run-long endpoint under a flood keeps its first refusals by name, then a count
    (``refused`` stays a list of str of bounded length)."""
    from sky_flower.sky.transport.channel import MAX_REFUSED

    ep = Endpoint(1, tls=False)
    for i in range(MAX_REFUSED + 44):
        ep._refuse(f"refusal {i}")
    assert len(ep.refused) == MAX_REFUSED
    assert ep.refused[: MAX_REFUSED - 1] == [f"refusal {i}" for i in range(MAX_REFUSED - 1)]
    assert ep.refused[-1] == "45 more connections refused"
