"""Cost model of the split-training step that actually runs (pure, no Flower import).

A plan puts nodes ``0..N-1`` (in configured order, the data owner first) on contiguous
blocks of layers: node ``i`` holds layers ``[a_i, b_i]``. The predicted time of one
training step (one batch of ``B`` samples cut into ``M`` micro-batches) is built from
per-stage times, each the sum of

* **compute**: ``M x sum_j (r_i * fwd[i][j] + bwd[i][j])`` with ``fwd``/``bwd`` the
  node's own measured seconds per micro-batch for layer ``j``. On the ``relay``
  transport every stage but the last re-runs its forward pass when the gradient comes
  back (activation recomputation: Flower keeps no autograd graph between messages),
  so ``r_i = 2`` there and ``1`` on the last stage; on ``direct`` ``r_i = 1``.
* **transfer**: each message costs the node's measured round-trip latency (Flower's
  per-message overhead included) plus bytes / bandwidth. A non-last stage gets two
  messages per step (forward, backward), the last stage one (forward + loss +
  backward). Bytes: the activations of the stage's last layer go out and their
  gradients come back (``2 B act_out[b]``); a stage that does not start at layer 0 gets
  its input activations and returns their gradients (``2 B act_in[a]``); labels
  (``B x 8`` bytes) leave the data owner and reach the last stage.
* **state**: Flower ships a node's ``context.state`` with every message it handles, and
  a stage keeps its weights and optimizer state there; each message therefore costs
  ``state_s_per_byte[i] x (param + optimizer-state bytes of the stage)``, measured per
  node in the benchmark round. (In the simulation engine this is the largest
  per-message cost after Flower's polling latency.)

Step time by schedule kind:

* ``sequential`` (what the relay transport runs: the ``M`` micro-batches go one after
  another inside each stage's message): ``T = sum_i stage_i``.
* ``gpipe`` (micro-batches overlap, GPipe, Huang et al. 2019): with per-micro-batch
  stage times ``t_i``, ``T = sum_i t_i + (M - 1) max_i t_i``.

Memory of a stage (bytes) = parameters + gradients + optimizer state + the activations
of every layer for the whole batch (all micro-batches in flight; an upper bound for
the relay transport, which keeps only stage inputs between messages).

Every coefficient is exposed as an array so that the MILP in
:mod:`sky_flower.partition` minimises exactly the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from sky_flower.profile import LayerProfile, NodeProfile

LABEL_BYTES_PER_SAMPLE = 8  # int64 class index

ScheduleKind = Literal["sequential", "gpipe"]
Transport = Literal["relay", "direct"]


@dataclass(frozen=True)
class Schedule:
    """How a step runs.

    Attributes
    ----------
    batch_size : int
        Samples per training step (B).
    microbatches : int
        Micro-batches per step (M); must divide ``batch_size``. 1 = whole batch.
    kind : {"sequential", "gpipe"}
        Execution order of the micro-batches (see module docstring).
    transport : {"relay", "direct"}
        ``relay``: every hop is a Flower message through the server.
    """

    batch_size: int = 64
    microbatches: int = 1
    kind: ScheduleKind = "sequential"
    transport: Transport = "relay"

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.microbatches < 1:
            raise ValueError(
                f"batch_size ({self.batch_size}) and microbatches ({self.microbatches}) "
                "must be >= 1"
            )
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"schedule.microbatches={self.microbatches} must divide "
                f"batch_size={self.batch_size}: pick a divisor"
            )
        if self.kind not in ("sequential", "gpipe"):
            raise ValueError(f"unknown schedule kind {self.kind!r}: use sequential or gpipe")
        if self.transport not in ("relay", "direct"):
            raise ValueError(f"unknown transport {self.transport!r}: use relay or direct")

    @property
    def microbatch_size(self) -> int:
        """Samples per micro-batch (B / M)."""
        return self.batch_size // self.microbatches


class CostModel:
    """Predicted step time and memory of any contiguous, in-order assignment.

    Parameters
    ----------
    layers : sequence of LayerProfile
        L layer profiles, in model order.
    nodes : sequence of NodeProfile
        N node profiles in pipeline order (node 0 is the data owner, stage 0). Each
        must carry L per-layer times.
    schedule : Schedule
        Batch, micro-batches, schedule kind and transport.

    Raises
    ------
    ValueError
        If there are no nodes, or a node's per-layer times do not match the layers.

    Notes
    -----
    Arrays (all seconds, per step for ``sequential``, per micro-batch for ``gpipe``):

    * ``compute[i, j]``: layer j on node i;
    * ``state[i, j]``: shipping layer j's weights and optimizer state with node i's
      messages;
    * ``send[i, j]``: node i's last layer is j and it is not the last stage;
    * ``recv[i, j]``: node i's first layer is j > 0;
    * ``fixed[i]``: per-message latencies and label bytes of node i;
    * ``memory[j]`` bytes of layer j; ``capacity[i]`` bytes of node i.
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
        self.layers = list(layers)
        self.nodes = list(nodes)
        self.schedule = schedule
        self.num_layers, self.num_nodes = L, N
        M = schedule.microbatches
        gpipe = schedule.kind == "gpipe"
        # Units: per step (sequential) or per micro-batch (gpipe).
        reps = 1 if gpipe else M
        samples = schedule.microbatch_size if gpipe else schedule.batch_size
        fwd = np.array([n.layer_fwd_s for n in nodes], dtype=float)
        bwd = np.array([n.layer_bwd_s for n in nodes], dtype=float)
        recompute = np.full((N, 1), 2.0 if schedule.transport == "relay" else 1.0)
        recompute[N - 1] = 1.0
        self.compute = reps * (recompute * fwd + bwd)
        inv_bw = np.array(
            [0.0 if n.bandwidth_bps == float("inf") else 1.0 / n.bandwidth_bps for n in nodes]
        )
        act_out = np.array([lp.act_out_bytes for lp in layers])
        act_in = np.array([lp.act_in_bytes for lp in layers])
        self.send = 2.0 * samples * np.outer(inv_bw, act_out)
        self.recv = 2.0 * samples * np.outer(inv_bw, act_in)
        self.recv[:, 0] = 0.0
        latency = np.array([n.latency_s for n in nodes])
        messages = np.full(N, 2.0)
        messages[N - 1] = 1.0
        self.fixed = messages * latency
        label_bytes = LABEL_BYTES_PER_SAMPLE * samples
        self.fixed[0] += label_bytes * inv_bw[0]
        self.fixed[N - 1] += label_bytes * inv_bw[N - 1]
        if N == 1:
            self.fixed[0] = latency[0]
            messages[0] = 1.0
        state_bytes = np.array([lp.param_bytes + lp.optimizer_state_bytes for lp in layers])
        state_rate = np.array([n.state_s_per_byte for n in nodes])
        self.state = np.outer(messages * state_rate, state_bytes)
        self.memory = np.array(
            [
                2 * lp.param_bytes
                + lp.optimizer_state_bytes
                + schedule.batch_size * lp.act_out_bytes
                for lp in layers
            ],
            dtype=float,
        )
        self.capacity = np.array([n.memory_bytes for n in nodes], dtype=float)
        self._compute_prefix = np.concatenate([np.zeros((N, 1)), np.cumsum(self.compute, 1)], 1)
        self._state_prefix = np.concatenate([np.zeros((N, 1)), np.cumsum(self.state, 1)], 1)
        self._memory_prefix = np.concatenate([[0.0], np.cumsum(self.memory)])

    # --- per-stage terms -------------------------------------------------------------
    def stage_compute(self, node: int, first: int, last: int) -> float:
        """Compute seconds of node ``node`` holding layers ``first..last`` (inclusive)."""
        return float(self._compute_prefix[node, last + 1] - self._compute_prefix[node, first])

    def stage_transfer(self, node: int, first: int, last: int) -> float:
        """Message seconds (latency + bytes / bandwidth + context state) of that stage."""
        t = float(self.fixed[node])
        t += float(self._state_prefix[node, last + 1] - self._state_prefix[node, first])
        if first > 0:
            t += float(self.recv[node, first])
        if last < self.num_layers - 1:
            t += float(self.send[node, last])
        return t

    def stage_time(self, node: int, first: int, last: int) -> float:
        """Compute + transfer seconds of that stage."""
        return self.stage_compute(node, first, last) + self.stage_transfer(node, first, last)

    def stage_memory(self, first: int, last: int) -> float:
        """Bytes needed to hold layers ``first..last`` (inclusive)."""
        return float(self._memory_prefix[last + 1] - self._memory_prefix[first])

    # --- whole plans -----------------------------------------------------------------
    def combine(self, stage_times: Sequence[float]) -> float:
        """Step time from per-stage times (see module docstring)."""
        total = float(sum(stage_times))
        if self.schedule.kind == "gpipe":
            total += (self.schedule.microbatches - 1) * float(max(stage_times))
        return total

    def check_bounds(self, bounds: Sequence[tuple[int, int]]) -> None:
        """Raise ``ValueError`` unless ``bounds`` (one ``(first, last)`` per node, in node
        order) covers every layer exactly once, contiguously, one block per node."""
        if len(bounds) != self.num_nodes:
            raise ValueError(f"{len(bounds)} stages for {self.num_nodes} nodes")
        expected = 0
        for i, (first, last) in enumerate(bounds):
            if first != expected or last < first:
                raise ValueError(
                    f"stage {i} covers layers {first}..{last}; expected it to start at "
                    f"{expected} and hold at least one layer"
                )
            expected = last + 1
        if expected != self.num_layers:
            raise ValueError(f"stages cover {expected} of {self.num_layers} layers")

    def step_time(self, bounds: Sequence[tuple[int, int]]) -> float:
        """Predicted seconds per training step of an assignment."""
        return self.combine([self.stage_time(i, a, b) for i, (a, b) in enumerate(bounds)])

    def fits(self, bounds: Sequence[tuple[int, int]]) -> bool:
        """Whether every stage fits its node's memory."""
        return all(self.stage_memory(a, b) <= self.capacity[i] for i, (a, b) in enumerate(bounds))
