"""``transport=stream``: the round's data plane is a gRPC stream per stage, hosted by the
ServerApp, TLS pinned by the set-up message's fingerprint (:mod:`sky_flower.sky.transport.stream`).

Real parts: Sky's ClientApp handlers (each node's ``train.sky_stream`` on its own
thread, as concurrent SuperNodes run them; :class:`ThreadedGrid`), a real gRPC endpoint
and real TLS on 127.0.0.1. The model and data are ``test_exact_state``'s (BatchNorm,
dropout, a stage without parameters); the reference is ``reference_rounds``: the stream
runs the relay's computation (same ops, same order of floating-point operations per
stage), so weights and buffers equal it to 1e-6 as the relay's do (``_assert_same``).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message
from flwr.clientapp import ClientApp
from test_exact_state import (
    BOUNDS,
    ROUND,
    STEPS,
    _assert_same,
    _expected,
    _owner_data,
    _weights,
    stateful_net,
    stateful_run_settings,
)

from sky_flower.core.partition.plan import Plan, StagePlan
from sky_flower.flower.inprocess import InProcessGrid
from sky_flower.sky import protocol as P
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.transport.channel import Endpoint, StageLink, encode
from sky_flower.sky.transport.runner import Pipeline, RoundOutcome, RunSettings, SkyNodeError
from sky_flower.sky.transport.stream import StreamRunner
from sky_flower.sky.transport.stream_tls import StreamRefusedError, make_certificate

BOUND_S = 10.0  # every failure must be named within this (the stall test's timeout is 3 s)


class ThreadedGrid(InProcessGrid):
    """An in-process Grid whose nodes handle each message on a thread of their own (a
    stream stage blocks for the whole round, as a SuperNode's ClientApp process does);
    ``tamper`` may change a message before its node sees it."""

    def __init__(self, apps, configs, tamper: Callable[[Message], None] | None = None) -> None:  # noqa: ANN001
        super().__init__(apps, configs)
        self.tamper = tamper or (lambda m: None)
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            mid = f"m{len(self.threads)}-{time.perf_counter_ns()}"
            msg.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            self.tamper(msg)
            t = threading.Thread(target=self._handle, args=(mid, msg), daemon=True)
            self.threads.append(t)
            t.start()
        return ids

    def _handle(self, mid: str, msg: Message) -> None:
        reply = self.deliver(msg.metadata.dst_node_id, msg)
        with self.lock:
            self.replies[mid] = reply

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        with self.lock:
            return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]

    def join(self, timeout: float = 15.0) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a stage handler still runs"


def _app(client_cls: type[SkyClient] = SkyClient) -> ClientApp:
    return client_cls(model_fn=stateful_net, load_data=_owner_data).register(ClientApp())


def _round(
    kind: str,
    microbatches: int,
    per_message: int,
    client_cls: type[SkyClient] = SkyClient,
    tamper: Callable[[Message], None] | None = None,
    tls: bool = True,
    stream_timeout_s: float = 20.0,
) -> tuple[dict[str, torch.Tensor], RoundOutcome]:
    names = [f"n{k}" for k in range(len(BOUNDS))]
    stages = [
        StagePlan(name, k, a, b, 0.0, 0.0, 0.0, 0.0)
        for k, (name, (a, b)) in enumerate(zip(names, BOUNDS, strict=True))
    ]
    apps = {n: _app(client_cls) for n in names}
    configs = {n: {"sky-node": n, "partition-id": k} for k, n in enumerate(names)}
    grid = ThreadedGrid(apps, configs, tamper)
    pred = [{"node": n, "messages": 0, "compute_s": 0.0, "busy_s": 0.0} for n in names]
    pipeline = Pipeline(
        Plan("even", stages, 0.0, 0.0, 0.0),
        tuple(grid.ids),
        per_message,
        tuple(pred),
        (0.0,) * 3,
        ((0.0, 0.0),) * 3,
    )
    settings_ = stateful_run_settings(
        kind,
        microbatches,
        {
            # the round's deadline (a loaded 2-core machine)
            "failure.message_timeout_s": 30.0,
            # 20 s: a loaded 2-core machine's slow stage
            "stream.timeout_s": stream_timeout_s,
            "stream.tls": tls,
        },
        describe=grid.names.get,
    )
    try:
        outcome = StreamRunner(settings_).run_round(
            grid, pipeline, ArrayRecord(_weights()), STEPS, ROUND
        )
    finally:
        grid.join()
    return outcome.arrays.to_torch_state_dict(), outcome


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sky-stream")]


@pytest.mark.parametrize(
    ("kind", "microbatches", "per_message"),
    [("sequential", 1, 1), ("sequential", 4, 4), ("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 4, 2)],
)
def test_stream_equals_whole(kind, microbatches, per_message, server_identity):
    got, _ = _round(kind, microbatches, per_message)
    _assert_same(got, _expected(microbatches))
    assert not _stream_threads()


def test_stream_plaintext_equals_whole(server_identity):
    got, outcome = _round("gpipe", 4, 1, tls=False)
    _assert_same(got, _expected(4))
    # the stage rows hold what the stream measures: compute, not the relay's handler
    # busy time (a column of zeros against a prediction, before)
    rows = [r.to_dict() for r in outcome.stages]
    assert len(rows) == 3 and all(r["measured_compute_s"] > 0 for r in rows), rows
    assert not any("measured_busy_s" in r or "predicted_busy_s" in r for r in rows), rows


# -- faults: each named, within a bound ---------------------------------------------------
def _setting(msg: Message, stage: int, **changes: str) -> None:
    """Change ``changes`` in stage ``stage``'s ``train.sky_stream`` config."""
    cfg = msg.content.config_records[P.CONFIG]
    if msg.metadata.message_type == P.STREAM and int(cfg["stage"]) == stage:
        for key, value in changes.items():
            cfg[key] = value


@pytest.fixture
def op_count(monkeypatch):  # noqa: ANN201
    """How many op frames the stages ran (a refusal must come before any)."""
    from sky_flower.sky.node import stream_node

    calls = []
    original = stream_node.LiveStage.op

    def counted(self, header, records):  # noqa: ANN001, ANN202
        calls.append(header)
        return original(self, header, records)

    monkeypatch.setattr(stream_node.LiveStage, "op", counted)
    return calls


def _fails(match: str, **kwargs) -> SkyNodeError:  # noqa: ANN003
    t0 = time.perf_counter()
    with pytest.raises(SkyNodeError, match=match) as info:
        _round("gpipe", 4, 1, **kwargs)
    assert time.perf_counter() - t0 < BOUND_S
    assert not _stream_threads()
    return info.value


def test_wrong_ticket_is_refused_before_any_tensor_moves(server_identity, op_count):
    err = _fails(
        r"stage 1 on n1 \(node 102\) failed: .*refused this stage's ticket",
        tamper=lambda m: _setting(m, 1, ticket="0" * 32),
    )
    assert err.node_ids == [102] and not op_count


def test_wrong_fingerprint_is_refused_before_connecting(server_identity, op_count):
    err = _fails(
        r"stage 2 on n2 \(node 103\) failed: .*fingerprint .* not the pinned",
        tamper=lambda m: _setting(m, 2, fingerprint="ab" * 32),
    )
    assert err.node_ids == [103] and not op_count


def test_another_certificate_fails_the_tls_handshake(server_identity, op_count):
    other = make_certificate()  # pinned by the node, but not the one the endpoint presents
    _fails(
        r"stage 0 on n0 \(node 101\) failed: .*certificate other than the pinned one",
        tamper=lambda m: _setting(
            m, 0, fingerprint=other.fingerprint, cert_pem=other.cert_pem.decode()
        ),
    )
    assert not op_count


def _faulty(mode: str) -> type[SkyClient]:
    """A client whose node n1 fails at the first frame of step 1 (fleet fault ``mode``:
    ``crash`` drops its stream, ``stall`` goes silent for 4 s)."""

    class Faulty(SkyClient):
        def __init__(self, **kwargs) -> None:  # noqa: ANN003
            from sky_flower.emulation.devices import Emulation

            def emu(context) -> Emulation:  # noqa: ANN001
                name = str(context.node_config["sky-node"])
                fault = {"fail_on": P.STREAM, "fail_mode": mode, "fail_step": 1}
                return Emulation(name=name, fail_delay_s=4.0, **(fault if name == "n1" else {}))

            super().__init__(emulation_fn=emu, **kwargs)

    return Faulty


def test_disconnect_mid_step_fails_the_round_by_name(server_identity, op_count):
    err = _fails(
        r"stage 1 on n1 \(node 102\): (its stream broke|closed its stream).*mid-round "
        r".*crashed before step 1",  # the crash ends the stream cleanly or cuts it
        client_cls=_faulty("crash"),
    )
    assert err.node_ids == [102]
    assert any(h["step"] == 0 for h in op_count)  # it failed mid-round, not at the set-up


@pytest.mark.realtime
def test_a_stalled_stage_is_named_after_stream_timeout(server_identity):
    """The stalled stage alone owed a reply: its node is blamed (dropped by the
    failure policy), as a node whose stream breaks is."""
    err = _fails(
        r"stage 1 on n1 \(node 102\) sent nothing for 3 s \(stream-timeout-s\)",
        client_cls=_faulty("stall"),
        stream_timeout_s=3.0,
    )
    assert err.node_ids == [102]


def test_oversize_frame_fails_the_round_by_name(server_identity, monkeypatch):
    monkeypatch.setattr(RunSettings, "__init__", _capped(RunSettings.__init__, 600))
    _fails(r"stage 0 on n0 \(node 101\): a frame of \d+ bytes exceeds the cap of 600 bytes")


def _capped(init, cap: int):  # noqa: ANN001, ANN202
    def wrapped(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        s = kwargs["settings"]  # cap / 2**20 MiB: exactly cap bytes again
        stream = dataclasses.replace(s.stream, max_frame_mb=cap / 2**20)
        kwargs["settings"] = dataclasses.replace(s, stream=stream)
        init(self, *args, **kwargs)

    return wrapped


def test_malformed_frame_and_endpoint_leaves_no_port():
    with Endpoint(1, tls=True, max_frame_bytes=1 << 16) as ep:
        link = StageLink(ep.address, 0, ep.ticket(0), ep.fingerprint, ep.cert_pem, 1 << 16, 10)
        link._out.put(b"\xff\xff\x00\x00garbage")  # a header length past the frame
        k, header, _, reason = ep.inbox.get(timeout=BOUND_S)
        assert (k, header) == (0, None) and "malformed frame" in reason
        link.close()
        port = ep.port
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    assert not _stream_threads()


@pytest.mark.realtime
def test_an_idle_stage_link_keeps_its_stream_through_keepalive_pings(monkeypatch):
    """A stage waits for its next op longer than the keepalive period (a slow peer, a
    loaded machine): its pings must not earn a GOAWAY "Too many pings" from the endpoint
    (gRPC's server default accepts one ping per 5 min without data, 2 strikes). Here
    the period is 1 s and the link idles 5 s, then an op frame arrives (before the fix:
    UNAVAILABLE "Too many pings" at the same settings)."""
    from sky_flower.sky.transport import channel

    monkeypatch.setattr(channel, "KEEPALIVE_MS", 1000)
    with Endpoint(1, tls=True, max_frame_bytes=1 << 16) as ep:
        link = StageLink(ep.address, 0, ep.ticket(0), ep.fingerprint, ep.cert_pem, 1 << 16, 10)
        frames = link.frames()
        time.sleep(5.0)
        ep.send(0, {"op": "end"})
        header, _ = next(frames)
        assert header["op"] == "end"
        link.close()
    assert not _stream_threads()


def test_a_stranger_without_ticket_is_refused():
    with Endpoint(2, tls=True) as ep:
        with pytest.raises(StreamRefusedError, match="refused this stage's ticket"):
            StageLink(ep.address, 1, "not-the-ticket", ep.fingerprint, ep.cert_pem, 1 << 16, 10)
        assert ep.joined == set() and ep.refused == ["stage 1: wrong ticket"]
    assert encode({"op": "end"})  # frames are plain bytes


# -- the whole strategy, each message in a fresh process ----------------------------------
@pytest.mark.processes
def test_sky_app_on_stream_equals_unsplit_training(server_identity):
    """The sky-app through Sky's strategy (benchmark, plan, 2 rounds of 3 steps) on
    ``transport=stream`` with TLS, every message handled in a fresh ClientApp process
    (``ConcurrentGrid``, the deployment engine's semantics): the stages connect from
    their processes to the ServerApp's endpoint, once for both rounds (a stage session);
    the global model and each round's mean loss equal unsplit training's (tolerance as
    ``test_process_per_message``: the same operations, float32 through the protobuf
    round trip, rtol 1e-4)."""
    from reference import ConcurrentGrid, run_sky_app
    from test_process_per_message import QUICK, _assert_weights
    from test_process_per_message import _expected as expected_rounds

    run = {**QUICK, "fleet": "uniform3", "num-server-rounds": 2, "steps-per-round": 3}
    run |= {"transport": "stream", "schedule-kind": "1f1b", "microbatches": 4}
    run |= {"stream-timeout-s": 20.0}
    strategy, result, _ = run_sky_app(ConcurrentGrid, run)
    assert [r.error for r in strategy.rounds] == [None, None]
    assert len(strategy.plan.stages) == 3
    expected = expected_rounds(run)
    for row, (_, losses) in zip(strategy.rounds, expected, strict=True):
        assert abs(row.train_loss - float(np.mean(losses))) < 1e-5, (row, losses)
        assert row.measured_step_time_s > 0
    # one stage session for both rounds: set up in round 1, no Flower message in round 2
    first, second = strategy.rounds
    assert first.setup_s > 0 and first.session_round == 1 and first.flower_messages == 3
    assert second.setup_s == 0 and second.session_round == 2
    assert second.flower_messages == 0
    _assert_weights(result.arrays.to_torch_state_dict(), expected[-1][0])
    assert not _stream_threads()


# -- the launcher ---------------------------------------------------------------------------
def test_launcher_defaults_to_stream_and_refuses_plaintext_direct_under_tls(tmp_path):
    """On SuperNodes a Sky app runs the stream unless its run config picks a transport;
    ``--tls`` with ``transport='direct'`` is refused before anything starts, naming the
    plaintext risk and the fixes."""
    from reference import SKY_APP

    from sky_flower.deploy import DeployError, run_local, with_deployment_transport

    assert with_deployment_transport(SKY_APP, "lr=0.01") == "transport='stream' lr=0.01"
    assert with_deployment_transport(SKY_APP, "transport='relay'") == "transport='relay'"
    config = "transport='direct' schedule-kind='gpipe' microbatches=4"
    with pytest.raises(DeployError, match=r"plaintext .*Use transport='stream'.*drop --tls"):
        run_local(SKY_APP, "edge3", tls=True, run_config=config, workdir=tmp_path, echo=False)
    assert not (tmp_path / "superlink.log").exists()  # nothing was started


# -- the link over the data plane ---------------------------------------------------------
def test_stream_link_probe_times_the_emulated_link_both_ways(server_identity):
    """``query.sky_stream_echo``: a node whose fleet entry emulates 20 ms and 50 MB/s
    sleeps that per echo frame (latency + bytes both ways / bandwidth), so the probe's
    round trip is at least 20 ms and its bandwidths at most 50 MB/s (and not far
    below: loopback adds little), down and up alike."""
    from sky_flower.emulation.devices import Emulation
    from sky_flower.flower.exchange import Exchange
    from sky_flower.sky.transport.stream_probe import probe_link

    class Slow(SkyClient):
        def __init__(self, **kwargs) -> None:  # noqa: ANN003
            emu = Emulation(name="n0", latency_ms=20.0, bandwidth_mb_s=50.0)
            super().__init__(emulation_fn=lambda c: emu, **kwargs)

    grid = ThreadedGrid({"n0": _app(Slow)}, {"n0": {"sky-node": "n0", "partition-id": 0}})
    ex = Exchange(grid, 10.0, poll_interval_s=0.005)
    fig = probe_link(ex, 101, lambda n: Endpoint(n), (1024, 1 << 20), repeats=3, timeout_s=10)
    grid.join()
    assert 0.02 <= fig.latency_s < 0.2
    for bw in (fig.down_bps, fig.up_bps):
        # the bandwidth is bytes over the large and small payloads' round-trip difference:
        # under load the small one's best of 3 can be late too, raising the estimate a
        # little above the emulated 50 MB/s (measured once: 52.6 MB/s)
        assert 0 < bw <= 50e6 * 1.25, fig
    assert {k: len(v) for k, v in fig.rtts.items()} == {
        (1024, 1024): 3,
        (1 << 20, 1024): 3,
        (1024, 1 << 20): 3,
    }
    assert not _stream_threads()
