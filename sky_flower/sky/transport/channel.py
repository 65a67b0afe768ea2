"""The ``stream`` transport's data plane: a gRPC bidirectional stream per stage, hosted by
the ServerApp for one round, TLS with the certificate pinned by fingerprint.

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

Pure transport: no torch (:mod:`sky_flower.sky.transport.stream` and
:mod:`sky_flower.sky.node.stream_node` drive it).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import queue
import secrets
import struct
import threading
from collections.abc import Iterator
from concurrent import futures
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
    except (struct.error, ValueError, TypeError, KeyError) as err:
        raise FrameError(f"a malformed frame of {len(frame)} bytes: {err}") from err
    except Exception as err:  # protobuf's DecodeError and friends
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


# --- the server's endpoint ---------------------------------------------------------------
Inbound = tuple[int, dict[str, Any] | None, RecordDict | None, str | None]


class Endpoint:
    """The round's endpoint on the ServerApp: ``num_stages`` tickets, one stream each.

    Use it as a context manager; leaving it ends every stream, stops the gRPC server and
    its threads (no port or thread is left).

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

    Attributes
    ----------
    inbox : queue.Queue
        ``(stage, header, records, None)`` per frame received, ``(stage, None, None,
        reason)`` when a stage's stream ends, breaks or sends a bad frame.
    refused : list of str
        Connections refused (a wrong ticket, a stage that connected twice).
    """

    def __init__(
        self,
        num_stages: int,
        bind: str = "127.0.0.1",
        advertise: str = "127.0.0.1",
        tls: bool = True,
        max_frame_bytes: int = 256 << 20,
    ) -> None:
        self.num_stages, self.bind, self.advertise = num_stages, bind, advertise
        self.tls, self.max_frame_bytes = tls, max_frame_bytes
        self.tickets = [secrets.token_hex(16) for _ in range(num_stages)]
        self.cert = make_certificate() if tls else None
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        self.refused: list[str] = []
        self.joined: set[int] = set()
        self._out: dict[int, queue.Queue[bytes | None]] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._pool: futures.ThreadPoolExecutor | None = None
        self._server: grpc.Server | None = None
        self.port = 0

    # -- life cycle ------------------------------------------------------------------
    def __enter__(self) -> Endpoint:
        self._pool = futures.ThreadPoolExecutor(
            max_workers=self.num_stages + 4, thread_name_prefix="sky-stream"
        )
        self._server = grpc.server(self._pool, options=_server_options(self.max_frame_bytes))
        handler = grpc.stream_stream_rpc_method_handler(self._serve)  # raw bytes both ways
        service, method = METHOD.strip("/").split("/")
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        where = f"{self.bind}:0"
        if self.cert is not None:
            creds = grpc.ssl_server_credentials([(self.cert.key_pem, self.cert.cert_pem)])
            self.port = self._server.add_secure_port(where, creds)
        else:
            self.port = self._server.add_insecure_port(where)
        if not self.port:
            raise StreamError(f"the stream endpoint could not bind {where}")
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End every stream, stop the server and join its threads (bounded: a few s)."""
        self._closing.set()
        with self._lock:
            for out in self._out.values():
                out.put(None)
        if self._server is not None:
            self._server.stop(grace=1.0).wait(5.0)
        for t in self._threads:
            t.join(timeout=5.0)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._server = self._pool = None

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
        """Queue a frame to stage ``k`` (sent in order by its stream).

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
        out = self._out.get(k)
        if out is None:
            raise StreamError(f"stage {k} has no stream")
        out.put(frame)

    # -- the RPC ---------------------------------------------------------------------
    def _admit(self, hello: dict[str, Any]) -> int | None:
        """The stage a hello's ticket admits, or None (recorded in :attr:`refused`)."""
        k, ticket = hello.get("stage"), str(hello.get("ticket", ""))
        if hello.get("op") != "hello" or not isinstance(k, int) or not 0 <= k < self.num_stages:
            self.refused.append(f"a connection without a valid hello ({sorted(hello)})")
            return None
        if not hmac.compare_digest(ticket.encode(), self.tickets[k].encode()):
            self.refused.append(f"stage {k}: wrong ticket")
            return None
        with self._lock:
            if k in self.joined or self._closing.is_set():
                self.refused.append(f"stage {k}: connected twice")
                return None
            self.joined.add(k)
            self._out[k] = queue.Queue()
        return k

    def _serve(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """One stage's stream: the hello, then frames both ways until either side ends."""
        try:
            hello, _ = decode(next(requests), 64 << 10)
        except (StopIteration, FrameError, grpc.RpcError) as err:
            self.refused.append(f"a connection without a hello ({type(err).__name__})")
            return
        k = self._admit(hello)
        if k is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "ticket refused by the endpoint")
            return
        reader = threading.Thread(
            target=self._read, args=(k, requests), name=f"sky-stream-read-{k}", daemon=True
        )
        self._threads.append(reader)
        reader.start()
        yield encode({"op": "welcome"})
        out = self._out[k]
        while True:
            frame = out.get()
            if frame is None:
                return
            yield frame

    def _read(self, k: int, requests: Iterator[bytes]) -> None:
        """Stage ``k``'s inbound frames into :attr:`inbox`, then why the stream ended."""
        reason = "closed its stream"
        try:
            for raw in requests:
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
        if not self._closing.is_set():
            self.inbox.put((k, None, None, reason))
            with self._lock:
                out = self._out.get(k)
            if out is not None:
                out.put(None)  # end our half too


# --- the stage's side --------------------------------------------------------------------
class StageLink:
    """A stage's outbound connection to the round's endpoint.

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

    def close(self) -> None:
        """End this side of the stream and close the channel."""
        self._out.put(None)
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
