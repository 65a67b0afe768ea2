"""SkyComputing's emulated fleet, for the planner and for the training job.

SkyComputing (Zhu, Li, You, arXiv 2202.11836, Sec. 4.1) emulates heterogeneous devices on
identical GPUs: every worker gets a random integer slowdown drawn once, reproducibly
(their ``experiment/config.py``: ``np.random.default_rng(seed=35).integers(low=1, high=7,
size=num + 1)``, worker ``i`` takes entry ``i``), and sleeps that many times its compute
time after each compute, so it runs ``1 + s`` times slower.

Here node ``i`` takes entry ``i`` for ``i = 1 .. N - 1`` as in SkyComputing. Their rank 0
is the coordinator and holds no layers; here node 0 is the data owner, which runs stage 0
because raw inputs never leave it, so it is a worker too and takes entry 0. numpy's draw
is prefix-stable (the first ``k`` values do not depend on ``size``), so ``size = N + 1``
and SkyComputing's ``size = N`` give the same slowdowns.

:func:`synthetic_node_profiles` turns a layer profile and such a fleet into the
:class:`~sky_flower.core.profile.NodeProfile` list the planner takes, from a nominal FLOP rate
instead of a benchmark round: what a 64-node planning study needs without 64 nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sky_flower.core.profile import LayerProfile, NodeProfile

SKYCOMPUTING_SEED = 35


def skycomputing_slowdowns(num_nodes: int, seed: int = SKYCOMPUTING_SEED) -> list[int]:
    """SkyComputing's emulated slowdown of each node.

    Parameters
    ----------
    num_nodes : int
        Nodes ``N`` in the fleet (data owner included).
    seed : int
        Seed of ``numpy.random.default_rng`` (SkyComputing: 35).

    Returns
    -------
    list of int
        ``N`` values in ``1 .. 6``: ``default_rng(seed).integers(1, 7, size=N + 1)[:N]``.
        Node ``i`` runs ``1 + s_i`` times slower than the device it is emulated on
        (see :class:`sky_flower.emulation.devices.Emulation`).

    Raises
    ------
    ValueError
        If ``num_nodes`` is not a positive integer.
    """
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive integer, got {num_nodes!r}")
    draw = np.random.default_rng(seed).integers(1, 7, size=num_nodes + 1)
    return [int(v) for v in draw[:num_nodes]]


def synthetic_node_profiles(
    layers: Sequence[LayerProfile],
    slowdowns: Sequence[float],
    microbatch_size: int,
    flops_per_s: float,
    memory_bytes: int | Sequence[int],
    latency_s: float = 0.0,
    bandwidth_bps: float = math.inf,
    names: Sequence[str] | None = None,
) -> list[NodeProfile]:
    """Node profiles from FLOP counts and a nominal rate instead of a benchmark round.

    Node ``i`` takes ``fwd_flops[j] x microbatch_size / flops_per_s x (1 + slowdowns[i])``
    seconds for layer ``j``'s forward pass on one micro-batch, likewise for the
    backward pass. Node 0 is the data owner (``holds_data=True``).

    Parameters
    ----------
    layers : sequence of LayerProfile
        Per-layer FLOPs per sample (e.g. :func:`sky_flower.core.bert.bert_layer_profiles`).
    slowdowns : sequence of float
        ``s_i >= 0`` per node (e.g. :func:`skycomputing_slowdowns`); its length is the
        number of nodes. Recorded in ``NodeProfile.slowdown``.
    microbatch_size : int
        Samples per micro-batch (the batch size divided by the micro-batches).
    flops_per_s : float
        FLOP/s of the undisturbed device (same for all nodes before the slowdown).
    memory_bytes : int or sequence of int
        Memory per node in bytes: one value for all, or one per node.
    latency_s : float
        Seconds per message round trip, every node.
    bandwidth_bps : float
        Link bandwidth in bytes per second, every node (``inf`` = free transfers).
    names : sequence of str, optional
        Node names; default ``node0 .. node{N-1}``.

    Returns
    -------
    list of NodeProfile
        One per node, in the order of ``slowdowns``.

    Raises
    ------
    ValueError
        On no layers or no nodes, a non-positive ``flops_per_s``, ``microbatch_size``,
        memory or bandwidth, a negative slowdown or latency, or ``memory_bytes`` /
        ``names`` whose length differs from ``slowdowns``.
    """
    n = len(slowdowns)
    if not layers:
        raise ValueError("no layers: pass the model's layer profiles")
    if n < 1:
        raise ValueError("no nodes: pass one slowdown per node")
    if not flops_per_s > 0 or math.isinf(flops_per_s):
        raise ValueError(f"flops_per_s must be a positive finite rate, got {flops_per_s}")
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int):
        raise ValueError(f"microbatch_size must be an integer, got {microbatch_size!r}")
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    bad = [(i, s) for i, s in enumerate(slowdowns) if not (s >= 0 and math.isfinite(s))]
    if bad:
        raise ValueError(f"slowdowns must be >= 0, got (node, slowdown) {bad}")
    if not latency_s >= 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s}")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth_bps must be > 0 (inf for free transfers), got {bandwidth_bps}")
    if isinstance(memory_bytes, int | float):
        memory = [int(memory_bytes)] * n
    else:
        memory = [int(m) for m in memory_bytes]
        if len(memory) != n:
            raise ValueError(
                f"memory_bytes has {len(memory)} entries but there are {n} nodes "
                "(one slowdown each): pass one value per node or a single value"
            )
    if any(m <= 0 for m in memory):
        raise ValueError(f"memory_bytes must be > 0 for every node, got {memory}")
    node_names = [f"node{i}" for i in range(n)] if names is None else [str(x) for x in names]
    if len(node_names) != n:
        raise ValueError(f"names has {len(node_names)} entries but there are {n} nodes")
    if len(set(node_names)) != n:
        raise ValueError(f"node names must be unique, got {node_names}")

    fwd = np.array([lp.fwd_flops for lp in layers], dtype=float) * microbatch_size / flops_per_s
    bwd = np.array([lp.bwd_flops for lp in layers], dtype=float) * microbatch_size / flops_per_s
    return [
        NodeProfile(
            name=node_names[i],
            layer_fwd_s=tuple(float(t) for t in fwd * (1.0 + slowdowns[i])),
            layer_bwd_s=tuple(float(t) for t in bwd * (1.0 + slowdowns[i])),
            memory_bytes=memory[i],
            latency_s=float(latency_s),
            bandwidth_bps=float(bandwidth_bps),
            holds_data=i == 0,
            slowdown=float(slowdowns[i]),
        )
        for i in range(n)
    ]
