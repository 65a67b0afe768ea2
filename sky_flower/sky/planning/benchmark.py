"""The benchmark round: every node times the model's own layers
(``query.sky_profile``), the server times each node's link with echoes
(``query.sky_echo``: latency, bandwidth, ``context.state`` cost per byte; on ``stream``
the link over the data plane, and how long its probe's Flower message took to bring the
node onto the endpoint: what a stage session's set-up costs but for its weights), and
the nodes are ordered for the pipeline (the data owner first)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid
from flwr.supercore import log

from sky_flower import tables
from sky_flower.core.calibration import CALIBRATION_FIELDS
from sky_flower.core.cost import Schedule, check_profiles
from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.flower.exchange import Exchange
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.runner import SkyNodeError, message

if TYPE_CHECKING:
    from sky_flower.sky.settings import BenchmarkSettings

Link = tuple[float, float, float]  # latency s, bandwidth bytes/s, state s/byte/message


@dataclass(frozen=True)
class LinkTiming:
    """How the benchmark round times each node's link, as the transport needs it (what
    it measures and how often: :class:`sky_flower.sky.settings.BenchmarkSettings`).

    Attributes
    ----------
    peer_links : bool
        ``direct`` and ``stream`` transports: take each node's link as its emulation
        reports it (direct: the stages talk peer to peer; stream: a frame, not a Flower
        message) instead of timing relay echoes.
    calibrate : bool
        ``direct``: also time the gloo step's fixed costs.
    stream : dict, optional
        ``transport=stream``: the endpoint's settings (:class:`sky_flower.sky.transport.channel.
        Endpoint` keywords): each node's link is timed over the data plane itself
        (:func:`sky_flower.sky.transport.stream_probe.probe_link`), not by Flower echoes,
        within the node's ``query.sky_profile`` (one Flower message per node: the node
        answers the echo frames, then profiles); and each node's Flower set-up cost by
        that message, from its push until the node joined the endpoint
        (:attr:`NodeProfile.setup_s`).
    """

    peer_links: bool = False
    calibrate: bool = False
    stream: dict[str, Any] | None = None


@dataclass
class BenchmarkResult:
    """What the benchmark round found.

    Attributes
    ----------
    nodes : list[NodeProfile]
        The nodes that answered, in pipeline order (the data owner first).
    node_ids : dict[str, int]
        Node name -> Flower node id.
    num_examples : int
        The (first) data owner's examples.
    samples : dict[str, int]
        Data owner name -> its training examples (one pipeline each).
    handler_rate : dict[str, float]
        Node name -> seconds per state byte a relay stage message spends rebuilding
        (and, half of the time, saving) its stage.
    emulation : dict[str, str]
        Node name -> its emulation's description.
    left_out : dict[int, str]
        Node id -> why the node was left out (its error), for each node that failed.
    names : dict[int, str]
        Node id -> name of every node the run knows by name
        (:meth:`sky_flower.sky.rounds.joins.Benchmarker.run` fills it).
    runtime_workers : int or None
        How many ClientApps the runtime runs at once, as the nodes reported it (the
        fewest; Flower's simulation runtime: its Ray actor pool); ``None``: no node
        knows (a deployment).
    """

    nodes: list[NodeProfile]
    node_ids: dict[str, int]
    num_examples: int
    samples: dict[str, int] = field(default_factory=dict)
    handler_rate: dict[str, float] = field(default_factory=dict)
    emulation: dict[str, str] = field(default_factory=dict)
    left_out: dict[int, str] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    runtime_workers: int | None = None


class BenchmarkRound:
    """Runs the benchmark round over an :class:`Exchange`.

    Parameters
    ----------
    exchange : Exchange
        Raises :class:`SkyNodeError`; its ``describe`` should read ``names``.
    layers : Sequence[LayerProfile]
        The model's layer profiles (their count is checked against every node's).
    schedule : Schedule
        Micro-batch size and ``M`` (the optimizer step is spread over ``M``).
    input_shape : Sequence[int]
        One sample's shape.
    optimizer, lr : str, float
        The stages' optimizer (its step is timed too).
    settings : sky_flower.sky.settings.BenchmarkSettings
        What to measure and how often (warm-up and timed passes, echo sizes and
        repeats, echo jitter, the state probe's MiB).
    names : dict[int, str]
        Filled with node id -> name as nodes answer.
    seed : int
        Seeds the echo jitter.
    link_cache : dict[int, Link], optional
        Node id -> timed link; a node found there is not timed again (benchmarks that
        run several strategies on one grid).
    input_dtype : str
        Dtype of the model's input (``"int64"`` for token ids).
    links : LinkTiming
        How the transport's links are timed (default: relay echoes).
    server_round : int
        The round the messages belong to (their group id): 0, the benchmark round
        (groups ``benchmark`` and ``echo``); a round, a node joining before it
        (:mod:`sky_flower.sky.rounds.joins`).
    """

    def __init__(  # noqa: PLR0913
        self,
        exchange: Exchange,
        layers: Sequence[LayerProfile],
        schedule: Schedule,
        input_shape: Sequence[int],
        optimizer: str,
        lr: float,
        settings: BenchmarkSettings,
        names: dict[int, str],
        seed: int = 0,
        link_cache: dict[int, Link] | None = None,
        input_dtype: str = "float32",
        links: LinkTiming = LinkTiming(),  # noqa: B008 - frozen
        server_round: int = 0,
    ) -> None:
        self.ex, self.layers, self.schedule = exchange, list(layers), schedule
        self.groups = ("benchmark", "echo") if server_round == 0 else (str(server_round),) * 2
        self.input_dtype = input_dtype
        self.input_shape, self.optimizer, self.lr = list(input_shape), optimizer, lr
        self.settings, self.names, self.links = settings, names, links
        self.rng = np.random.default_rng(seed)
        self.link_cache = link_cache
        # stream: node id -> its Flower set-up, timed with its link (a node whose link
        # comes from link_cache keeps 0: not measured, no set-up predicted for its plan)
        self.setups: dict[int, float] = {}

    def run(self, node_ids: Sequence[int], node_order: Sequence[str] = ()) -> BenchmarkResult:
        """Profile every node (one at a time: concurrent timing on shared cores lies),
        time its link; a node that fails or answers malformed is left out with a
        warning.

        Raises
        ------
        SkyNodeError
            If no data owner answered.
        """
        result = BenchmarkResult(nodes=[], node_ids={}, num_examples=0)
        examples: dict[str, int] = {}
        left_out: list[tuple[int, Exception]] = []
        log(  # the round takes a while (seconds a node, emulated slowdowns included)
            INFO,
            "Benchmark: profiling %d node(s) one at a time (each layer's time and memory, "
            "then the node's link by echoes)",
            len(node_ids),
        )
        for nid in node_ids:
            try:
                node, prof = self.profile(nid, result)
            except (SkyNodeError, P.ProtocolError, KeyError, TypeError, ValueError) as err:
                if self.ex.stop is not None and self.ex.stop.is_set():
                    raise  # the run was stopped (e.g. Ctrl-C): no node is to blame
                left_out.append((nid, err))
                result.left_out[nid] = str(err)
                continue
            result.nodes.append(node)
            result.node_ids[node.name] = nid
            result.emulation[node.name] = prof.emulation
            examples[node.name] = prof.num_examples
            if prof.runtime_workers > 0:  # the fewest any node reported
                seen = result.runtime_workers or prof.runtime_workers
                result.runtime_workers = min(seen, prof.runtime_workers)
        named = [
            (self.name_left_out(nid, left_out, result, node_order), err) for nid, err in left_out
        ]
        why = [f"{who}: {err}" for who, err in named]
        for who, err in named:
            if "is not in the federation" in str(err):  # an emulated join_round: not yet
                log(
                    INFO,
                    "Benchmark: %s: %s. It is profiled and planned with when it joins if "
                    "replan.mode is on (sky_flower.sky.rounds.joins), else left out",
                    who,
                    err,
                )
            else:
                log(WARNING, "Benchmark: leaving %s out of the plan: %s", who, err)
        if not any(n.holds_data for n in result.nodes):
            left = f" (left out: {'; '.join(why)})" if why else ""
            raise SkyNodeError(f"no data owner answered the benchmark round: cannot train{left}")
        result.nodes = order_nodes(result.nodes, node_order)
        owners = [n for n in result.nodes if n.holds_data]
        result.num_examples = examples[owners[0].name]
        result.samples = {n.name: examples[n.name] for n in owners}
        log(
            INFO,
            "%d data owner(s), one pipeline each: %s",
            len(owners),
            ", ".join(f"{n} ({k} examples)" for n, k in result.samples.items()),
        )
        log(INFO, "Benchmark round:\n%s", benchmark_table(result.nodes, result.emulation))
        return result

    def name_left_out(
        self,
        nid: int,
        left_out: Sequence[tuple[int, Exception]],
        result: BenchmarkResult,
        node_order: Sequence[str],
    ) -> str:
        """How to name node ``nid``, which failed the benchmark before telling its name:
        by elimination over the fleet's names (``node_order``) that did not answer (the
        only one: it is that node, and ``names`` learns it; several: "one of"), else
        ``node <id>``."""
        unheard = [n for n in node_order if n not in result.node_ids]
        if len(left_out) == 1 and len(unheard) == 1:
            self.names.setdefault(nid, unheard[0])
        if nid in self.names:
            return self.ex.name(nid)
        if unheard:
            return f"node {nid} (one of {', '.join(unheard)})"
        return self.ex.name(nid)

    def profile(self, nid: int, result: BenchmarkResult) -> tuple[NodeProfile, P.ProfileReply]:
        """One node's profile (and link). Raises on a failed or malformed answer, or
        one whose figures the cost model cannot use (NaN, inf or negative times or
        memory: :func:`sky_flower.core.cost.check_profiles`)."""
        req = P.ProfileRequest(
            input_shape=tuple(self.input_shape),
            microbatch_size=self.schedule.microbatch_size,
            warmup=self.settings.warmup,
            repeats=self.settings.repeats,
            optimizer=self.optimizer,
            lr=self.lr,
            input_dtype=self.input_dtype,
            calibrate=self.links.calibrate,
        )
        content = {P.CONFIG: req.to_config_record()}
        stream_link: Link | None = None
        reply: Message | None = None
        if self.links.stream is not None and not self.links.peer_links:
            # stream: the link is timed in the profile message itself (one per node)
            stream_link, reply = self.stream_link(nid, content)
        if stream_link is None or reply is None:
            (reply,) = self.ex.request([message(nid, P.PROFILE, content, self.groups[0])])
        prof = P.ProfileReply.from_config_record(reply.content.config_records[P.PROFILE_KEY])
        if prof.name in result.node_ids:
            raise SkyNodeError(f"node name {prof.name!r} is already taken by another node")
        self.names[nid] = prof.name
        L = len(self.layers)
        fwd, bwd, steps = prof.layer_fwd_s, prof.layer_bwd_s, prof.layer_step_s or (0.0,) * L
        if len(fwd) != L or len(bwd) != L:
            raise SkyNodeError(
                f"reported times for {len(fwd)}/{len(bwd)} layers, the model has "
                f"{L}: is it running the same model_fn?"
            )
        if len(steps) != L:
            raise SkyNodeError(f"reported optimizer steps for {len(steps)} layers")
        # one optimizer step per training step, spread over its micro-batches
        M = self.schedule.microbatches
        bwd = tuple(t + o / M for t, o in zip(bwd, steps, strict=True))
        setup_s = 0.0  # stream only: a stage session's Flower set-up
        if self.links.peer_links:
            lat, bw, state_rate = peer_link(prof)
        elif stream_link is not None:
            lat, bw, state_rate = stream_link
            setup_s = self.setups.get(nid, 0.0)
        else:
            lat, bw, state_rate = self.link(nid)
            # every stage message rebuilds its stage from the state; about half of
            # them (those that step the optimizer) also save it back
            rate = prof.state_rebuild_s_per_byte + 0.5 * prof.state_save_s_per_byte
            result.handler_rate[prof.name] = rate
            state_rate += rate
        node = NodeProfile(
            name=prof.name,
            layer_fwd_s=tuple(fwd),
            layer_bwd_s=bwd,
            memory_bytes=prof.memory_bytes,
            latency_s=lat,
            bandwidth_bps=bw,
            state_s_per_byte=state_rate,
            holds_data=prof.holds_data,
            slowdown=prof.slowdown,
            node_id=nid,
            device=prof.device,
            device_name="" if prof.device_name == P.NO_HOST else prof.device_name,
            setup_s=setup_s,
            **calibration(prof),
        )
        try:  # a node's bad figures leave it out here, not fail the plan of every node
            check_profiles((), [node])
            if prof.num_examples < 0:
                raise ValueError(f"num_examples must be >= 0, got {prof.num_examples}")
        except ValueError as err:
            raise SkyNodeError(f"its benchmark reply is unusable: {err}") from err
        return node, prof

    def echo(self, nid: int, size: int, store_bytes: int = 0) -> float:
        """Seconds for one echo of ``size`` bytes (after a random pause: Flower's nodes
        pick up messages on a fixed polling tick, so back-to-back echoes would all land
        on the same phase of it and hide both the tick and the payload's own cost)."""
        if self.settings.echo_jitter_s > 0:
            time.sleep(self.rng.uniform(0.0, self.settings.echo_jitter_s))
        content: dict[str, Any] = {
            P.PAYLOAD: ArrayRecord({"p": torch.zeros(size, dtype=torch.uint8)}),
            P.CONFIG: P.EchoRequest(store_bytes=store_bytes).to_config_record(),
        }
        t0 = time.perf_counter()
        self.ex.request([message(nid, P.ECHO, content, self.groups[1])])
        return time.perf_counter() - t0

    def stream_link(self, nid: int, content: dict[str, Any]) -> tuple[Link, Message | None]:
        """``transport=stream``: latency (s per op frame and reply), bandwidth (bytes/s,
        the harmonic mean of down and up) timed over the data plane, no state cost;
        the link carried by node ``nid``'s ``query.sky_profile`` of ``content`` (the node
        answers the echoes, then profiles), whose reply comes with it (None: the link
        came from ``link_cache``, the profile message is still to send).

        Raises
        ------
        SkyNodeError
            Naming the node, if it fails, does not connect or stops answering.
        """
        if self.link_cache is not None and nid in self.link_cache:
            return self.link_cache[nid], None
        from sky_flower.sky.transport.channel import Endpoint
        from sky_flower.sky.transport.stream_probe import probe_link

        kw = self.links.stream or {}
        fig = probe_link(
            self.ex,
            nid,
            lambda n: Endpoint(n, **kw),
            tuple(self.settings.echo_bytes),  # type: ignore[arg-type]
            self.settings.echo_repeats,
            self.groups[0],
            carrier=(P.PROFILE, content),
        )
        if fig.reply is not None and not fig.reply.has_error():  # name the node as it says
            rec = fig.reply.content.config_records.get(P.PROFILE_KEY)
            if rec is not None and isinstance(rec.get("name"), str):
                self.names.setdefault(nid, str(rec["name"]))
        log(
            INFO,
            "Stream link of %s: %.2f ms round trip, %.1f MB/s down, %.1f MB/s up; "
            "Flower set-up %s (its message pushed until it joined)",
            self.ex.name(nid),
            fig.latency_s * 1e3,
            fig.down_bps / 1e6,
            fig.up_bps / 1e6,
            duration(fig.join_s),
        )
        self.setups[nid] = fig.join_s
        link = (fig.latency_s, fig.bandwidth_bps, 0.0)
        if self.link_cache is not None:
            self.link_cache[nid] = link
        return link, fig.reply

    def link(self, nid: int) -> Link:
        """Latency (s per round trip), bandwidth (bytes/s) and context-state cost (s per
        byte per message) from echoes: two payload sizes, then the small one again with
        a ``state_probe_mb`` array stored in the node's ``context.state``."""
        if self.link_cache is not None and nid in self.link_cache:
            return self.link_cache[nid]
        s = self.settings
        small, big = s.echo_bytes
        self.echo(nid, small)  # warm-up, not timed
        t_small = statistics.median(self.echo(nid, small) for _ in range(s.echo_repeats))
        t_big = statistics.median(self.echo(nid, big) for _ in range(s.echo_repeats))
        dt = t_big - t_small
        bandwidth = 2.0 * (big - small) / dt if dt > 1e-4 else float("inf")
        latency = t_small - (2.0 * small / bandwidth if bandwidth != float("inf") else 0.0)
        state_rate, probe = 0.0, int(s.state_probe_mb * 2**20)
        if probe > 0:
            self.echo(nid, small, store_bytes=probe)
            t_state = statistics.median(self.echo(nid, small) for _ in range(s.echo_repeats))
            self.echo(nid, small, store_bytes=-1)
            state_rate = max(t_state - t_small, 0.0) / probe
        link = (max(latency, 0.0), bandwidth, state_rate)
        if self.link_cache is not None:
            self.link_cache[nid] = link
        return link


def peer_link(prof: P.ProfileReply) -> Link:
    """``transport=direct``: a stage's peer link as the fleet emulates it (latency s,
    bandwidth bytes/s, no per-message state cost). Stages talk over loopback here, so
    the emulated link, which each stage sleeps per peer message, is what the planner
    charges."""
    bw = prof.link_bandwidth_bps
    return prof.link_latency_s, bw if bw > 0 else float("inf"), 0.0


def calibration(prof: P.ProfileReply) -> dict[str, Any]:
    """The reply's calibration fields for :class:`NodeProfile` (the direct
    transport's benchmark asks for them, 0 / "" otherwise)."""
    fields = {f: getattr(prof, f) for f in CALIBRATION_FIELDS}
    fields["host"] = "" if prof.host == P.NO_HOST else prof.host
    if fields["host"]:  # measured: the direct cost model also places the optimizer step
        fields["layer_step_s"] = tuple(prof.layer_step_s)
    return fields


def order_nodes(nodes: Sequence[NodeProfile], node_order: Sequence[str]) -> list[NodeProfile]:
    """Pipeline order: by ``node_order`` (names not listed follow in name order), then
    the first data owner moved to the front.

    Raises
    ------
    StopIteration
        If no node holds data.
    """
    rank = {name: i for i, name in enumerate(node_order)}
    ordered = sorted(nodes, key=lambda n: (rank.get(n.name, len(rank)), n.name))
    owner = next(n for n in ordered if n.holds_data)
    return [owner] + [n for n in ordered if n is not owner]


def benchmark_table(nodes: Sequence[NodeProfile], emulation: dict[str, str] | None = None) -> str:
    """The benchmark round's results as a text table."""
    emulation = emulation or {}
    head = ("node", "data", "device", "fwd+bwd ms", "memory MiB", "latency ms", "bw MB/s")
    head += ("state ms/MiB", "emulation")
    rows = [
        (
            n.name,
            "yes" if n.holds_data else "no",
            n.device,
            f"{(sum(n.layer_fwd_s) + sum(n.layer_bwd_s)) * 1e3:.2f}",
            f"{n.memory_bytes / 2**20:.1f}",
            f"{n.latency_s * 1e3:.1f}",
            "inf" if n.bandwidth_bps == float("inf") else f"{n.bandwidth_bps / 1e6:.1f}",
            f"{n.state_s_per_byte * 1e3 * 2**20:.2f}",
            emulation.get(n.name, ""),
        )
        for n in nodes
    ]
    table = tables.text(head, rows, align="lrrrrrrrl", rule=True)
    return "\n".join([table, *device_lines(nodes), *calibration_lines(nodes), *setup_lines(nodes)])


def device_lines(nodes: Sequence[NodeProfile]) -> list[str]:
    """Each device the nodes compute on, by name, if any node reported one."""
    lines = [f"  {n.name:<12} {n.device}: {n.device_name}" for n in nodes if n.device_name]
    return ["Devices:", *lines] if lines else []


def calibration_lines(nodes: Sequence[NodeProfile]) -> list[str]:
    """The benchmark's calibration per node, if it measured any."""
    if not any(n.host for n in nodes):
        return []
    return ["Calibration (direct):"] + [
        f"  {n.name:<12} micro-batch overhead {n.microbatch_overhead_s * 1e3:.2f} ms, gloo "
        f"message {n.peer_latency_s * 1e3:.2f} ms, host {n.host!r} runs "
        f"{n.host_parallelism:.2f} workers at once"
        for n in nodes
    ]


def setup_lines(nodes: Sequence[NodeProfile]) -> list[str]:
    """Each node's measured Flower set-up (``stream``: :attr:`NodeProfile.setup_s`), if
    any node has one."""
    if not any(n.setup_s > 0 for n in nodes):
        return []
    return ["Flower set-up (stream sessions: a message pushed until its stage joined):"] + [
        f"  {n.name:<12} {duration(n.setup_s) if n.setup_s > 0 else '-'}" for n in nodes
    ]


def duration(seconds: float) -> str:
    """``seconds`` as text: ``"18.200 s"`` from 0.1 s, else ``"0.42 ms"``."""
    return f"{seconds:.3f} s" if seconds >= 0.1 else f"{seconds * 1e3:.2f} ms"


# under Flower's simulation runtime (an ``InMemoryGrid``) the SuperNodes are registered
# once, when the runtime starts (``num-supernodes``), a moment after the ServerApp thread
# starts; no node joins later, so waiting past this many seconds is waiting for nothing
SIMULATION_SETTLE_S = 5.0


def fixed_node_count(grid: Grid) -> bool:
    """Whether ``grid`` is Flower's simulation runtime's, whose SuperNodes are all
    registered when it starts (``flwr run``'s ``num-supernodes``, ``run_simulation``'s
    ``num_supernodes``): no node joins later."""
    try:
        from flwr.superlink.grid import InMemoryGrid
    except ImportError:  # a Flower without the module: no shortcut, the full wait
        return False
    return isinstance(grid, InMemoryGrid)


def wait_for_nodes(
    grid: Grid, min_nodes: int, timeout: float, stop: threading.Event | None = None
) -> list[int]:
    """Block until ``min_nodes`` nodes are connected (bounded by ``timeout`` s); after
    it, the nodes that are connected go on with a warning (the missing ones are left
    out of the plan). ``min_nodes <= 0`` (a federation without a fleet file): every
    node that connects within ``timeout`` s. Under Flower's simulation runtime, where
    every SuperNode is registered at its start (:func:`fixed_node_count`), the wait
    ends after :data:`SIMULATION_SETTLE_S` s instead, and a shortfall's warning names
    the ``num-supernodes`` setting to fix. Returns their ids, sorted.

    Raises
    ------
    SkyNodeError
        If no node is connected after ``timeout`` seconds, or ``stop`` is set.
    """
    fixed = fixed_node_count(grid)
    if fixed:
        timeout = min(timeout, SIMULATION_SETTLE_S)
    deadline, seen = time.monotonic() + timeout, -1
    while len(nodes := sorted(grid.get_node_ids())) < min_nodes or min_nodes <= 0:
        if stop is not None and stop.is_set():
            raise SkyNodeError("run stopped by the caller")
        if time.monotonic() > deadline:
            if not nodes:
                raise SkyNodeError(f"no node connected after {timeout:g} s")
            if min_nodes > 0:
                log(WARNING, _shortfall(len(nodes), min_nodes, timeout, fixed))
            else:
                log(
                    INFO,
                    "%d node(s) connected within %g s: planning with them",
                    len(nodes),
                    timeout,
                )
            return nodes
        if len(nodes) != seen:
            if min_nodes > 0:
                log(
                    INFO,
                    "Waiting for nodes: %d of %d connected (after %g s the connected "
                    "ones go on without the rest)",
                    len(nodes),
                    min_nodes,
                    timeout,
                )
            else:
                log(INFO, "Waiting for nodes: %d connected, any within %g s", len(nodes), timeout)
            seen = len(nodes)
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic()) + 0.01))
    return nodes


def _shortfall(have: int, want: int, timeout: float, fixed: bool) -> str:
    """The warning for ``have`` of ``want`` nodes after the wait."""
    if fixed:
        return (
            f"Only {have} of {want} nodes: the simulation runtime started {have} "
            f"SuperNode(s), and no more join later. Start it with the fleet's {want}: "
            f'`flwr run . --federation-config "num-supernodes={want}"` (or '
            f"options.num-supernodes = {want} in the federation's config). The missing "
            f"{want - have} are left out of the plan."
        )
    return (
        f"Only {have} of {want} nodes connected after {timeout:g} s: the missing "
        f"{want - have} are left out of the plan (start their SuperNodes before the run, "
        "or raise node-wait-s; Hydra: messaging.node_wait_s)"
    )
