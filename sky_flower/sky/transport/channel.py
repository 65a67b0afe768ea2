"""The ``stream`` transport's data plane: a gRPC bidirectional stream per stage, hosted by
the ServerApp for one round or a whole stage session
(:mod:`sky_flower.sky.transport.session`), TLS with the certificate pinned by
fingerprint.

Flower bootstraps the trust: the round's ``train.sky_stream`` message to a stage (over
Flower's own authenticated channel) carries the endpoint's address, a fresh per-stage
ticket, the SHA-256 fingerprint of the endpoint's self-signed certificate and the
certificate itself (public). The stage's ClientApp connects **outbound** (it needs only
a route to the server, as Flower does), trusts exactly the certificate whose fingerprint
it was given (:func:`pinned`; anything else fails the TLS handshake), and sends its
ticket in its first frame; the endpoint refuses a wrong ticket before any tensor moves.

One RPC, ``/skyflower.Stream/Round``, stream-stream, raw bytes (a generic handler: no
generated code). A frame (:func:`encode`) is a little-endian ``uint32`` header length, a
JSON header (``op``, ``step``, ``first``, ``count``; the hello's ``stage`` and
``ticket``) and the frame's records as Flower's own protobuf ``RecordDict`` (tensors as
``ArrayRecord``, serialised exactly as a relay message carries them). A frame above
``max_frame_bytes`` is refused by name (:class:`FrameError`); one far above it (over the
cap plus :data:`SLACK_BYTES`) is cut by gRPC itself (``RESOURCE_EXHAUSTED``).

Connections that never present a ticket cannot keep the stages out. The certificate
authenticates the server, not the client: anyone who reaches the port can open calls.
The endpoint therefore runs gRPC's asyncio server (``grpc.aio``) on an event loop of its
own, in one daemon thread (``sky-stream-loop``) that :meth:`Endpoint.close` stops and
joins; an open call costs a coroutine, not a thread, so no number of idle calls can
exhaust a pool. A call must bring its hello within ``hello_timeout_s`` (else it ends with
``DEADLINE_EXCEEDED``), and at most ``max_pending`` calls wait for theirs: one more
drops the **oldest** waiting call (``RESOURCE_EXHAUSTED``), never the newcomer, so a
stage, which sends its hello with its call, gets in however many calls an attacker opens
and keeps opening (unless ``max_pending`` of them arrive between the stage's call and
its hello, which come in one flight). Both are recorded in :attr:`Endpoint.refused`. A
TLS handshake must end, and a connection with no call open is closed, within
``max(hello_timeout_s, 10 s)`` (:func:`_guard_options`). Frames are decoded on the loop,
one stage's after another. A thread pool, however big, gives each idle call a thread,
and the sync server has no way to time a first read out; hence the event loop. What
this does not stop: a flood that saturates the CPU, the network or the process's file descriptors (a
firewall's job), and a pending call may push one message up to the frame cap before it
is refused (gRPC buffers a message whole before the endpoint sees it).

Pure transport: no torch (:mod:`sky_flower.sky.transport.stream` and
:mod:`sky_flower.sky.node.stream_node` drive it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import queue
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from sky_flower.sky.transport.stream_tls import (
    SERVER_NAME,
    StreamError,
    StreamRefusedError,
    make_certificate,
    pinned,
)

METHOD = "/skyflower.Stream/Round"
SLACK_BYTES = 1 << 20  # gRPC's own cap: the frame cap plus this (headers, proto framing)
_HEADER = struct.Struct("<I")


class FrameError(StreamError):
    """A frame above the size cap, or one that does not decode."""


# --- frames ------------------------------------------------------------------------------
def encode(header: dict[str, Any], records: RecordDict | None = None) -> bytes:
    """One frame: header length, JSON ``header``, ``records`` as Flower's protobuf."""
    head = json.dumps(header, separators=(",", ":")).encode()
    body = recorddict_to_proto(records).SerializeToString() if records is not None else b""
    return _HEADER.pack(len(head)) + head + body


def decode(frame: bytes, max_frame_bytes: int) -> tuple[dict[str, Any], RecordDict]:
    """``(header, records)`` of a frame.

    Raises
    ------
    FrameError
        If the frame is above ``max_frame_bytes`` or does not decode.
    """
    if len(frame) > max_frame_bytes:
        raise FrameError(
            f"a frame of {len(frame)} bytes exceeds the cap of {max_frame_bytes} bytes "
            "(stream-max-frame-mb)"
        )
    try:
        (n,) = _HEADER.unpack_from(frame)
        header = json.loads(frame[_HEADER.size : _HEADER.size + n])
        if not isinstance(header, dict):
            raise ValueError("header is no JSON object")
        proto = ProtoRecordDict.FromString(frame[_HEADER.size + n :])
        return header, recorddict_from_proto(proto)
    except Exception as err:  # struct, JSON, protobuf's DecodeError and friends
        raise FrameError(f"a malformed frame of {len(frame)} bytes: {err}") from err


KEEPALIVE_MS = 10_000  # the stage link's keepalive ping period (grpc.keepalive_time_ms)


def _options(max_frame_bytes: int) -> list[tuple[str, int]]:
    cap = max_frame_bytes + SLACK_BYTES
    return [
        ("grpc.max_receive_message_length", cap),
        ("grpc.max_send_message_length", cap),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _server_options(max_frame_bytes: int) -> list[tuple[str, int]]:
    """The endpoint's options: :func:`_options` plus accepting the stage links' keepalive
    pings on a stream idle for longer than a ping period (a stage waiting for its next
    op). gRPC's server default (one ping per 5 min without data, 2 strikes) answers a
    10 s keepalive with GOAWAY "Too many pings" and breaks the round (gRPC's keepalive
    guide, doc/keepalive.md: the server's minimum must be below the client's period)."""
    return [
        *_options(max_frame_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),  # 0: never GOAWAY for pings
    ]


def _guard_options(hello_timeout_s: float) -> list[tuple[str, int]]:
    """Bounds on connections that never carry a call: a TLS handshake must end, and a
    connection with no call open is closed, within ``hello_timeout_s`` (at least 10 s:
    a loaded machine's handshake). A stage's connection carries its call throughout."""
    ms = max(10_000, int(hello_timeout_s * 1000))
    return [("grpc.server_handshake_timeout_ms", ms), ("grpc.max_connection_idle_ms", ms)]


# --- the server's endpoint ---------------------------------------------------------------
Inbound = tuple[int, dict[str, Any] | None, RecordDict | None, str | None]
MAX_REFUSED = 256  # refusals kept by name; later ones are counted in the last entry


class Endpoint:
    """A round's or a stage session's endpoint on the ServerApp: ``num_stages`` tickets,
    one stream each.

    Use it as a context manager; leaving it ends every stream, stops the gRPC server,
    its event loop and its thread (no port, thread or loop is left).

    Parameters
    ----------
    num_stages : int
        Stages that connect (stage ``k`` with :meth:`ticket` ``(k)``).
    bind : str
        Interface to listen on (port: any free one).
    advertise : str
        Host the stages dial (the server's address as the nodes reach it).
    tls : bool
        TLS with a fresh self-signed certificate (:func:`make_certificate`); plaintext
        only for an insecure run.
    max_frame_bytes : int
        Frame size cap, both ways.
    hello_timeout_s : float
        A connection whose hello has not arrived this long after its call opened is
        dropped (recorded in :attr:`refused`). A stage sends its hello at once.
    max_pending : int
        Connections that have not yet sent their hello, at most; one more drops the
        oldest of them (recorded in :attr:`refused`), never the newcomer.

    Attributes
    ----------
    inbox : queue.Queue
        ``(stage, header, records, None)`` per frame received, ``(stage, None, None,
        reason)`` when a stage's stream ends, breaks or sends a bad frame.
    joined : set of int
        The stages admitted.
    refused : list of str
        Connections refused (a wrong ticket, a stage that connected twice, no hello in
        time, a pending connection dropped for a newer one); after :data:`MAX_REFUSED`
        entries the last one counts the rest.

    Raises
    ------
    ValueError
        If ``hello_timeout_s`` is not positive or ``max_pending`` is below 1.
    """

    def __init__(  # noqa: PLR0913
        self,
        num_stages: int,
        bind: str = "127.0.0.1",
        advertise: str = "127.0.0.1",
        tls: bool = True,
        max_frame_bytes: int = 256 << 20,
        hello_timeout_s: float = 5.0,
        max_pending: int = 64,
    ) -> None:
        if not hello_timeout_s > 0:
            raise ValueError(f"hello_timeout_s must be positive, not {hello_timeout_s!r}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, not {max_pending!r}")
        self.num_stages, self.bind, self.advertise = num_stages, bind, advertise
        self.tls, self.max_frame_bytes = tls, max_frame_bytes
        self.hello_timeout_s, self.max_pending = hello_timeout_s, max_pending
        self.tickets = [secrets.token_hex(16) for _ in range(num_stages)]
        self.cert = make_certificate() if tls else None
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self.refused: list[str] = []
        self.joined: set[int] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.port = 0
        # the event loop's own state (touched on its thread only, but for _out's lookups)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._out: dict[int, asyncio.Queue[bytes | None]] = {}
        self._pending: dict[int, asyncio.Event] = {}  # oldest first: set = dropped
        self._calls = itertools.count()
        self._ended: set[int] = set()
        self._more_refused = 0

    # -- life cycle ------------------------------------------------------------------
    def __enter__(self) -> Endpoint:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop, args=(self._loop,), name="sky-stream-loop", daemon=True
        )
        self._thread.start()
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30.0)
        except BaseException as err:
            self.close()
            if isinstance(err, StreamError):
                raise
            raise StreamError(f"the stream endpoint could not start on {self.bind}: {err}") from err
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End every stream, stop the server and its event loop, join its thread
        (bounded: a few s). Idempotent."""
        self._closing.set()
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            stopping = asyncio.run_coroutine_threadsafe(self._stop(), loop)
            with contextlib.suppress(Exception):
                stopping.result(timeout=10.0)
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=10.0)

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        """The endpoint's thread: its event loop until :meth:`close`, then whatever is
        left of its tasks, cancelled, and the loop closed."""
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(
                    asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
                )
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            asyncio.set_event_loop(None)
            loop.close()

    async def _start(self) -> int:
        """Create, bind and start the gRPC server on the endpoint's loop; its port."""
        options = [*_server_options(self.max_frame_bytes), *_guard_options(self.hello_timeout_s)]
        self._server = grpc.aio.server(options=options)
        handler = grpc.stream_stream_rpc_method_handler(self._serve)  # raw bytes both ways
        service, method = METHOD.strip("/").split("/")
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        where = f"{self.bind}:0"
        try:
            if self.cert is not None:
                creds = grpc.ssl_server_credentials([(self.cert.key_pem, self.cert.cert_pem)])
                port = self._server.add_secure_port(where, creds)
            else:
                port = self._server.add_insecure_port(where)
        except RuntimeError as err:  # gRPC: "Failed to bind"
            raise StreamError(f"the stream endpoint could not bind {where}: {err}") from err
        if not port:
            raise StreamError(f"the stream endpoint could not bind {where}")
        await self._server.start()
        return port

    async def _stop(self) -> None:
        """End every admitted stream (the stages see it end), drop the pending ones,
        stop the server (1 s of grace, then every call is cancelled)."""
        with self._lock:
            for out in self._out.values():
                out.put_nowait(None)
        for dropped in self._pending.values():
            dropped.set()
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=1.0)

    @property
    def address(self) -> str:
        """``host:port`` the stages dial."""
        return f"{self.advertise}:{self.port}"

    @property
    def fingerprint(self) -> str:
        """The certificate's SHA-256 fingerprint (``""`` without TLS)."""
        return self.cert.fingerprint if self.cert is not None else ""

    @property
    def cert_pem(self) -> str:
        """The certificate, PEM (``""`` without TLS)."""
        return self.cert.cert_pem.decode() if self.cert is not None else ""

    def link(self, k: int, timeout_s: float) -> Any:  # noqa: ANN401 - a P.StreamLink
        """Stage ``k``'s :class:`~sky_flower.sky.protocol.StreamLink` (``"-"``: no TLS)."""
        from sky_flower.sky.protocol import StreamLink

        return StreamLink(
            address=self.address,
            ticket=self.ticket(k),
            fingerprint=self.fingerprint or "-",
            cert_pem=self.cert_pem or "-",
            max_frame_bytes=self.max_frame_bytes,
            timeout_s=timeout_s,
        )

    def ticket(self, k: int) -> str:
        """Stage ``k``'s ticket (fresh per endpoint, i.e. per round)."""
        return self.tickets[k]

    # -- sending ---------------------------------------------------------------------
    def send(self, k: int, header: dict[str, Any], records: RecordDict | None = None) -> None:
        """Queue a frame to stage ``k`` (sent in order by its stream); any thread.

        Raises
        ------
        StreamError
            If stage ``k`` has not joined, or the frame is above the cap.
        """
        frame = encode(header, records)
        if len(frame) > self.max_frame_bytes:
            raise FrameError(
                f"a frame of {len(frame)} bytes for stage {k} exceeds the cap of "
                f"{self.max_frame_bytes} bytes: raise stream-max-frame-mb"
            )
        out, loop = self._out.get(k), self._loop
        if out is None or loop is None:
            raise StreamError(f"stage {k} has no stream")
        with contextlib.suppress(RuntimeError):  # closed: dropped, as on an ended stream
            loop.call_soon_threadsafe(out.put_nowait, frame)  # FIFO: frames stay in order

    # -- the RPC (on the endpoint's loop) --------------------------------------------
    def _refuse(self, why: str) -> None:
        """Record a refusal (the first :data:`MAX_REFUSED` by name, then a count)."""
        if len(self.refused) < MAX_REFUSED:
            self.refused.append(why)
        else:
            self._more_refused += 1
            self.refused[-1] = f"{self._more_refused + 1} more connections refused"

    def _admit(self, hello: dict[str, Any]) -> int | None:
        """The stage a hello's ticket admits, or None (recorded in :attr:`refused`)."""
        k, ticket = hello.get("stage"), str(hello.get("ticket", ""))
        if hello.get("op") != "hello" or not isinstance(k, int) or not 0 <= k < self.num_stages:
            self._refuse(f"a connection without a valid hello ({sorted(hello)[:8]})")
            return None
        if not hmac.compare_digest(ticket.encode(), self.tickets[k].encode()):
            self._refuse(f"stage {k}: wrong ticket")
            return None
        with self._lock:
            if k in self.joined or self._closing.is_set():
                self._refuse(f"stage {k}: connected twice")
                return None
            self.joined.add(k)
            self._out[k] = asyncio.Queue()
        return k

    async def _hello(self, context: grpc.aio.ServicerContext) -> bytes | str:
        """The call's first frame, or why there is none: its stream ended (``EOF``), no
        hello within :attr:`hello_timeout_s`, or dropped for a newer pending call."""
        call = next(self._calls)
        dropped = self._pending[call] = asyncio.Event()
        while len(self._pending) > self.max_pending:  # drop the oldest, not this one
            self._pending.pop(next(iter(self._pending))).set()
        read = asyncio.ensure_future(context.read())
        drop = asyncio.ensure_future(dropped.wait())
        try:
            await asyncio.wait(
                {read, drop}, timeout=self.hello_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self._pending.pop(call, None)
            drop.cancel()
            if not read.done():
                read.cancel()
        if read.done() and not read.cancelled():
            raw = read.result()
            return "EOF" if raw is grpc.aio.EOF else raw
        if dropped.is_set():
            return "dropped"
        return "timeout"

    async def _serve(self, requests: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: ANN401, ARG002
        """One call: its hello within the deadline, then frames both ways until either
        side ends (``requests`` unused: the reads go through ``context``)."""
        try:
            first = await self._hello(context)
        except asyncio.CancelledError:  # the caller cancelled (or the server stops)
            if not self._closing.is_set():
                self._refuse("a connection without a hello (CANCELLED)")
            raise
        if first == "timeout":  # context.abort raises: the call ends with that status
            self._refuse(f"a connection without a hello within {self.hello_timeout_s:g} s")
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no hello within {self.hello_timeout_s:g} s",
            )
        if first == "dropped":
            if not self._closing.is_set():
                self._refuse(
                    f"a connection without a hello, dropped for a newer one "
                    f"(over {self.max_pending} pending)"
                )
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "dropped: too many connections without a hello",
            )
        if first == "EOF":
            self._refuse("a connection without a hello (EOF)")
            return
        try:
            hello, _ = decode(first, 64 << 10)
        except FrameError:
            self._refuse("a connection without a hello (FrameError)")
            return
        k = self._admit(hello)
        if k is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "ticket refused by the endpoint")
        out = self._out[k]
        reader = asyncio.ensure_future(self._read(k, context, out))
        try:
            await context.write(encode({"op": "welcome"}))
            while (frame := await out.get()) is not None:
                await context.write(frame)
        except asyncio.CancelledError:  # the stage cancelled its call (or the server stops)
            self._end(k, "its stream broke (CANCELLED)")
            raise
        except Exception as err:  # noqa: BLE001 - gRPC ends a cut stream in several ways
            self._end(k, f"its stream broke ({type(err).__name__}: {err})"[:200])
        finally:
            reader.cancel()

    async def _read(
        self, k: int, context: grpc.aio.ServicerContext, out: asyncio.Queue[bytes | None]
    ) -> None:
        """Stage ``k``'s inbound frames into :attr:`inbox`, then why the stream ended
        (and our half ends too)."""
        reason = "closed its stream"
        try:
            while (raw := await context.read()) is not grpc.aio.EOF:
                header, records = decode(raw, self.max_frame_bytes)
                self.inbox.put((k, header, records, None))
        except FrameError as err:
            reason = str(err)
        except grpc.RpcError as err:
            code = err.code() if callable(getattr(err, "code", None)) else None
            why = code.name if code is not None else f"{type(err).__name__}: {err}"[:120]
            reason = f"its stream broke ({why})"
        except Exception as err:  # noqa: BLE001 - gRPC ends a cut stream in several ways
            reason = f"its stream broke ({type(err).__name__}: {err})"
        else:  # EOF: a half-close, or a cut call whose cancellation is on its way
            for _ in range(3):
                await asyncio.sleep(0)
        self._end(k, reason)
        out.put_nowait(None)  # end our half too

    def _end(self, k: int, reason: str) -> None:
        """Report stage ``k``'s stream's end in :attr:`inbox`, once, unless closing."""
        if k in self._ended or self._closing.is_set():
            return
        self._ended.add(k)
        self.inbox.put((k, None, None, reason))


# --- the stage's side --------------------------------------------------------------------
class StageLink:
    """A stage's outbound connection to its round's or session's endpoint.

    Parameters
    ----------
    address : str
        ``host:port`` of the endpoint.
    stage : int
        This stage's index.
    ticket : str
        Its ticket (from the set-up message).
    fingerprint, cert_pem : str
        The pinned certificate (both ``""``: plaintext, an insecure run).
    max_frame_bytes : int
        Frame size cap.
    timeout_s : float
        Bound on the whole call (the round's deadline) and on joining.

    Raises
    ------
    StreamRefusedError
        A certificate whose fingerprint is not the pinned one, a TLS handshake with
        another certificate, a refused ticket, an endpoint not reached in time.
    """

    def __init__(  # noqa: PLR0913
        self,
        address: str,
        stage: int,
        ticket: str,
        fingerprint: str,
        cert_pem: str,
        max_frame_bytes: int = 256 << 20,
        timeout_s: float = 600.0,
    ) -> None:
        self.max_frame_bytes = max_frame_bytes
        opts: list[tuple[str, Any]] = list(_options(max_frame_bytes))
        if fingerprint:
            root = pinned(cert_pem.encode(), fingerprint)
            opts.append(("grpc.ssl_target_name_override", SERVER_NAME))
            creds = grpc.ssl_channel_credentials(root_certificates=root)
            self.channel = grpc.secure_channel(address, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(address, options=opts)
        self._out: queue.Queue[bytes | None] = queue.Queue()
        self._out.put(encode({"op": "hello", "stage": stage, "ticket": ticket}))
        call = self.channel.stream_stream(METHOD)
        self._call = call(iter(self._out.get, None), timeout=timeout_s, wait_for_ready=False)
        try:
            first, _ = decode(next(self._call), 64 << 10)
        except grpc.RpcError as err:
            self.close()
            raise StreamRefusedError(_refusal(err, address)) from err
        except StopIteration as err:
            self.close()
            raise StreamRefusedError(f"the endpoint {address} ended the stream at once") from err
        if first.get("op") != "welcome":
            self.close()
            raise StreamRefusedError(f"the endpoint {address} did not welcome this stage")

    def frames(self) -> Iterator[tuple[dict[str, Any], RecordDict]]:
        """The endpoint's frames, in order, until it ends the stream.

        Raises
        ------
        StreamError
            If the stream breaks (the endpoint closed, the call's deadline passed).
        FrameError
            On a frame above the cap or malformed.
        """
        try:
            for raw in self._call:
                yield decode(raw, self.max_frame_bytes)
        except grpc.RpcError as err:
            raise StreamError(f"the stream broke: {err.code()} {err.details()}") from err

    def send(self, header: dict[str, Any], records: RecordDict | None = None) -> int:
        """Queue a frame to the endpoint; its size in bytes."""
        frame = encode(header, records)
        self._out.put(frame)
        return len(frame)

    def close(self, drain_s: float = 0.0) -> None:
        """End this side of the stream and close the channel. ``drain_s``: first wait up
        to this long (seconds) for the endpoint to have read every frame sent (it ends
        its half then), so that a last frame is not cut off with the call."""
        self._out.put(None)
        until = time.monotonic() + drain_s
        while drain_s > 0 and not self._call.done() and time.monotonic() < until:
            time.sleep(0.01)
        with contextlib.suppress(Exception):
            self._call.cancel()
        self.channel.close()


def connect(link: Any, stage: int) -> StageLink:  # noqa: ANN401 - a P.StreamLink
    """A :class:`StageLink` for stage ``stage`` from the set-up's ``link``."""
    plain = link.fingerprint == "-"
    return StageLink(
        link.address,
        stage,
        link.ticket,
        "" if plain else link.fingerprint,
        "" if plain else link.cert_pem,
        link.max_frame_bytes,
        link.timeout_s,
    )


def _refusal(err: grpc.RpcError, address: str) -> str:
    """Why the endpoint at ``address`` refused a stage, from gRPC's error."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"the endpoint {address} refused this stage's ticket"
    if "handshake" in details.lower() or "certificate" in details.lower():
        return (
            f"the endpoint {address} presented a certificate other than the pinned one "
            f"(TLS handshake failed): {details[:200]}"
        )
    return f"the endpoint {address} could not be reached: {code} {details[:200]}"
