"""Calibration of the cost model: what a step pays beyond its layers.

The benchmark round measures, per node (:class:`~sky_flower.core.profile.NodeProfile`):

* ``microbatch_overhead_s``: the fixed seconds a ``direct`` stage pays per micro-batch
  besides its layers (``torch.distributed.pipelining``'s schedule and autograd
  bookkeeping), from a one-stage schedule timed at two micro-batch counts;
* ``peer_latency_s``: one peer message on the node's gloo stack (a gloo echo between two
  ranks; on one host, loopback under the host's load), per stage boundary, micro-batch
  and direction;
* ``host`` and ``host_parallelism``: stages on one host share its cores; how many
  compute workers it runs at full speed (``max_k k t_1 / t_k``).

The optimizer step was already measured (per layer, spread over the step's micro-batches
in ``layer_bwd_s``). :class:`Calibration` is a mixin of
:class:`sky_flower.core.cost.CostModel` (it reads its ``schedule`` and ``relay``); with
every field at its default (0 / "") it changes nothing, so profiles from before the
calibration plan as they did. :func:`uncalibrated` resets the fields (the benchmark's
"before" column). Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from sky_flower.core.profile import NodeProfile
from sky_flower.core.schedule import Schedule

CALIBRATION_FIELDS = ("microbatch_overhead_s", "peer_latency_s", "host", "host_parallelism")


def uncalibrated(nodes: Sequence[NodeProfile]) -> list[NodeProfile]:
    """``nodes`` with the calibration fields at their defaults (an uncalibrated cost
    model)."""
    return [
        replace(
            n,
            microbatch_overhead_s=0.0,
            peer_latency_s=0.0,
            host="",
            host_parallelism=0.0,
            layer_step_s=(),
        )
        for n in nodes
    ]


class Calibration:
    """Calibration terms of a :class:`~sky_flower.core.cost.CostModel` (mixed into it)."""

    schedule: Schedule
    relay: bool

    # --- calibration ---------------------------------------------------------------
    def _init_calibration(self, nodes: Sequence[NodeProfile]) -> None:
        """Arrays of the benchmark's calibration fields (all 0 / "" when not measured,
        which leaves the model as it was): ``mb_overhead`` (N,) s per micro-batch and
        stage, ``peer_latency`` (N,) s per peer message, ``hosts`` (N,) names,
        ``parallelism`` (N,) workers the host runs at full speed, ``busy_share`` (N,)
        share of a stage's time its node computes (``1 / (1 + slowdown)``: the
        emulation sleeps the rest)."""
        self.mb_overhead = np.array([n.microbatch_overhead_s for n in nodes], dtype=float)
        self.peer_latency = np.array([n.peer_latency_s for n in nodes], dtype=float)
        self.hosts = [n.host for n in nodes]
        self.parallelism = np.array([n.host_parallelism for n in nodes], dtype=float)
        self.busy_share = 1.0 / (1.0 + np.array([n.slowdown for n in nodes], dtype=float))
        L = len(nodes[0].layer_fwd_s)
        for n in nodes:
            if n.layer_step_s and len(n.layer_step_s) != L:
                raise ValueError(
                    f"node {n.name!r} reports optimizer steps for {len(n.layer_step_s)} "
                    f"layers, the model has {L}"
                )
        steps = np.array([n.layer_step_s or (0.0,) * L for n in nodes], dtype=float)
        self.step_prefix = np.concatenate([np.zeros((len(nodes), 1)), np.cumsum(steps, 1)], 1)

    def contention(self, i: np.ndarray) -> np.ndarray:
        """Factor (shape (S,), >= 1) by which each stage's compute stretches because
        stages of the plan share a host's cores (``direct`` transport: the stages are
        processes computing at once).

        Per host ``h`` holding ``n_h`` stages of the plan: at most ``min(n_h, M)`` of
        them compute at once (a pipeline with ``M`` micro-batches in flight; none
        concurrently under ``sequential``), each for its ``busy_share`` of the time, so
        the host is asked for ``d_h = min(n_h, M) / n_h x sum busy_share`` workers; it
        runs ``P_h = host_parallelism`` at full speed, and each stage's compute is
        stretched by ``max(1, d_h / P_h)``. Hosts not named or not measured: 1.
        """
        S = len(i)
        factor = np.ones(S)
        if self.relay or self.schedule.kind == "sequential":
            return factor
        M = self.schedule.microbatches
        for members, P in self.shared_hosts(i):
            nodes = i[members]
            demand = min(len(members), M) / len(members) * float(self.busy_share[nodes].sum())
            factor[members] = max(1.0, demand / P)
        return factor

    def shared_hosts(self, i: np.ndarray) -> list[tuple[list[int], float]]:
        """The plan's stages (indices into ``i``) on each measured host that holds two
        or more of them, with the host's ``host_parallelism``."""
        by_host: dict[str, list[int]] = {}
        for k, node in enumerate(i):
            if self.hosts[node]:
                by_host.setdefault(self.hosts[node], []).append(k)
        out = []
        for members in by_host.values():
            P = float(self.parallelism[i[members]].max())
            if P > 0.0 and len(members) > 1:
                out.append((members, P))
        return out

    def calibrated_compute(
        self, i: np.ndarray, a: np.ndarray, b: np.ndarray, fwd: np.ndarray, bwd: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``direct``: per-stage forward and backward seconds per micro-batch (shapes
        (S,); stage ``k`` on node ``i[k]`` holds layers ``a[k]..b[k]``) with the
        calibration charged: the optimizer step taken out of the backward (where the
        benchmark spread it over the ``M`` micro-batches), half of the node's
        ``microbatch_overhead_s`` on each, all stretched by :meth:`contention`; and the
        optimizer step's seconds per stage."""
        factor = self.contention(i)
        opt = self.step_prefix[i, b + 1] - self.step_prefix[i, a]
        half = 0.5 * self.mb_overhead[i]
        bwd = np.maximum(bwd - opt / self.schedule.microbatches, 0.0)
        return (fwd + half) * factor, (bwd + half) * factor, opt

    def optimizer_tail(
        self, i: np.ndarray, opt: np.ndarray, bwd: np.ndarray, link: np.ndarray
    ) -> float:
        """``direct``: seconds the optimizer steps (``opt``, shape (S,)) add after the
        pipeline's last backward. Every stage steps once its last backward is done;
        stage ``k``'s ends ``sum_{j<k} (b_j + link_j)`` before stage 0's (the last
        micro-batch's gradient still travels down to stage 0): ``max_k (opt_k -
        sum_{j<k} (b_j + link_j))``. Stages on one host step at about the same time,
        so at least the host's CPU work ``sum_k busy_share_k opt_k`` over its
        parallelism (:meth:`shared_hosts`)."""
        gap = np.concatenate([[0.0], np.cumsum(bwd[:-1] + link)])
        tail = max(0.0, float((opt - gap).max()))
        for members, P in self.shared_hosts(i):
            work = float((opt[members] * self.busy_share[i[members]]).sum())
            tail = max(tail, work / P)
        return tail
