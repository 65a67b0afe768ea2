"""Cost model of the split-training step that actually runs (pure, no Flower import).

A plan is a list of **stages** ``(node, first, last)`` in pipeline order: node ``node``
holds layers ``first..last`` (inclusive), the stages cover every layer once, in order,
and stage 0 is the data owner (raw inputs never leave it). The planner chooses the node
order; nodes that appear in no stage are idle.

Per stage ``k`` (node ``i``, layers ``a..b``) and per micro-batch of ``B / M`` samples:

* **forward** ``f_k = sum_j fwd[i, j]`` and **backward** ``b_k = sum_j bwd[i, j]``, from
  the node's own measured seconds per micro-batch. On the ``relay`` transport every
  stage but the last re-runs its forward when the gradient comes back (Flower keeps no
  autograd graph between messages), so ``b_k`` also carries ``f_k`` there.
* **link** to stage ``k + 1`` (node ``i'``), once forward (activations) and once back
  (their gradients), ``bytes = (B / M) act_out[b]``:
  ``relay``: ``bytes / bw_i + bytes / bw_i'`` (up to the server, down to the next node);
  ``direct``: ``(lat_i + lat_i') / 2 + bytes / min(bw_i, bw_i')`` (peer to peer), plus
  the nodes' measured gloo message cost ``(peer_i + peer_i') / 2`` (calibration).
* **calibration** (``direct``; :mod:`sky_flower.core.calibration`): ``f_k`` and ``b_k``
  each carry half the node's measured per-micro-batch schedule overhead, and stretch by
  the contention of stages sharing a host's cores (:meth:`CostModel.contention`).
* **overhead** per step (``relay`` only): each Flower message costs the node's measured
  latency plus ``state_s_per_byte x`` the bytes it keeps in ``context.state`` (weights
  and optimizer state; the rate is Flower's shipping of the state plus the handler's
  own rebuild / save of the stage, both measured in the benchmark round); a non-last
  stage handles two messages, the last one; labels (``B x 8`` bytes) leave the data
  owner and reach the last stage. The optimizer step (measured per layer) is in ``b_k``,
  spread over the step's micro-batches.

Step time by ``schedule.kind`` (stages and link directions are resources; see
:mod:`sky_flower.core.simulate`, the discrete-event reference):

* ``sequential``: one micro-batch at a time through the whole pipeline (SkyComputing's
  execution; M = 1 is one batch): ``M (sum_k (f_k + b_k) + 2 sum_links)``.
* ``gpipe`` (Huang et al. 2019, arXiv 1811.06965): all forwards, then all backwards;
  with identical micro-batches each phase is a flow shop, so exactly
  ``sum F-resources + (M - 1) max F-resource + sum B-resources + (M - 1) max B-resource``.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021, arXiv 2006.09503): no closed form;
  the simulator gives it.

plus the per-step relay overhead. On ``relay``, ``gpipe`` and ``1f1b`` are the
**pipelined relay** that :class:`sky_flower.strategies.sky.SkyStrategy` runs: the step's ``M``
micro-batches travel in ``G = M / c`` Flower messages per hop (``c`` micro-batches each,
``schedule.microbatches_per_message`` or the best divisor), at most one message in flight
per stage, every message paying the stage's latency and state shipping; the simulator
plays that schedule per message group (:meth:`CostModel.relay_pipeline_time`). With
``c = M`` it is exactly the ``sequential`` relay. ``stream``
(:mod:`sky_flower.sky.transport.stream`) is charged as the relay with a frame for a
message: every hop passes through the server, one op at a time per stage, each costing
the node's link latency (no Flower message and no ``context.state``: no state term),
the payload over each node's own bandwidth, recomputation in ``b_k``; Flower's set-up
and weights messages are not in the step: a stage session's set-up is charged once per
session, to the round that sets it up (:meth:`CostModel.session_setup_s`: its slowest
stage's measured Flower round trip plus its weight bytes over the node's bandwidth).
The partitioners search with the closed forms above; the plan's predicted step time is
this model.

The **steady-state period** (seconds per micro-batch once the pipeline is full, which
sets throughput) is ``max(max_k (f_k + b_k), max_links link)``.

Memory of stage ``k`` (bytes) = parameters + gradients + optimizer state + the
activations stashed for the micro-batches in flight: ``relay`` keeps the whole batch,
``sequential`` one micro-batch, ``gpipe`` all ``M``, ``1f1b`` ``min(S - k, M)``
(``S`` stages). A layer's stash per sample is what autograd saves for its backward pass
(``LayerProfile.stash_bytes``: e.g. a Linear's input and a ReLU's output), or its output
``act_out_bytes`` when that was not measured. :func:`sky_flower.core.memory.measure_stage_memory`
measures the real peak this predicts (``tests/test_memory.py`` states the tolerance).

:class:`Schedule`, :class:`StageTerms` and the stage type live in
:mod:`sky_flower.core.schedule`, the lower bounds in :mod:`sky_flower.core.bounds`
(mixed into :class:`CostModel`); all are importable from here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sky_flower.core.bounds import LowerBounds
from sky_flower.core.calibration import Calibration
from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.core.schedule import (
    LABEL_BYTES_PER_SAMPLE,
    SCHEDULE_KINDS,
    TRANSPORTS,
    Schedule,
    ScheduleKind,
    Stage,
    StageTerms,
    Transport,
    predict_plan,
)

__all__ = [
    "LABEL_BYTES_PER_SAMPLE",
    "SCHEDULE_KINDS",
    "TRANSPORTS",
    "CostModel",
    "Schedule",
    "ScheduleKind",
    "Stage",
    "StageTerms",
    "Transport",
    "check_profiles",
]


def _number(owner: str, field: str, value: object, *, positive: bool = False) -> None:
    """Raise ``ValueError`` naming ``owner`` and ``field`` unless ``value`` is a real,
    non-negative number (``positive``: > 0; ``inf`` allowed only then)."""
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    if ok and positive:
        ok = not math.isnan(value) and value > 0
    elif ok:
        ok = math.isfinite(value) and value >= 0
    if not ok:
        rule = "> 0 (inf for free transfers)" if positive else "a finite number >= 0"
        raise ValueError(f"{owner}: {field} must be {rule}, got {value!r}")


def check_profiles(layers: Sequence[LayerProfile], nodes: Sequence[NodeProfile]) -> None:
    """Check every field the cost model reads: finite, non-negative numbers (bandwidth
    > 0, ``inf`` allowed), naming the node or layer and the field.

    Raises
    ------
    ValueError
        On the first bad value, e.g. ``node 'n1': layer_fwd_s[3] must be a finite
        number >= 0, got nan``.
    """
    for lp in layers:
        owner = f"layer {lp.index} ({lp.name})"
        for f in ("param_bytes", "optimizer_state_bytes", "act_out_bytes", "frozen_bytes"):
            _number(owner, f, getattr(lp, f))
        if lp.stash_bytes is not None:
            _number(owner, "stash_bytes", lp.stash_bytes)
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"node names must be unique, got {names}")
    for node in nodes:
        owner = f"node {node.name!r}"
        for f in ("layer_fwd_s", "layer_bwd_s", "layer_step_s"):
            for j, v in enumerate(getattr(node, f)):
                _number(owner, f"{f}[{j}]", v)
        for f in (
            "memory_bytes",
            "latency_s",
            "state_s_per_byte",
            "microbatch_overhead_s",
            "peer_latency_s",
            "host_parallelism",
            "setup_s",
        ):
            _number(owner, f, getattr(node, f))
        _number(owner, "bandwidth_bps", node.bandwidth_bps, positive=True)


class CostModel(LowerBounds, Calibration):
    """Predicted step time and memory of any plan (stages in a chosen node order).

    Parameters
    ----------
    layers : sequence of LayerProfile
        L layer profiles, in model order.
    nodes : sequence of NodeProfile
        N node profiles. Each must carry L per-layer times (seconds per micro-batch of
        ``schedule.microbatch_size`` samples). The data owner is the first node with
        ``holds_data`` (node 0 if none says so).
    schedule : Schedule
        Batch, micro-batches, schedule kind and transport.

    Raises
    ------
    ValueError
        If there are no nodes or layers, a node's per-layer times do not match the
        layers, or any field is not a finite non-negative number (:func:`check_profiles`
        names the node or layer and the field).

    Notes
    -----
    Arrays: ``fwd``, ``bwd`` (N, L) seconds per micro-batch; ``memory_static`` (L,)
    bytes of parameters + gradients + optimizer state (frozen parameters: their
    weights only, :attr:`LayerProfile.static_bytes`); ``stash`` (L,) bytes of stashed
    activations per sample (``stash_bytes``, else ``act_out_bytes``); ``act_out`` (L,)
    bytes per sample leaving layer j; ``capacity`` (N,) bytes.
    """

    def __init__(
        self,
        layers: Sequence[LayerProfile],
        nodes: Sequence[NodeProfile],
        schedule: Schedule,
    ) -> None:
        if not nodes:
            raise ValueError("no nodes: the fleet must have at least one node")
        if not layers:
            raise ValueError("no layers: the model must have at least one layer")
        L, N = len(layers), len(nodes)
        for node in nodes:
            if len(node.layer_fwd_s) != L or len(node.layer_bwd_s) != L:
                raise ValueError(
                    f"node {node.name!r} reports times for {len(node.layer_fwd_s)} layers, "
                    f"the model has {L}: re-run the benchmark round with this model"
                )
        check_profiles(layers, nodes)
        self.layers = list(layers)
        self.nodes = list(nodes)
        self.schedule = schedule
        self.num_layers, self.num_nodes = L, N
        self.owner = next((i for i, n in enumerate(nodes) if n.holds_data), 0)
        self.relay = schedule.transport == "relay"
        # relay and stream: every hop passes through the server, one stage op at a time
        # (stream: a frame costs the node's link, no Flower message nor context.state)
        self.stream = schedule.transport == "stream"
        self.via_server = self.relay or self.stream
        self.fwd = np.array([n.layer_fwd_s for n in nodes], dtype=float)
        self.bwd = np.array([n.layer_bwd_s for n in nodes], dtype=float)
        self.inv_bw = np.array(
            [0.0 if n.bandwidth_bps == float("inf") else 1.0 / n.bandwidth_bps for n in nodes]
        )
        self.latency = np.array([n.latency_s for n in nodes], dtype=float)
        self.state_rate = np.array([n.state_s_per_byte for n in nodes], dtype=float)
        self.setup = np.array([n.setup_s for n in nodes], dtype=float)  # stream sessions
        self.act_out = np.array([lp.act_out_bytes for lp in layers], dtype=float)
        # a relay stage's context.state: every weight (frozen ones too) and optimizer state
        self.state_bytes = np.array(
            [lp.weight_bytes + lp.optimizer_state_bytes for lp in layers], dtype=float
        )
        self.param_bytes = np.array([lp.param_bytes for lp in layers], dtype=float)
        # frozen weights are held, without gradient or optimizer state
        self.memory_static = np.array([lp.static_bytes for lp in layers], dtype=float)
        self.stash = np.array(
            [lp.act_out_bytes if lp.stash_bytes is None else lp.stash_bytes for lp in layers],
            dtype=float,
        )
        self.capacity = np.array([n.memory_bytes for n in nodes], dtype=float)
        self._init_calibration(nodes)
        self._lp_bound: float | None = None
        zero = np.zeros((N, 1))
        self.fwd_prefix = np.concatenate([zero, np.cumsum(self.fwd, 1)], 1)
        self.bwd_prefix = np.concatenate([zero, np.cumsum(self.bwd, 1)], 1)
        self.static_prefix = np.concatenate([[0.0], np.cumsum(self.memory_static)])
        self.stash_prefix = np.concatenate([[0.0], np.cumsum(self.stash)])
        self.state_prefix = np.concatenate([[0.0], np.cumsum(self.state_bytes)])
        self.param_prefix = np.concatenate([[0.0], np.cumsum(self.param_bytes)])
        weights = np.array([lp.weight_bytes for lp in layers], dtype=float)
        self.weight_prefix = np.concatenate([[0.0], np.cumsum(weights)])

    # --- per-stage terms -------------------------------------------------------------
    def stage_fwd(self, node: int, first: int, last: int) -> float:
        """Forward seconds per micro-batch of ``node`` holding ``first..last``."""
        return float(self.fwd_prefix[node, last + 1] - self.fwd_prefix[node, first])

    def stage_bwd(self, node: int, first: int, last: int, is_last: bool) -> float:
        """Backward seconds per micro-batch (relay recomputation included if not last)."""
        t = float(self.bwd_prefix[node, last + 1] - self.bwd_prefix[node, first])
        if self.via_server and not is_last:
            t += self.stage_fwd(node, first, last)
        return t

    def link_time(self, sender: int, receiver: int, last_layer: int) -> float:
        """One-way seconds per micro-batch to move layer ``last_layer``'s output (or its
        gradient) between two stages' nodes."""
        nbytes = self.schedule.microbatch_size * self.act_out[last_layer]
        if self.via_server:
            return float(nbytes * (self.inv_bw[sender] + self.inv_bw[receiver]))
        lat = 0.5 * (self.latency[sender] + self.latency[receiver])
        lat += 0.5 * (self.peer_latency[sender] + self.peer_latency[receiver])
        return float(lat + nbytes * max(self.inv_bw[sender], self.inv_bw[receiver]))

    def inflight(self, k: int, num_stages: int) -> int:
        """Micro-batches whose activations stage ``k`` stashes at its peak (the chunked
        kinds and ``auto``: ``M``, a bound; :meth:`stage_memories` simulates them)."""
        M = self.schedule.microbatches
        if self.relay or self.schedule.kind not in ("1f1b", "sequential"):
            return M
        if self.schedule.kind == "1f1b":
            return min(num_stages - k, M)
        return 1

    def stage_memory(self, first: int, last: int, inflight: int | None = None) -> float:
        """Bytes needed to hold layers ``first..last`` with ``inflight`` micro-batches
        stashed (default: all ``M``, the most any schedule keeps)."""
        n = self.schedule.microbatches if inflight is None else inflight
        static = self.static_prefix[last + 1] - self.static_prefix[first]
        stash = self.stash_prefix[last + 1] - self.stash_prefix[first]
        return float(static + n * self.schedule.microbatch_size * stash)

    # --- whole plans -----------------------------------------------------------------
    def session_setup_s(self, plan: Sequence[Sequence[int]]) -> float:
        """Predicted seconds to set a ``stream`` stage session up for ``plan`` (every
        stage's set-up message runs at once, so the slowest stage's):

        ``setup = max_k (setup_i + W_k / bw_i)``

        with, for stage ``k`` on node ``i``, ``setup_i`` the node's measured Flower
        set-up without weights (:attr:`NodeProfile.setup_s`: a message pushed until
        its stage joined), ``W_k`` the bytes of the stage's
        weights (trainable and frozen: :attr:`LayerProfile.weight_bytes` over its
        layers, what its set-up message carries) and ``bw_i`` the node's bandwidth
        (bytes/s; ``inf``: no term). Charged once per session, not per step or round.

        Parameters
        ----------
        plan : sequence of (node, first, last) or (first, last)
            As :meth:`as_stages`.

        Returns
        -------
        float
            Seconds; 0 (not predicted) if a stage's node has no measured set-up
            (``setup_s == 0``: a transport other than ``stream``, or a profile from
            elsewhere).
        """
        stages = self.as_stages(plan)
        if not stages or any(self.setup[i] <= 0 for i, _, _ in stages):
            return 0.0
        return max(
            float(self.setup[i])
            + float(self.weight_prefix[b + 1] - self.weight_prefix[a]) * float(self.inv_bw[i])
            for i, a, b in stages
        )

    def as_stages(self, plan: Sequence[Sequence[int]]) -> list[Stage]:
        """Stages from ``(node, first, last)`` triples, or from ``(first, last)`` pairs
        meaning node ``k`` holds stage ``k`` (configured order, every node used)."""
        if isinstance(plan, np.ndarray) and plan.ndim == 2 and plan.shape[1] == 3:
            return [tuple(int(v) for v in row) for row in plan]  # type: ignore[misc]
        out = []
        for k, s in enumerate(plan):
            if len(s) == 2:
                out.append((k, int(s[0]), int(s[1])))
            else:
                out.append((int(s[0]), int(s[1]), int(s[2])))
        return out

    def check_stages(self, plan: Sequence[Sequence[int]]) -> None:
        """Raise ``ValueError`` unless the stages cover every layer once, contiguously,
        in order, each node at most once, with the data owner as stage 0."""
        stages = self.as_stages(plan)
        if not stages:
            raise ValueError("a plan needs at least one stage")
        expected = 0
        seen: set[int] = set()
        for k, (i, first, last) in enumerate(stages):
            if not 0 <= i < self.num_nodes:
                raise ValueError(f"stage {k} names node {i}; the fleet has {self.num_nodes}")
            if i in seen:
                raise ValueError(f"node {self.nodes[i].name!r} holds two stages")
            seen.add(i)
            if first != expected or last < first:
                raise ValueError(
                    f"stage {k} covers layers {first}..{last}; expected it to start at "
                    f"{expected} and hold at least one layer"
                )
            expected = last + 1
        if expected != self.num_layers:
            raise ValueError(f"stages cover {expected} of {self.num_layers} layers")
        if stages[0][0] != self.owner:
            raise ValueError(
                f"stage 0 is on {self.nodes[stages[0][0]].name!r}, but the data owner "
                f"{self.nodes[self.owner].name!r} must run stage 0"
            )

    def terms(self, plan: Sequence[Sequence[int]]) -> StageTerms:
        """Per-stage forward, backward, link and overhead times of a plan."""
        st = np.asarray(self.as_stages(plan), dtype=int).reshape(-1, 3)
        return self.terms_arrays(st[:, 0], st[:, 1], st[:, 2])

    def terms_arrays(self, i: np.ndarray, a: np.ndarray, b: np.ndarray) -> StageTerms:
        """:meth:`terms` from arrays of node index, first and last layer (shape (S,))."""
        S = len(i)
        fwd = self.fwd_prefix[i, b + 1] - self.fwd_prefix[i, a]
        bwd = self.bwd_prefix[i, b + 1] - self.bwd_prefix[i, a]
        if self.via_server and S > 1:
            bwd = bwd.copy()
            bwd[:-1] += fwd[:-1]  # recomputation on every stage but the last
        snd, rcv, cut = i[:-1], i[1:], b[:-1]
        link = self.link_arrays(snd, rcv, cut)
        if not self.via_server:
            fwd, bwd, opt = self.calibrated_compute(i, a, b, fwd, bwd)
            over = np.zeros(S)
            over[0] = self.optimizer_tail(i, opt, bwd, link)
            return StageTerms(fwd, bwd, link, over)
        messages = np.full(S, 2.0)
        messages[-1] = 1.0
        state = self.state_prefix[b + 1] - self.state_prefix[a]
        rate = np.zeros(S) if self.stream else self.state_rate[i]  # stream: no context.state
        message = self.latency[i] + rate * state
        over = messages * message
        if S > 1:
            label = LABEL_BYTES_PER_SAMPLE * self.schedule.batch_size
            over[0] += label * self.inv_bw[i[0]]
            over[-1] += label * self.inv_bw[i[-1]]
        mb = self.schedule.microbatch_size
        nbytes = np.zeros(S)  # per micro-batch and direction: bytes in + bytes out
        nbytes[:-1] += mb * self.act_out[cut]
        nbytes[1:] += mb * self.act_out[cut]
        node_link = nbytes * self.inv_bw[i]
        grad_state = rate * (self.param_prefix[b + 1] - self.param_prefix[a])
        return StageTerms(fwd, bwd, link, over, message, node_link, grad_state)

    def link_arrays(self, snd: np.ndarray, rcv: np.ndarray, cut: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`link_time` (arrays of sender, receiver, cut layer)."""
        nbytes = self.schedule.microbatch_size * self.act_out[cut]
        if self.via_server:
            return nbytes * (self.inv_bw[snd] + self.inv_bw[rcv])
        lat = 0.5 * (self.latency[snd] + self.latency[rcv])
        lat = lat + 0.5 * (self.peer_latency[snd] + self.peer_latency[rcv])
        return lat + nbytes * np.maximum(self.inv_bw[snd], self.inv_bw[rcv])

    def memory_arrays(self, a: np.ndarray, b: np.ndarray, inflight: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`stage_memory` (bytes)."""
        static = self.static_prefix[b + 1] - self.static_prefix[a]
        stash = self.stash_prefix[b + 1] - self.stash_prefix[a]
        return static + inflight * self.schedule.microbatch_size * stash

    def relay_pipeline_time(self, t: StageTerms, group: int) -> float:
        """Step time (seconds) of the pipelined relay with ``group`` micro-batches per
        Flower message, as :class:`sky_flower.strategies.sky.SkyStrategy` schedules it.

        The server keeps at most one message in flight per stage (per-stage FIFO: Flower
        runs a node's messages on one shared ``context.state``), so each stage is one
        resource that serves ``G = M / group`` message groups in the schedule's order;
        the server relays instantly. A forward message on stage ``k`` takes
        ``message_k + group (f_k + node_link_k)``, a backward one
        ``message_k + group (b_k + node_link_k)`` (recomputation in ``b_k``); the last
        stage runs loss and backward inside its forward message, and its payload runs
        both ways (``2 node_link``). While gradients accumulate over groups (``G > 1``)
        every message also ships them (``grad_state``). Payload transfer is charged on
        the nodes (each node's own bandwidth), so the links between stages cost 0 here.
        Played by :func:`sky_flower.core.simulate.simulate` with the last stage's forward
        and backward interleaved; plus the per-step label transfer.

        Raises
        ------
        ValueError
            If ``group`` does not divide ``M`` or ``t`` lacks the relay terms.
        """
        from sky_flower.core.simulate import simulate

        M = self.schedule.microbatches
        if group < 1 or M % group or t.message is None or t.node_link is None:
            raise ValueError(f"group={group} must divide M={M}, on relay terms")
        G = M // group
        S = len(t.fwd)
        per_msg = t.message + (t.grad_state if G > 1 and t.grad_state is not None else 0.0)
        f = per_msg + group * (t.fwd + t.node_link)
        b = per_msg + group * (t.bwd + t.node_link)
        if S > 1:  # last stage: one message does forward, loss and backward
            f[-1] = per_msg[-1] + group * (t.fwd[-1] + t.bwd[-1] + 2 * t.node_link[-1])
            b[-1] = 0.0
        else:
            f[-1] = per_msg[-1] + group * (t.fwd[-1] + t.bwd[-1])
            b[-1] = 0.0
        kind = "gpipe" if self.schedule.kind == "sequential" else self.schedule.kind
        zeros = np.zeros(S - 1)
        core = simulate(f, b, zeros, zeros, G, kind, interleave_last=True).step_time_s
        labels = t.overhead - np.where(np.arange(S) == S - 1, 1.0, 2.0) * t.message
        return core + float(labels.sum())

    def relay_group_size(self, t: StageTerms) -> int:
        """Micro-batches per Flower message for the pipelined relay:
        ``schedule.microbatches_per_message`` if set, else the divisor of ``M`` with the
        least :meth:`relay_pipeline_time` (ties: the larger, fewer messages)."""
        M = self.schedule.microbatches
        if self.schedule.microbatches_per_message > 0:
            return self.schedule.microbatches_per_message
        divisors = [c for c in range(M, 0, -1) if M % c == 0]
        return min(divisors, key=lambda c: (self.relay_pipeline_time(t, c), -c))

    def step_time_of(self, t: StageTerms) -> float:
        """Step time (seconds) from stage terms, for ``schedule.kind`` (the chunked
        kinds and ``auto``: their :attr:`Schedule.search_kind`; :meth:`step_time`
        plays them)."""
        M = self.schedule.microbatches
        kind = self.schedule.search_kind
        if self.via_server and kind != "sequential" and t.message is not None:
            return self.relay_pipeline_time(t, self.relay_group_size(t))
        if kind == "sequential":
            core = M * float(t.fwd.sum() + t.bwd.sum() + 2.0 * t.link.sum())
        elif kind == "gpipe":
            f_max = max(float(t.fwd.max()), float(t.link.max()) if len(t.link) else 0.0)
            b_max = max(float(t.bwd.max()), float(t.link.max()) if len(t.link) else 0.0)
            core = float(t.fwd.sum() + t.bwd.sum() + 2.0 * t.link.sum())
            core += (M - 1) * (f_max + b_max)
        else:
            from sky_flower.core.simulate import simulate

            core = simulate(t.fwd, t.bwd, t.link, t.link, M, kind).step_time_s
        return core + float(t.overhead.sum())

    def step_time(self, plan: Sequence[Sequence[int]]) -> float:
        """Predicted seconds per training step of a plan."""
        if self.schedule.kind != self.schedule.search_kind:  # chunked kinds, auto
            return predict_plan(self, self.as_stages(plan)).step_time_s
        return self.step_time_of(self.terms(plan))

    def period(self, plan: Sequence[Sequence[int]]) -> float:
        """Steady-state seconds per micro-batch: the slowest resource (a stage's forward
        + backward, or a link), which sets pipeline throughput."""
        t = self.terms(plan)
        return float(max((t.fwd + t.bwd).max(), t.link.max() if len(t.link) else 0.0))

    def objective(self, plan: Sequence[Sequence[int]], objective: str = "step") -> float:
        """``step``: :meth:`step_time`; ``throughput``: :meth:`period`."""
        return self.period(plan) if objective == "throughput" else self.step_time(plan)

    def stage_memories(self, plan: Sequence[Sequence[int]]) -> list[float]:
        """Bytes each stage needs (schedule's in-flight micro-batches included)."""
        if self.schedule.kind != self.schedule.search_kind:  # chunked kinds, auto
            return predict_plan(self, self.as_stages(plan)).memory_bytes
        st = np.asarray(self.as_stages(plan), dtype=int).reshape(-1, 3)
        S = len(st)
        inflight = np.array([self.inflight(k, S) for k in range(S)])
        return self.memory_arrays(st[:, 1], st[:, 2], inflight).tolist()

    def fits(self, plan: Sequence[Sequence[int]]) -> bool:
        """Whether every stage fits its node's memory."""
        st = np.asarray(self.as_stages(plan), dtype=int).reshape(-1, 3)
        mems = np.array(self.stage_memories(st))
        return bool((mems <= self.capacity[st[:, 0]]).all())
