"""Sky: split-model training across heterogeneous Flower nodes, load-balanced.

Reproduces and improves on SkyComputing (Zhu, Li, You, "Sky Computing: Accelerating
Geo-distributed Computing in Federated Learning", arXiv 2202.11836): a benchmark round
measures every node on the model's own layers and times its link; a partitioner
(``even``, ``heuristic`` or ``optimal``) gives each node a contiguous block of layers
sized to what it can do; then every round each node trains its block as one stage of a
pipeline, activations flowing forward and gradients back through the server (the
``relay`` transport: one hop at a time, or pipelined with several micro-batch groups in
flight on different stages, ``schedule.kind`` ``gpipe`` / ``1f1b``) or peer to peer in a
``torch.distributed.pipelining`` schedule (GPipe or 1F1B) whose rendezvous the server
hands out in one message per stage per round (the ``direct`` transport,
:mod:`sky_flower.pipeline.direct`), and the server reassembles the global model from the stages.
A failed round is recorded, the nodes that caused it are dropped and the model is
re-planned, and the next round starts from the last good global model.
"""

from __future__ import annotations

import io
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log
from torch import nn

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.partition import METHODS, Plan, feasible_bounds, partition
from sky_flower.core.profile import LayerProfile, NodeProfile, profile_layers
from sky_flower.core.profile import default_optimizer_factory as _opt_factory
from sky_flower.pipeline.stage import slice_state


def _short_reason(reason: str, limit: int = 300) -> str:
    """The useful line of an error reply (Flower wraps the node's exception in layers of
    traceback): the text after the last ``Message:``, else the last non-empty line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", reason)
    if "Message:" in text:
        text = text.rsplit("Message:", 1)[1]
    else:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        text = lines[-1] if lines else text
    return text.strip().strip("'\"<>").strip()[:limit]


class SkyNodeError(RuntimeError):
    """A node failed to answer, or answered with an error (the message names it).

    ``nodes``: the names of the nodes that caused it, where known (a ``direct`` round
    also names the peers that stopped because of them; those are not in ``nodes``).
    """

    def __init__(self, message: str, nodes: Sequence[str] | None = None) -> None:
        super().__init__(message)
        self.nodes = None if nodes is None else list(nodes)


class SkyStrategy(Strategy):
    """Split-model training with a benchmark round and a load-balanced layer plan.

    Parameters
    ----------
    model_fn : Callable[[], nn.Sequential]
        Builds the model as an ordered list of layers (the same function the nodes use).
    input_shape : Sequence[int]
        Shape of one input sample, without the batch dimension.
    allocation : str (default: "heuristic")
        ``even``, ``heuristic`` or ``optimal`` (see :mod:`sky_flower.core.partition`).
    schedule : Schedule (default: Schedule())
        Batch size, micro-batches (``schedule.microbatches``), schedule kind, transport.
    optimizer : str (default: "adam")
        Optimizer every stage uses (``adam``, ``sgd``, ``sgd_momentum``).
    lr : float (default: 1e-4)
        Learning rate.
    local_epochs : float (default: 1.0)
        Passes over the data owner's data per round (steps = epochs x examples / batch).
    steps_per_round : int (default: 0)
        If > 0, overrides ``local_epochs``.
    node_order : Sequence[str] (default: ())
        Pipeline order by node name (fleet order); the first data owner is always
        stage 0. Nodes not listed follow in name order.
    min_nodes : int (default: 2)
        Wait for this many connected nodes before the benchmark round (set it to your
        fleet's size: nodes that connect later are not in the plan).
    milp_time_limit_s : float (default: 30.0)
        Time limit of the ``optimal`` MILP.
    benchmark_warmup, benchmark_repeats : int (default: 2, 5)
        Untimed and timed passes per layer in the benchmark round.
    echo_bytes : tuple[int, int] (default: (1 KiB, 4 MiB))
        The two payload sizes timed for latency and bandwidth.
    echo_repeats : int (default: 7)
        Echoes per size (median taken: robust to a stray slow echo).
    echo_jitter_s : float (default: 0.1)
        Random pause (uniform in [0, echo_jitter_s)) before each echo, so the echoes
        sample every phase of the nodes' polling tick (0.1 s in the simulation engine).
    state_probe_bytes : int (default: 64 MiB)
        Size of the probe array stored in a node's ``context.state`` to time what the
        state costs per message (0 disables; see :mod:`sky_flower.core.cost`).
    message_timeout_s : float (default: 120.0)
        A node that does not answer within this time fails the round, by name.
    max_failed_rounds : int (default: 1)
        A round that fails (a node errs, stalls or replies malformed) is recorded with
        its error (``rounds`` and ``failed_rounds``); the nodes it names are dropped
        (the data owner cannot be) and the model is re-planned on the others from the
        benchmark round's profiles, and the next round starts from the last good global
        model. This many consecutive failed rounds end the run with
        :class:`SkyNodeError` (1: the first failed round does).
    direct_timeout_s : float (default: 30.0)
        ``transport=direct``: bound (s) on joining the round's process group and on
        every peer operation; a stage that fails or stalls ends the round for all
        stages within about this time.
    direct_host : str (default: "127.0.0.1")
        ``transport=direct``: address of the round's TCPStore, hosted by the server;
        it must be reachable from every stage node.
    direct_join_timeout_s : float (default: 60.0)
        ``transport=direct``: bound (s) on the stages joining a round (their messages
        may start seconds apart); a stage that never joins ends the round after it.
    seed : int (default: 0)
        Seeds the data owner's batch order.
    on_event : Callable[[str, dict], None], optional
        Called with ``("benchmark", ...)``, ``("plan", ...)``, ``("round", ...)`` so a
        caller can save or print them.
    """

    def __init__(  # noqa: PLR0913
        self,
        model_fn: Callable[[], nn.Module],
        input_shape: Sequence[int],
        allocation: str = "heuristic",
        schedule: Schedule | None = None,
        optimizer: str = "adam",
        lr: float = 1e-4,
        local_epochs: float = 1.0,
        steps_per_round: int = 0,
        node_order: Sequence[str] = (),
        min_nodes: int = 2,
        milp_time_limit_s: float = 30.0,
        benchmark_warmup: int = 2,
        benchmark_repeats: int = 5,
        echo_bytes: tuple[int, int] = (1024, 4 * 1024 * 1024),
        echo_repeats: int = 7,
        echo_jitter_s: float = 0.1,
        state_probe_bytes: int = 64 * 1024 * 1024,
        message_timeout_s: float = 120.0,
        max_failed_rounds: int = 1,
        direct_timeout_s: float = 30.0,
        direct_host: str = "127.0.0.1",
        direct_join_timeout_s: float = 60.0,
        seed: int = 0,
        on_event: Callable[[str, dict], None] | None = None,
    ) -> None:
        if allocation not in METHODS:
            raise ValueError(
                f"unknown allocation {allocation!r}: choose one of {', '.join(METHODS)}"
            )
        _opt_factory(optimizer, lr)  # validates the name early
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not local_epochs > 0 or steps_per_round < 0:
            raise ValueError(
                f"local_epochs must be > 0 (got {local_epochs}) and steps_per_round >= 0 "
                f"(got {steps_per_round}; 0 means: use local_epochs)"
            )
        self.model_fn = model_fn
        self.input_shape = [int(s) for s in input_shape]
        self.allocation = allocation
        self.schedule = schedule or Schedule()
        if self.schedule.transport == "direct" and self.schedule.kind == "sequential":
            raise ValueError(
                "schedule.kind=sequential runs on transport=relay, gpipe and 1f1b on "
                "transport=direct (torch.distributed.pipelining) and on relay: got "
                "kind=sequential, transport=direct"
            )
        if max_failed_rounds < 1 or not direct_timeout_s > 0:
            raise ValueError(
                f"max_failed_rounds must be >= 1 (got {max_failed_rounds}) and "
                f"direct_timeout_s > 0 (got {direct_timeout_s})"
            )
        self.max_failed_rounds = max_failed_rounds
        self.direct_timeout_s, self.direct_host = direct_timeout_s, direct_host
        self.direct_join_timeout_s = direct_join_timeout_s
        self.optimizer, self.lr = optimizer, lr
        self.local_epochs, self.steps_per_round = local_epochs, steps_per_round
        self.node_order = list(node_order)
        self.min_nodes = min_nodes
        self.milp_time_limit_s = milp_time_limit_s
        self.benchmark_warmup, self.benchmark_repeats = benchmark_warmup, benchmark_repeats
        self.echo_bytes, self.echo_repeats = echo_bytes, echo_repeats
        self.state_probe_bytes = state_probe_bytes
        self.echo_jitter_s = echo_jitter_s
        self._rng = np.random.default_rng(seed)
        self.message_timeout_s = message_timeout_s
        self.failed_rounds: list[dict[str, Any]] = []
        self.seed = seed
        self.on_event = on_event or (lambda kind, payload: None)
        self.layer_profiles: list[LayerProfile] = []
        self.node_profiles: list[NodeProfile] = []
        self.num_examples = 0
        self.plan: Plan | None = None
        self.rounds: list[dict[str, Any]] = []
        self.global_arrays: ArrayRecord | None = None  # last good global model
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._ids: dict[str, int] = {}
        # reply polling period (s); sky_flower.app raises it where each poll is an HTTP call
        self.poll_interval_s = 0.002
        self.node_wait_s = 300.0  # wait for min_nodes this long, then plan with those there
        self.cost: CostModel | None = None
        self.group_size = self.schedule.microbatches  # micro-batches per relay message
        self._stage_stats: list[dict[str, float]] = []  # per stage, summed over a round
        self._handler_rate: dict[str, float] = {}  # s/byte a stage message spends on its state

    # ---------------------------------------------------------------------------------
    # messaging
    # ---------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Make the running strategy stop at its next wait (raises ``SkyNodeError``)."""
        self._stop.set()

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise SkyNodeError("run stopped by the caller")

    def _name(self, node_id: int) -> str:
        return f"{self._names.get(node_id, '?')!s} (node {node_id})"

    def exchange(
        self, grid: Grid, messages: list[Message], timeout: float | None = None
    ) -> list[Message]:
        """Push ``messages``, poll for the replies, return them in message order.

        Polls ``Grid.pull_messages`` every ``poll_interval_s`` (2 ms) instead of
        ``send_and_receive``'s 0.1 s.

        Raises
        ------
        SkyNodeError
            Naming the node(s) that timed out or replied with an error.
        """
        timeout = self.message_timeout_s if timeout is None else timeout
        ids = list(grid.push_messages(messages))
        if len(ids) != len(messages):
            raise SkyNodeError(f"only {len(ids)} of {len(messages)} messages could be sent")
        dst = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages, strict=True)}
        pending, got = set(ids), {}
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            self._check_stop()
            for reply in grid.pull_messages(pending):
                got[reply.metadata.reply_to_message_id] = reply
                pending.discard(reply.metadata.reply_to_message_id)
            if pending:
                time.sleep(self.poll_interval_s)
        if pending:
            names = ", ".join(self._name(dst[m]) for m in pending)
            raise SkyNodeError(f"no reply within {timeout:g} s from {names}")
        errors = [
            f"{self._name(dst[m])} replied with an error: {_short_reason(got[m].error.reason)}"
            for m in ids
            if got[m].has_error()
        ]
        if errors:
            raise SkyNodeError("; ".join(errors))
        return [got[m] for m in ids]

    def _msg(self, node_id: int, mtype: str, content: dict, group: str) -> Message:
        return Message(RecordDict(content), dst_node_id=node_id, message_type=mtype, group_id=group)

    # ---------------------------------------------------------------------------------
    # benchmark round
    # ---------------------------------------------------------------------------------
    def wait_for_nodes(self, grid: Grid, timeout: float) -> list[int]:
        """Block until ``min_nodes`` nodes are connected (bounded by ``timeout``).

        After ``timeout`` the nodes that are connected go on to the benchmark round with
        a warning (the missing ones are left out of the plan).

        Raises
        ------
        SkyNodeError
            If no node is connected after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while len(nodes := sorted(grid.get_node_ids())) < self.min_nodes:
            self._check_stop()
            if time.monotonic() > deadline:
                if not nodes:
                    raise SkyNodeError(f"no node connected after {timeout:g} s")
                log(
                    WARNING,
                    "Only %d of %d nodes connected after %g s: the missing %d are left out "
                    "of the plan",
                    len(nodes),
                    self.min_nodes,
                    timeout,
                    self.min_nodes - len(nodes),
                )
                return nodes
            log(INFO, "Waiting for nodes: %d of %d connected", len(nodes), self.min_nodes)
            time.sleep(0.5)
        return nodes

    def profile_model(self) -> list[LayerProfile]:
        """Per-layer FLOPs and bytes of the model (computed once, on the server)."""
        if not self.layer_profiles:
            self.layer_profiles = profile_layers(
                self.model_fn(),
                self.input_shape,
                self.schedule.microbatch_size,
                _opt_factory(self.optimizer, self.lr),
            )
        return self.layer_profiles

    def precheck(self, names: Sequence[str], memory_caps: Sequence[float | None]) -> None:
        """Fail before any node is contacted if the known memory caps (bytes; None =
        unknown) already make every plan infeasible, or ``even`` allocation meets a
        fleet with more nodes than the model has layers.

        Raises
        ------
        InfeasibleMemoryError, ValueError
            As :func:`sky_flower.core.partition.feasible_bounds`.
        """
        layers = self.profile_model()
        nodes = [
            NodeProfile(
                name=name,
                layer_fwd_s=(0.0,) * len(layers),
                layer_bwd_s=(0.0,) * len(layers),
                memory_bytes=int(cap) if cap is not None else 2**62,
            )
            for name, cap in zip(names, memory_caps, strict=True)
        ]
        feasible_bounds(CostModel(layers, nodes, self.schedule))
        if self.allocation == "even" and len(layers) < len(nodes):
            raise ValueError(
                f"even allocation needs at least one layer per node: the model has "
                f"{len(layers)} layers, the fleet {len(nodes)} nodes. Use "
                "allocation=heuristic or allocation=optimal, which may leave nodes idle."
            )

    def benchmark(self, grid: Grid, node_ids: list[int]) -> list[NodeProfile]:
        """Run the benchmark round: ``query.sky_profile`` per node, then echo timing.

        A node whose reply is an error is left out with a warning; the data owner
        must answer.
        """
        mb = self.schedule.microbatch_size
        self.profile_model()
        cfg = ConfigRecord(
            {
                "input_shape": self.input_shape,
                "microbatch_size": mb,
                "warmup": self.benchmark_warmup,
                "repeats": self.benchmark_repeats,
                "optimizer": self.optimizer,
                "lr": self.lr,
            }
        )
        profiles: dict[int, ConfigRecord] = {}
        result: list[NodeProfile] = []
        num_examples: dict[int, int] = {}
        num_layers = len(self.layer_profiles)
        for nid in node_ids:  # one at a time: concurrent timing on shared cores lies
            try:
                (reply,) = self.exchange(
                    grid, [self._msg(nid, "query.sky_profile", {"config": cfg}, "benchmark")]
                )
                prof = reply.content.config_records["profile"]
                name = str(prof["name"])
                if name in self._ids:
                    raise SkyNodeError(f"node name {name!r} is already taken by another node")
                self._names[nid] = name
                fwd = tuple(float(t) for t in prof["layer_fwd_s"])
                bwd = tuple(float(t) for t in prof["layer_bwd_s"])
                if len(fwd) != num_layers or len(bwd) != num_layers:
                    raise SkyNodeError(
                        f"reported times for {len(fwd)}/{len(bwd)} layers, the model has "
                        f"{num_layers}: is it running the same model_fn?"
                    )
                # one optimizer step per training step, spread over its micro-batches
                steps = [float(t) for t in prof.get("layer_step_s", [0.0] * num_layers)]
                if len(steps) != num_layers:
                    raise SkyNodeError(f"reported optimizer steps for {len(steps)} layers")
                M = self.schedule.microbatches
                bwd = tuple(t + o / M for t, o in zip(bwd, steps, strict=True))
                examples = int(prof["num_examples"])
                if self.schedule.transport == "direct":
                    lat, bw, state_rate = self._peer_link(prof)
                else:
                    lat, bw, state_rate = self._time_link(grid, nid)
                    # every stage message rebuilds its stage from the state; about half of
                    # them (those that step the optimizer) also save it back
                    handler_rate = float(prof.get("state_rebuild_s_per_byte", 0.0))
                    handler_rate += 0.5 * float(prof.get("state_save_s_per_byte", 0.0))
                    self._handler_rate[name] = handler_rate
                    state_rate += handler_rate
                node = NodeProfile(
                    name=name,
                    layer_fwd_s=fwd,
                    layer_bwd_s=bwd,
                    memory_bytes=int(prof["memory_bytes"]),
                    latency_s=lat,
                    bandwidth_bps=bw,
                    state_s_per_byte=state_rate,
                    holds_data=bool(prof["holds_data"]),
                    slowdown=float(prof["slowdown"]),
                    node_id=nid,
                )
            except (SkyNodeError, KeyError, TypeError, ValueError) as err:
                log(
                    WARNING,
                    "Benchmark: leaving %s out of the plan: %s",
                    self._name(nid),
                    err,
                )
                continue
            profiles[nid] = prof
            num_examples[nid] = examples
            result.append(node)
            self._ids[name] = nid
        if not any(n.holds_data for n in result):
            raise SkyNodeError("no data owner answered the benchmark round: cannot train")
        ordered = self._order(result)
        owners = [n for n in ordered if n.holds_data]
        self.num_examples = num_examples[owners[0].node_id]
        if len(owners) > 1:
            log(
                WARNING,
                "%d data owners; one pipeline headed by %r is built, the others' data is "
                "unused (several pipelines are not built yet)",
                len(owners),
                owners[0].name,
            )
        self.node_profiles = ordered
        emulation = {str(p["name"]): str(p.get("emulation", "")) for p in profiles.values()}
        log(INFO, "Benchmark round:\n%s", self.benchmark_table(emulation))
        self.on_event(
            "benchmark",
            {
                "layers": [lp.to_dict() for lp in self.layer_profiles],
                "nodes": [
                    {**n.to_dict(), "emulation": emulation[n.name]} for n in self.node_profiles
                ],
            },
        )
        return ordered

    def _echo(self, grid: Grid, nid: int, size: int, store_bytes: int = 0) -> float:
        # A random pause first: Flower's nodes pick up messages on a fixed polling tick,
        # so back-to-back echoes would all land on the same phase of it and hide both
        # the tick (half of it on average) and the payload's own cost.
        if self.echo_jitter_s > 0:
            time.sleep(self._rng.uniform(0.0, self.echo_jitter_s))
        payload = ArrayRecord({"p": torch.zeros(size, dtype=torch.uint8)})
        cfg = ConfigRecord({"store_bytes": store_bytes})
        t0 = time.perf_counter()
        self.exchange(
            grid, [self._msg(nid, "query.sky_echo", {"payload": payload, "config": cfg}, "echo")]
        )
        return time.perf_counter() - t0

    def _time_link(self, grid: Grid, nid: int) -> tuple[float, float, float]:
        """Latency (s per round trip), bandwidth (bytes/s) and context-state cost (s per
        byte per message) from echoes: two payload sizes, then the small one again with
        a ``state_probe_bytes`` array stored in the node's ``context.state``."""
        self._echo(grid, nid, self.echo_bytes[0])  # warm-up, not timed
        small, big = self.echo_bytes
        t_small = statistics.median(self._echo(grid, nid, small) for _ in range(self.echo_repeats))
        t_big = statistics.median(self._echo(grid, nid, big) for _ in range(self.echo_repeats))
        dt = t_big - t_small
        bandwidth = 2.0 * (big - small) / dt if dt > 1e-4 else float("inf")
        latency = t_small - (2.0 * small / bandwidth if bandwidth != float("inf") else 0.0)
        state_rate = 0.0
        if self.state_probe_bytes > 0:
            self._echo(grid, nid, small, store_bytes=self.state_probe_bytes)
            t_state = statistics.median(
                self._echo(grid, nid, small) for _ in range(self.echo_repeats)
            )
            self._echo(grid, nid, small, store_bytes=-1)
            state_rate = max(t_state - t_small, 0.0) / self.state_probe_bytes
        return max(latency, 0.0), bandwidth, state_rate

    @staticmethod
    def _peer_link(prof: ConfigRecord) -> tuple[float, float, float]:
        """``transport=direct``: a stage's peer link as the fleet emulates it (latency s,
        bandwidth bytes/s, no per-message state cost). Stages talk over loopback here
        (well under a millisecond per hop), so the emulated link, which each stage
        sleeps per peer message, is what the planner charges."""
        lat = float(prof.get("link_latency_s", 0.0))
        bw = float(prof.get("link_bandwidth_bps", 0.0))
        return lat, bw if bw > 0 else float("inf"), 0.0

    def _order(self, nodes: list[NodeProfile]) -> list[NodeProfile]:
        rank = {name: i for i, name in enumerate(self.node_order)}
        ordered = sorted(nodes, key=lambda n: (rank.get(n.name, len(rank)), n.name))
        owner = next(n for n in ordered if n.holds_data)
        return [owner] + [n for n in ordered if n is not owner]

    def benchmark_table(self, emulation: dict[str, str] | None = None) -> str:
        """The benchmark round's results as a text table."""
        emulation = emulation or {}
        head = (
            f"{'node':<12} {'data':>4} {'fwd+bwd ms':>10} {'memory MiB':>10} "
            f"{'latency ms':>10} {'bw MB/s':>9} {'state ms/MiB':>12}  emulation"
        )
        rows = [head, "-" * (len(head) + 20)]
        for n in self.node_profiles:
            bw = "inf" if n.bandwidth_bps == float("inf") else f"{n.bandwidth_bps / 1e6:.1f}"
            rows.append(
                f"{n.name:<12} {'yes' if n.holds_data else 'no':>4} "
                f"{(sum(n.layer_fwd_s) + sum(n.layer_bwd_s)) * 1e3:10.2f} "
                f"{n.memory_bytes / 2**20:10.1f} {n.latency_s * 1e3:10.1f} {bw:>9} "
                f"{n.state_s_per_byte * 1e3 * 2**20:12.2f}  "
                f"{emulation.get(n.name, '')}"
            )
        return "\n".join(rows)

    def make_plan(self) -> Plan:
        """Partition the profiled model over the profiled nodes."""
        cost = self.cost = CostModel(self.layer_profiles, self.node_profiles, self.schedule)
        self.plan = partition(cost, self.allocation, time_limit_s=self.milp_time_limit_s)
        log(INFO, "Plan (%s):\n%s", self.allocation, self.plan.table())
        if self.schedule.kind != "sequential" and self.schedule.transport == "relay":
            self.group_size = cost.relay_group_size(cost.terms(self._plan_stages()))
            log(
                INFO,
                "Pipelined relay (%s): %d micro-batch(es) per message, %d message group(s) "
                "per step",
                self.schedule.kind,
                self.group_size,
                self.schedule.microbatches // self.group_size,
            )
        # What the other allocations would predict on this same benchmark (a fair
        # comparison: separate runs measure their own, noisy, profiles).
        alternatives: dict[str, float | None] = {}
        for method in METHODS:
            try:
                other = self.plan if method == self.allocation else None
                other = other or partition(cost, method, time_limit_s=self.milp_time_limit_s)
                alternatives[method] = other.predicted_step_time_s
            except ValueError:  # e.g. even does not fit memory
                alternatives[method] = None
        log(
            INFO,
            "Predicted step time on this benchmark: %s",
            ", ".join(
                f"{m} {'infeasible' if t is None else f'{t:.4f} s'}"
                for m, t in alternatives.items()
            ),
        )
        self.on_event(
            "plan",
            {
                **self.plan.to_dict(),
                "alternatives": alternatives,
                "microbatches_per_message": self.group_size,
            },
        )
        return self.plan

    def _plan_stages(self) -> list[tuple[int, int, int]]:
        assert self.plan is not None
        return [(s.node_index, s.first_layer, s.last_layer) for s in self.plan.stages]

    def stage_predictions(self) -> list[dict[str, Any]]:
        """Per stage and step, what the cost model predicts (seconds): ``compute_s``
        (forward + backward of the step's ``M`` micro-batches, recomputation, optimizer
        step and the node's emulated slowdown included), ``busy_s`` (time inside its
        message handlers: ``compute_s``, the payload time charged on the node, and
        rebuilding / saving the stage from / to ``context.state``; the emulated
        per-message link latency is not in it) and ``messages`` (Flower messages the
        stage handles per step)."""
        assert self.plan is not None and self.cost is not None
        t = self.cost.terms(self._plan_stages())
        M, S = self.schedule.microbatches, len(self.plan.stages)
        groups = M // self.group_size
        out = []
        for k, st in enumerate(self.plan.stages):
            compute = M * float(t.fwd[k] + t.bwd[k])
            payload = 2 * M * float(t.node_link[k]) if t.node_link is not None else 0.0
            messages = groups * (1 if k == S - 1 else 2)
            state = float(
                self.cost.state_prefix[st.last_layer + 1] - self.cost.state_prefix[st.first_layer]
            )
            handler = messages * self._handler_rate.get(st.node, 0.0) * state
            out.append(
                {
                    "node": st.node,
                    "compute_s": compute,
                    "busy_s": compute + payload + handler,
                    "messages": messages,
                }
            )
        return out

    # ---------------------------------------------------------------------------------
    # Strategy interface
    # ---------------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``train.sky_setup`` message per stage: its layer slice and settings."""
        assert self.plan is not None, "run the benchmark round and make_plan() first"
        full = arrays.to_torch_state_dict()
        num_layers = len(self.layer_profiles)
        msgs = []
        for k, st in enumerate(self.plan.stages):
            cfg = ConfigRecord(
                {
                    **dict(config),
                    "stage": k,
                    "first": st.first_layer,
                    "last": st.last_layer,
                    "is_first": k == 0,
                    "is_last": st.last_layer == num_layers - 1,
                    "microbatches": self.schedule.microbatches,
                    "batch_size": self.schedule.batch_size,
                    "optimizer": self.optimizer,
                    "lr": self.lr,
                    "round": server_round,
                    "seed": self.seed,
                }
            )
            weights = ArrayRecord(slice_state(full, st.first_layer, st.last_layer))
            msgs.append(
                self._msg(
                    self._ids[st.node],
                    "train.sky_setup",
                    {"weights": weights, "config": cfg},
                    str(server_round),
                )
            )
        return msgs

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Reassemble the global model from the stages' ``weights`` replies.

        Every layer must come back exactly once (one pipeline); a missing or duplicated
        layer raises ``SkyNodeError``.
        """
        merged: dict[str, torch.Tensor] = {}
        for reply in replies:
            if reply.has_error():
                raise SkyNodeError(
                    f"{self._name(reply.metadata.src_node_id)}: {reply.error.reason}"
                )
            for key, value in reply.content.array_records["weights"].to_torch_state_dict().items():
                if key in merged:
                    raise SkyNodeError(f"layer tensor {key} returned twice")
                merged[key] = value
        expected = set(self.model_fn().state_dict().keys())
        if set(merged) != expected:
            missing = sorted(expected - set(merged))
            raise SkyNodeError(f"stages returned an incomplete model; missing {missing[:5]}")
        return ArrayRecord(merged), None

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No node-side evaluation: the server evaluates on its held-out test split."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """No node-side evaluation."""
        return None

    def summary(self) -> None:
        """Log the strategy's settings."""
        s = self.schedule
        log(INFO, "\t├── Allocation: %s", self.allocation)
        log(
            INFO,
            "\t├── Schedule: batch %d, %d micro-batch(es), %s, transport %s",
            s.batch_size,
            s.microbatches,
            s.kind,
            s.transport,
        )
        log(INFO, "\t└── Optimizer: %s (lr %g) on every stage", self.optimizer, self.lr)

    # ---------------------------------------------------------------------------------
    # one training step through the pipeline (relay transport)
    # ---------------------------------------------------------------------------------
    def _take(self, reply: Message, key: str, shape: tuple[int, ...] | None = None) -> ArrayRecord:
        """Array record ``key`` of a stage's reply, checked: present, holding array
        ``key``, of ``shape`` when given (a malformed reply fails the round by name
        instead of crashing the server)."""
        node = self._name(reply.metadata.src_node_id)
        rec = reply.content.array_records.get(key)
        if rec is None or key not in rec:
            raise SkyNodeError(f"{node}: reply to {reply.metadata.message_type} lacks {key!r}")
        if shape is not None and tuple(rec[key].shape) != tuple(shape):
            raise SkyNodeError(
                f"{node}: {key!r} has shape {tuple(rec[key].shape)}, expected {tuple(shape)}"
            )
        return rec

    def _metrics(self, reply: Message) -> tuple[float, int, int]:
        m = reply.content.metric_records.get("metrics")
        if m is None or not {"loss", "correct", "n"} <= set(m):
            raise SkyNodeError(f"{self._name(reply.metadata.src_node_id)}: reply lacks metrics")
        return float(m["loss"]), int(m["correct"]), int(m["n"])

    def _note(self, k: int, reply: Message) -> None:
        """Add a stage's reply to this round's per-stage figures: messages, its reported
        ``compute_s`` (times ``1 + slowdown``: the emulated device's compute) and
        ``busy_s`` (wall time inside the handler)."""
        while len(self._stage_stats) <= k:
            self._stage_stats.append({"messages": 0, "compute_s": 0.0, "busy_s": 0.0})
        st = self._stage_stats[k]
        st["messages"] += 1
        m = reply.content.metric_records.get("metrics")
        if m is None:
            return
        slowdown = next(
            (n.slowdown for n in self.node_profiles if n.node_id == reply.metadata.src_node_id),
            0.0,
        )
        st["compute_s"] += float(m.get("compute_s", 0.0)) * (1.0 + slowdown)
        st["busy_s"] += float(m.get("busy_s", 0.0))

    def _train_step(self, grid: Grid, step: int, group: str) -> tuple[float, int, int]:
        """One step through the pipeline: forward hops, loss at the last stage, backward
        hops. Returns ``(batch loss, correct predictions, samples)``.

        ``schedule.kind=sequential``: one message per hop, each carrying the whole batch
        (the stage splits it into micro-batches); ``gpipe``/``1f1b``:
        :meth:`_train_step_pipelined`."""
        if self.schedule.kind != "sequential":
            return self._train_step_pipelined(grid, step, group)
        assert self.plan is not None
        ids = [self._ids[st.node] for st in self.plan.stages]
        S, B = len(ids), self.schedule.batch_size
        step_cfg = ConfigRecord({"step": step})
        (reply,) = self.exchange(
            grid, [self._msg(ids[0], "train.sky_forward", {"step": step_cfg}, group)]
        )
        self._note(0, reply)
        if S == 1:
            return self._metrics(reply)
        labels = self._take(reply, "labels", (B,))
        act = self._take(reply, "act")
        shapes = [tuple(act["act"].shape)]  # activation shape entering stage k
        for k in range(1, S):
            if shapes[-1][0] != B:
                raise SkyNodeError(f"stage {k - 1} sent {shapes[-1][0]} activations, not {B}")
            content: dict[str, Any] = {"act": act}
            if k == S - 1:
                content["labels"] = labels
            (reply,) = self.exchange(grid, [self._msg(ids[k], "train.sky_forward", content, group)])
            self._note(k, reply)
            if k < S - 1:
                act = self._take(reply, "act")
                shapes.append(tuple(act["act"].shape))
        metrics = self._metrics(reply)
        grad = self._take(reply, "grad", shapes[-1])
        for k in range(S - 2, -1, -1):
            (reply,) = self.exchange(
                grid, [self._msg(ids[k], "train.sky_backward", {"grad": grad}, group)]
            )
            self._note(k, reply)
            if k > 0:
                grad = self._take(reply, "grad", shapes[k - 1])
        return metrics

    def _train_step_pipelined(self, grid: Grid, step: int, group: str) -> tuple[float, int, int]:
        """One step of the pipelined relay (``schedule.kind`` ``gpipe`` or ``1f1b``).

        The step's ``M`` micro-batches travel in ``G = M / c`` message groups of ``c``
        (``self.group_size``). Each stage runs its groups in the schedule's order
        (:func:`sky_flower.core.simulate.stage_order`; GPipe: all forwards, then all
        backwards, Huang et al. 2019, arXiv 1811.06965; 1F1B: PipeDream-Flush, Narayanan
        et al. 2021, arXiv 2006.09503); the last stage runs forward, loss and backward of
        a group in one message. The server pushes a stage's next op as soon as its input
        has arrived, so stage ``k + 1`` works on group ``g`` while stage ``k`` works on
        ``g + 1``. At most one message is in flight per stage: Flower's simulation engine
        dispatches a node's queued messages to different workers with the same
        ``context.state`` and keeps the last write (flwr ``vce_api.worker``), so
        concurrent messages to one node would lose updates.

        Returns ``(batch loss, correct predictions, samples)``.

        Raises
        ------
        SkyNodeError
            Naming the node that failed, sent a malformed reply or timed out.
        """
        from sky_flower.core.simulate import stage_order

        assert self.plan is not None
        ids = [self._ids[st.node] for st in self.plan.stages]
        S, M, c = len(ids), self.schedule.microbatches, self.group_size
        G, rows = M // c, c * self.schedule.microbatch_size
        orders = [
            [op for op in order if k < S - 1 or op[0] == "F"]
            for k, order in enumerate(stage_order(self.schedule.kind, S, G, interleave_last=True))
        ]
        ptr = [0] * S
        acts: dict[tuple[int, int], ArrayRecord] = {}  # (stage, group) -> input activation
        grads: dict[tuple[int, int], ArrayRecord] = {}  # (stage, group) -> output gradient
        labels: dict[int, ArrayRecord] = {}
        in_shape: dict[tuple[int, int], tuple[int, ...]] = {}
        inflight: dict[str, tuple[int, str, int, float]] = {}  # id -> stage, op, group, t
        busy: set[int] = set()
        loss, correct, seen = 0.0, 0, 0

        def ready(k: int, op: str, g: int) -> dict[str, Any] | None:
            content: dict[str, Any] = {
                "mb": ConfigRecord({"step": step, "first": g * c, "count": c})
            }
            if op == "F":
                if k > 0:
                    if (k, g) not in acts or (k == S - 1 and g not in labels):
                        return None
                    content["act"] = acts.pop((k, g))
                    if k == S - 1:
                        content["labels"] = labels.pop(g)
            else:
                if (k, g) not in grads:
                    return None
                content["grad"] = grads.pop((k, g))
            return content

        try:
            while inflight or any(ptr[k] < len(orders[k]) for k in range(S)):
                self._check_stop()
                push, meta = [], []
                for k in range(S):
                    if k in busy or ptr[k] >= len(orders[k]):
                        continue
                    op, g = orders[k][ptr[k]]
                    content = ready(k, op, g)
                    if content is None:
                        continue
                    mtype = "train.sky_pipe_fwd" if op == "F" else "train.sky_pipe_bwd"
                    push.append(self._msg(ids[k], mtype, content, group))
                    meta.append((k, op, g))
                    ptr[k] += 1
                    busy.add(k)
                if push:
                    pushed = list(grid.push_messages(push))
                    if len(pushed) != len(push):
                        raise SkyNodeError(
                            f"only {len(pushed)} of {len(push)} messages could be sent"
                        )
                    now = time.monotonic()
                    for mid, (k, op, g) in zip(pushed, meta, strict=True):
                        inflight[mid] = (k, op, g, now)
                if not inflight:  # nothing pushed, nothing pending: cannot happen for
                    # GPipe / 1F1B orders; guards against a schedule that waits on itself
                    raise SkyNodeError(f"{self.schedule.kind} schedule stalled at ops {ptr}")
                got = list(grid.pull_messages(list(inflight)))
                for reply in got:
                    k, op, g, _ = inflight.pop(reply.metadata.reply_to_message_id)
                    busy.discard(k)
                    node = self._name(ids[k])
                    if reply.has_error():
                        raise SkyNodeError(
                            f"{node} replied with an error: {_short_reason(reply.error.reason)}"
                        )
                    self._note(k, reply)
                    if op == "F" and k < S - 1:
                        act = self._take(reply, "act")
                        shape = tuple(act["act"].shape)
                        if shape[0] != rows:
                            raise SkyNodeError(f"{node} sent {shape[0]} activations, not {rows}")
                        acts[(k + 1, g)], in_shape[(k + 1, g)] = act, shape
                        if k == 0:
                            labels[g] = self._take(reply, "labels", (rows,))
                    elif op == "F":  # last stage: loss and backward done
                        lo, co, n = self._metrics(reply)
                        loss, correct, seen = loss + lo, correct + co, seen + n
                        if S > 1:
                            grads[(k - 1, g)] = self._take(reply, "grad", in_shape[(k, g)])
                    elif k > 0:
                        grads[(k - 1, g)] = self._take(reply, "grad", in_shape[(k, g)])
                if not got:
                    now = time.monotonic()
                    late = [m for m, v in inflight.items() if now - v[3] > self.message_timeout_s]
                    if late:
                        names = ", ".join(self._name(ids[inflight[m][0]]) for m in late)
                        raise SkyNodeError(
                            f"no reply within {self.message_timeout_s:g} s from {names}"
                        )
                    time.sleep(0.002)
        except SkyNodeError:
            self._drain(grid, inflight)
            raise
        return loss, correct, seen

    def _drain(self, grid: Grid, inflight: dict[str, Any], limit_s: float = 10.0) -> None:
        """After a failed pipelined step: wait (at most ``limit_s``) for the replies still
        in flight, so no stage is left running a stale message when the caller goes on;
        their contents and errors are dropped."""
        deadline = time.monotonic() + min(limit_s, self.message_timeout_s)
        pending = set(inflight)
        while pending and time.monotonic() < deadline:
            for reply in grid.pull_messages(list(pending)):
                pending.discard(reply.metadata.reply_to_message_id)
            time.sleep(0.01)
        if pending:
            log(WARNING, "%d pipelined message(s) still unanswered after a failure", len(pending))

    def _stage_report(self, steps: int) -> list[dict[str, Any]]:
        """Measured against predicted, per stage and step (seconds): ``compute_s``,
        ``busy_s`` (see :meth:`stage_predictions`) and ``messages``."""
        rows = []
        for k, pred in enumerate(self.stage_predictions()):
            got = self._stage_stats[k] if k < len(self._stage_stats) else {}
            rows.append(
                {
                    "stage": k,
                    "node": pred["node"],
                    "messages": got.get("messages", 0) / steps,
                    "predicted_messages": pred["messages"],
                    "measured_compute_s": got.get("compute_s", 0.0) / steps,
                    "predicted_compute_s": pred["compute_s"],
                    "measured_busy_s": got.get("busy_s", 0.0) / steps,
                    "predicted_busy_s": pred["busy_s"],
                }
            )
        return rows

    @staticmethod
    def _log_stages(row: dict[str, Any]) -> None:
        """Log a round's measured against predicted step and per-stage figures."""
        lines = [
            f"round {row['round']}: step measured {row['measured_step_time_s']:.4f} s, "
            f"predicted {row['predicted_step_time_s']:.4f} s "
            f"({row['measured_step_time_s'] / row['predicted_step_time_s'] - 1:+.0%}); "
            f"{row['microbatches_per_message']} micro-batch(es) per message",
            f"{'stage':>5} {'node':<12} {'msgs':>5} {'compute s':>10} {'predicted':>10} "
            f"{'busy s':>8} {'predicted':>10}",
        ]
        for st in row["stages"]:
            lines.append(
                f"{st['stage']:>5} {st['node']:<12} {st['messages']:>5.0f} "
                f"{st['measured_compute_s']:>10.4f} {st['predicted_compute_s']:>10.4f} "
                f"{st['measured_busy_s']:>8.4f} {st['predicted_busy_s']:>10.4f}"
            )
        log(INFO, "Measured vs predicted, per step:\n%s", "\n".join(lines))

    def _recover(self, rnd: int, err: SkyNodeError) -> list[str]:
        """After round ``rnd`` failed with ``err`` (and the run goes on): drop the nodes
        that caused it (``err.nodes``, else every node ``err`` names) and re-plan on the
        others; return the names dropped. The data owner is never dropped (stage 0 needs
        its data): a round it failed is simply retried, as is one whose nodes cannot be
        dropped (the others cannot hold the model). Records ``failed_rounds``."""
        text = str(err)
        if err.nodes is not None:
            failed = [n for n in self.node_profiles if n.name in err.nodes]
        else:
            failed = [n for n in self.node_profiles if self._name(n.node_id) in text]
        failed = [n for n in failed if n is not self.node_profiles[0]]
        names = [n.name for n in failed]
        dropped: list[str] = []
        if failed:
            keep = [n for n in self.node_profiles if n not in failed]
            old = self.node_profiles
            self.node_profiles = keep
            try:
                self.make_plan()
                dropped = names
            except ValueError as plan_err:  # e.g. the others cannot hold the model
                self.node_profiles = old
                self.make_plan()
                log(WARNING, "Cannot re-plan without %s: %s", ", ".join(names), plan_err)
        for name in dropped:
            self._ids.pop(name, None)
        self.failed_rounds.append({"round": rnd, "error": text, "dropped_nodes": dropped})
        if dropped:
            log(
                WARNING,
                "Round %d failed; dropped %s and re-planned on %d node(s)",
                rnd,
                ", ".join(dropped),
                len(self.node_profiles),
            )
        return dropped

    # ---------------------------------------------------------------------------------
    # one round on the direct transport (torch.distributed.pipelining, peer to peer)
    # ---------------------------------------------------------------------------------
    def configure_direct(
        self, server_round: int, arrays: ArrayRecord, steps: int, host: Any
    ) -> list[Message]:
        """One ``train.sky_direct`` message per stage: its layer slice, settings, rank,
        the node it is planned for, and the round's rendezvous (``host`` is a
        :class:`sky_flower.pipeline.direct.RoundHost`); only these messages carry it."""
        from sky_flower.pipeline.direct import stage_input_shapes

        assert self.plan is not None
        full = arrays.to_torch_state_dict()
        stages = self.plan.stages
        bounds = [(st.first_layer, st.last_layer) for st in stages]
        shapes = stage_input_shapes(self.model_fn, self.input_shape, bounds)
        by_name = {n.name: n for n in self.node_profiles}

        def link(k: int) -> tuple[float, float]:
            if not 0 <= k < len(stages):
                return 0.0, 0.0
            node = by_name[stages[k].node]
            bw = node.bandwidth_bps
            return node.latency_s, 0.0 if bw == float("inf") else bw

        msgs = []
        for k, st in enumerate(stages):
            rdv = host.rendezvous(k)
            (lat, bw), (nlat, nbw), (plat, pbw) = link(k), link(k + 1), link(k - 1)
            cfg = ConfigRecord(
                {
                    "stage": k,
                    "first": st.first_layer,
                    "last": st.last_layer,
                    "input_shape": list(shapes[k]),
                    "microbatches": self.schedule.microbatches,
                    "batch_size": self.schedule.batch_size,
                    "kind": self.schedule.kind,
                    "optimizer": self.optimizer,
                    "lr": self.lr,
                    "round": server_round,
                    "seed": self.seed,
                    "steps": steps,
                    "node_id": self._ids[st.node],
                    "rank": rdv.rank,
                    "world_size": rdv.world_size,
                    "host": rdv.host,
                    "port": rdv.port,
                    "key": rdv.key,
                    "ticket": rdv.ticket,
                    "timeout_s": rdv.timeout_s,
                    "join_timeout_s": rdv.join_timeout_s,
                    "link_latency_s": lat,
                    "link_bandwidth_bps": bw,
                    "next_latency_s": nlat,
                    "next_bandwidth_bps": nbw,
                    "prev_latency_s": plat,
                    "prev_bandwidth_bps": pbw,
                }
            )
            weights = ArrayRecord(slice_state(full, st.first_layer, st.last_layer))
            msgs.append(
                self._msg(
                    self._ids[st.node],
                    "train.sky_direct",
                    {"weights": weights, "config": cfg},
                    str(server_round),
                )
            )
        return msgs

    def _direct_round(
        self, grid: Grid, server_round: int, arrays: ArrayRecord, steps: int
    ) -> tuple[ArrayRecord, dict[str, Any]]:
        """Run one round on the ``direct`` transport: host the round's TCPStore, push one
        message per stage, wait for every stage's weights and timings.

        Waits at most ``message_timeout_s`` plus 3 x the predicted round; once one stage
        has failed, at most ``max(direct_timeout_s, direct_join_timeout_s)`` + 5 s more
        for the others (they stop within ``direct_timeout_s`` mid-round: gloo's timeout,
        or at once when a peer's sockets close; within ``direct_join_timeout_s`` while
        joining).

        Raises
        ------
        SkyNodeError
            Naming the stage(s) that failed or did not answer first, then those that
            stopped waiting for them.
        """
        from sky_flower.pipeline.direct import PEER_FAILURE, RoundHost

        assert self.plan is not None
        stages = self.plan.stages
        S = len(stages)
        t0 = time.perf_counter()
        with RoundHost(
            S, self.direct_timeout_s, self.direct_host, self.direct_join_timeout_s
        ) as host:
            msgs = self.configure_direct(server_round, arrays, steps, host)
            ids = list(grid.push_messages(msgs))
            if len(ids) != S:
                raise SkyNodeError(f"only {len(ids)} of {S} stage messages could be sent")
            rank = {mid: k for k, mid in enumerate(ids)}
            got: dict[str, Message] = {}
            budget = self.message_timeout_s + 3.0 * steps * self.plan.predicted_step_time_s
            deadline = time.monotonic() + budget
            while len(got) < S and time.monotonic() < deadline:
                self._check_stop()
                for reply in grid.pull_messages([m for m in ids if m not in got]):
                    got[reply.metadata.reply_to_message_id] = reply
                    if reply.has_error():  # the others stop within direct_timeout_s
                        deadline = min(deadline, time.monotonic() + self.direct_timeout_s + 5.0)
                if len(got) < S:
                    time.sleep(0.005)
        wall = time.perf_counter() - t0

        def who(mid: str) -> str:
            return f"stage {rank[mid]} on {self._name(self._ids[stages[rank[mid]].node])}"

        culprits, waited, causes = [], [], []
        for mid in ids:
            if mid not in got:
                culprits.append(f"{who(mid)} did not answer within {budget:g} s")
                causes.append(stages[rank[mid]].node)
            elif got[mid].has_error():
                reason = _short_reason(got[mid].error.reason)
                peer = PEER_FAILURE in reason
                (waited if peer else culprits).append(f"{who(mid)} failed: {reason}")
                if not peer:
                    causes.append(stages[rank[mid]].node)
        if culprits or waited:
            raise SkyNodeError("; ".join(culprits + waited), nodes=causes or None)
        replies = [got[m] for m in ids]
        try:
            return self._parse_direct(server_round, replies, arrays, steps, wall)
        except (KeyError, TypeError, ValueError, IndexError) as err:  # a malformed reply
            raise SkyNodeError(
                f"a stage sent a malformed reply: {type(err).__name__}: {err}"
            ) from err

    def _parse_direct(
        self,
        server_round: int,
        replies: list[Message],
        arrays: ArrayRecord,
        steps: int,
        wall: float,
    ) -> tuple[ArrayRecord, dict[str, Any]]:
        """Check and merge the stages' replies of a ``direct`` round (weights of the
        shapes sent, metrics for every step).

        Raises
        ------
        SkyNodeError
            Naming the node whose reply is malformed.
        """
        assert self.plan is not None
        stages, S = self.plan.stages, len(self.plan.stages)
        sent = {k: tuple(v.shape) for k, v in arrays.items()}
        for reply in replies:
            rec = reply.content.array_records.get("weights")
            if rec is None:
                raise SkyNodeError(f"{self._name(reply.metadata.src_node_id)}: reply lacks weights")
            for key in rec.keys():
                if key not in sent or tuple(rec[key].shape) != sent[key]:
                    got_shape = tuple(rec[key].shape)
                    raise SkyNodeError(
                        f"{self._name(reply.metadata.src_node_id)}: weight {key!r} has shape "
                        f"{got_shape}, expected {sent.get(key)}"
                    )
        new_arrays, _ = self.aggregate_train(server_round, replies)
        assert new_arrays is not None
        metrics = []
        for reply in replies:
            m = reply.content.metric_records.get("metrics")
            if m is None or not {"step_times_s", "setup_s", "compute_s"} <= set(m):
                raise SkyNodeError(f"{self._name(reply.metadata.src_node_id)}: reply lacks metrics")
            metrics.append(m)
        last = metrics[-1]
        losses = [float(v) for v in last["losses"]]  # type: ignore[union-attr]
        times = np.array([list(m["step_times_s"]) for m in metrics], dtype=float)  # type: ignore[arg-type]
        if times.shape != (S, steps) or len(losses) != steps:
            raise SkyNodeError(
                f"stages reported {times.shape} step times and {len(losses)} losses for "
                f"{S} stages x {steps} steps"
            )
        per_stage = []
        for k, (st, m) in enumerate(zip(stages, metrics, strict=True)):
            node = next(n for n in self.node_profiles if n.name == st.node)
            per_stage.append(
                {
                    "stage": k,
                    "node": st.node,
                    "measured_compute_s": float(m["compute_s"]) * (1.0 + node.slowdown) / steps,  # type: ignore[arg-type]
                    "predicted_compute_s": self.schedule.microbatches * st.compute_s,
                    "median_step_s": float(np.median(times[k])),
                }
            )
        return new_arrays, {
            "losses": losses,
            "correct": int(last["correct"]),  # type: ignore[arg-type]
            "seen": int(last["n"]),  # type: ignore[arg-type]
            "step_times": [float(t) for t in times.max(axis=0)],
            "setup_s": max(float(m["setup_s"]) for m in metrics),  # type: ignore[arg-type]
            "wall_s": wall,
            "stages": per_stage,
        }

    def _log_direct_stages(self, rnd: int, row: dict[str, Any]) -> None:
        """Log measured against predicted compute per stage and step (``direct``)."""
        lines = [
            f"{'stage':>5}  {'node':<12} {'compute/step s':>14} {'predicted s':>11} "
            f"{'median step s':>13}"
        ]
        for st in row["stages"]:
            lines.append(
                f"{st['stage']:5d}  {st['node']:<12} {st['measured_compute_s']:14.4f} "
                f"{st['predicted_compute_s']:11.4f} {st['median_step_s']:13.4f}"
            )
        log(
            INFO,
            "Round %d (direct, %s): set-up %.3f s, step %.4f s measured vs %.4f s predicted; "
            "per stage (compute includes the emulated slowdown):\n%s",
            rnd,
            self.schedule.kind,
            row["setup_s"],
            row["measured_step_time_s"],
            row["predicted_step_time_s"],
            "\n".join(lines),
        )

    def steps_in_round(self) -> int:
        """Training steps per round."""
        if self.steps_per_round > 0:
            return self.steps_per_round
        per_epoch = self.num_examples // self.schedule.batch_size
        if per_epoch < 1:
            raise ValueError(
                f"the data owner has {self.num_examples} examples, fewer than one batch of "
                f"{self.schedule.batch_size}: lower the batch size"
            )
        return max(1, int(round(self.local_epochs * per_epoch)))

    # ---------------------------------------------------------------------------------
    # the whole run
    # ---------------------------------------------------------------------------------
    def start(  # noqa: PLR0913
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Benchmark round, plan, then ``num_rounds`` rounds of split training.

        A round in which a node fails is recorded in ``self.rounds`` with its error
        (naming the node) and the next round starts from the last good global model;
        ``max_failed_rounds`` consecutive failures end the run with
        :class:`SkyNodeError`. The returned arrays are the last good global model.
        """
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        self.summary()
        t_start = time.time()
        node_ids = self.wait_for_nodes(grid, timeout=min(timeout, self.node_wait_s))
        self.benchmark(grid, node_ids)
        self.make_plan()
        assert self.plan is not None
        S, M = len(self.plan.stages), self.schedule.microbatches
        if self.schedule.transport == "direct" and self.schedule.kind == "1f1b" and M < S:
            raise ValueError(
                f"schedule.kind=1f1b needs at least as many micro-batches as stages: the plan "
                f"has {S} stages, schedule.microbatches={M}. Raise schedule.microbatches to "
                f">= {S} (dividing schedule.batch_size) or use schedule.kind=gpipe"
            )
        result = Result(arrays=initial_arrays)
        train_config = train_config or ConfigRecord()
        if evaluate_fn:
            res = evaluate_fn(0, initial_arrays)
            log(INFO, "Initial global evaluation: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        arrays = self.global_arrays = initial_arrays
        steps = self.steps_in_round()
        log(
            INFO,
            "%5s  %10s  %9s  %13s  %14s  %8s",
            "round",
            "train loss",
            "test acc",
            "step time (s)",
            "predicted (s)",
            "round (s)",
        )
        failures = 0  # consecutive failed rounds
        for rnd in range(1, num_rounds + 1):
            t_round = time.perf_counter()
            group = str(rnd)
            extra: dict[str, Any] = {}
            try:
                if self.schedule.transport == "direct":
                    new_arrays, extra = self._direct_round(grid, rnd, arrays, steps)
                    losses, correct, seen = (
                        extra.pop("losses"),
                        extra.pop("correct"),
                        extra.pop("seen"),
                    )
                    step_times = extra.pop("step_times")
                else:
                    self.exchange(grid, list(self.configure_train(rnd, arrays, train_config, grid)))
                    self._stage_stats = []
                    losses, correct, seen, step_times = [], 0, 0, []
                    for step in range(steps):
                        t0 = time.perf_counter()
                        loss, c, n = self._train_step(grid, step, group)
                        step_times.append(time.perf_counter() - t0)
                        losses.append(loss)
                        correct, seen = correct + c, seen + n
                    collect = [
                        self._msg(self._ids[st.node], "train.sky_collect", {}, group)
                        for st in self.plan.stages
                    ]
                    new_arrays, _ = self.aggregate_train(rnd, self.exchange(grid, collect))
            except SkyNodeError as err:
                failures += 1
                log(
                    WARNING,
                    "Round %d failed: %s. The last good global model is kept (%d consecutive "
                    "failed round(s) of at most max_failed_rounds=%d).",
                    rnd,
                    err,
                    failures,
                    self.max_failed_rounds,
                )
                failed = {
                    "round": rnd,
                    "error": f"round {rnd} failed: {err}",
                    "round_time_s": time.perf_counter() - t_round,
                }
                self.rounds.append(failed)
                self.on_event("round", failed)
                if failures >= self.max_failed_rounds:
                    raise SkyNodeError(
                        f"round {rnd} failed: {err} ({failures} consecutive failed round(s): "
                        f"max_failed_rounds={self.max_failed_rounds} reached)"
                    ) from err
                self._recover(rnd, err)
                continue
            failures = 0
            assert new_arrays is not None
            arrays = result.arrays = self.global_arrays = new_arrays
            row: dict[str, Any] = {
                "round": rnd,
                "train_loss": float(np.mean(losses)),
                "train_accuracy": correct / max(seen, 1),
                "measured_step_time_s": float(np.median(step_times)),
                "predicted_step_time_s": self.plan.predicted_step_time_s,
                "steps": steps,
                "round_time_s": time.perf_counter() - t_round,
                **(
                    {}
                    if self.schedule.transport == "direct"
                    else {
                        "microbatches_per_message": self.group_size,
                        "stages": self._stage_report(steps),
                    }
                ),
                **extra,
            }
            if self.schedule.transport == "direct":
                self._log_direct_stages(rnd, row)
            result.train_metrics_clientapp[rnd] = MetricRecord(
                {"train_loss": row["train_loss"], "train_accuracy": row["train_accuracy"]}
            )
            if evaluate_fn:
                res = evaluate_fn(rnd, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
                    row.update({f"test_{k}": float(v) for k, v in res.items()})  # type: ignore[arg-type]
            self.rounds.append(row)
            log(
                INFO,
                "%5d  %10.4f  %9s  %13.4f  %14.4f  %8.1f",
                rnd,
                row["train_loss"],
                f"{row['test_accuracy']:.4f}" if "test_accuracy" in row else "-",
                row["measured_step_time_s"],
                row["predicted_step_time_s"],
                row["round_time_s"],
            )
            if self.schedule.transport != "direct":
                self._log_stages(row)
            self.on_event("round", row)
        log(INFO, "Sky strategy finished in %.1f s", time.time() - t_start)
        self.log_final_summary(result)
        return result

    def log_final_summary(self, result: Result) -> None:
        """Log the plan and the final results the way Flower's ``Strategy.start`` ends
        (``Final results:`` and the ``Result``), after Sky's own per-round table."""
        log(INFO, "")
        if self.plan is not None:
            stages = ", ".join(
                f"{st.node} [{st.first_layer}-{st.last_layer}]" for st in self.plan.stages
            )
            log(INFO, "Plan (%s): %s", self.allocation, stages)
        log(INFO, "Final results:")
        log(INFO, "")
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        log(INFO, "")
