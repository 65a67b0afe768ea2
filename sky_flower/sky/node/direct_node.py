"""The node's ``train.sky_direct`` handler body: one stage of a ``direct`` round.

Set-up from the message's :class:`sky_flower.sky.protocol.DirectConfig` (refuse a rank
planned for another node, build the stage and a fresh optimizer, the emulated links to
its peers), then :func:`sky_flower.pipeline.direct.run_stage`, then the reply.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from sky_flower.emulation import faults
from sky_flower.emulation.devices import EMULATED_S, Emulation
from sky_flower.pipeline.direct import (
    PEER_FAILURE,
    DirectStageError,
    Emulated,
    RankRefusedError,
    run_stage,
)
from sky_flower.pipeline.engine import Chunk
from sky_flower.pipeline.stage import (
    LossFn,
    MetricFn,
    RngKey,
    build_stage,
    frozen_keys,
    optimizer_from_tensors,
    optimizer_to_tensors,
    slice_state,
    stage_optimizer,
    trained_state,
)
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.node.stage_state import stage_reduction


def link_delay(lat_a: float, bw_a: float, lat_b: float, bw_b: float) -> Callable[[int], float]:
    """Seconds a peer message of ``nbytes`` takes between NICs ``a`` and ``b`` (latency
    s, bandwidth bytes/s, 0 = unlimited): half of each latency, and the bytes over the
    slower NIC (as :mod:`sky_flower.core.cost` charges direct hops)."""
    bw = min(bw_a, bw_b)
    return lambda nbytes: 0.5 * (lat_a + lat_b) + (nbytes / bw if bw > 0 else 0.0)


def emulated(emu: Emulation, ln: P.DirectLinks) -> Emulated:
    """The stage's emulation: the node's slowdown, the links to its next and previous
    stage (:func:`link_delay`)."""
    own = (ln.link_latency_s, ln.link_bandwidth_bps)
    return Emulated(
        slowdown=float(emu.slowdown),
        send_next_s=link_delay(*own, ln.next_latency_s, ln.next_bandwidth_bps),
        send_prev_s=link_delay(*own, ln.prev_latency_s, ln.prev_bandwidth_bps),
    )


def own_error(err: Exception) -> BaseException | None:
    """The exception of the stage's own computation (model, loss, data) behind ``err``,
    or None when ``err`` is the node's or a peer's failure: a refused rank, an injected
    fault, a peer that failed or stalled."""
    cause = err.__cause__ if isinstance(err, DirectStageError) else err
    if isinstance(err, RankRefusedError) or cause is None or PEER_FAILURE in str(err):
        return None
    return None if isinstance(cause, (faults.FaultInjected, DirectStageError)) else cause


def node_chunks(
    cfg: P.DirectConfig,
    model_fn: Callable[[], nn.Module],
    state: dict,
    device: torch.device | str = "cpu",
) -> list[Chunk]:
    """The rank's chunks from ``cfg.chunk_layers`` / ``cfg.chunk_shapes`` (interleaved,
    zero bubble), or its one stage ``cfg.stage.first..last`` as chunk ``rank``, on
    ``device``; their weights from ``state`` (keys of the full model)."""
    st, rank = cfg.stage, cfg.rendezvous.rank
    if cfg.chunk_layers == "-":
        module = build_stage(model_fn, st.first, st.last, state, device)
        return [Chunk(rank, module, tuple(cfg.input_shape), cfg.input_dtype)]
    chunks, dims = [], [int(v) for v in cfg.chunk_shapes.split()]
    triples = [int(v) for v in cfg.chunk_layers.split()]
    for i in range(0, len(triples), 3):
        c, first, last = triples[i : i + 3]
        ndim, dims = dims[0], dims[1:]
        shape, dims = tuple(dims[:ndim]), dims[ndim:]
        module = build_stage(model_fn, first, last, slice_state(state, first, last), device)
        chunks.append(Chunk(c, module, shape, cfg.input_dtype if c == 0 else None))
    return chunks


def run_direct_stage(  # noqa: PLR0913
    cfg: P.DirectConfig,
    weights: ArrayRecord,
    model_fn: Callable[[], nn.Module],
    node_id: int,
    emu: Emulation,
    batch_fn: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    metric_fn: MetricFn,
    optim: ArrayRecord | None = None,
) -> RecordDict:
    """Run this node's stage for one whole round on the ``direct`` transport.

    The node joins the round's process group, runs the ``torch.distributed.pipelining``
    schedule for ``cfg.steps`` steps with a fresh optimizer (none for a stage without
    parameters), the layers' randomness keyed by the run's seed and the round, leaves
    the group and
    returns its weights (:data:`~sky_flower.sky.protocol.ARRAYS`) and timings
    (:class:`~sky_flower.sky.protocol.DirectMetrics`). Emulation: the fleet's slowdown
    after each forward and backward of the stage module; link delay per peer message,
    slept by the sender (:class:`sky_flower.pipeline.direct.Emulated`). The stage
    computes on the node's device (``emu.device``); its weights and optimizer state
    come back on the CPU.

    Parameters
    ----------
    cfg : DirectConfig
        The stage, its rendezvous and links.
    weights : ArrayRecord
        The stage's layers' weights (keys of the full model).
    model_fn : callable
        ``() -> nn.Sequential``, the model.
    node_id : int
        This node's Flower node id (must be the one the rank was planned for).
    emu : Emulation
        This node's emulated device.
    batch_fn : callable
        ``step -> (x, labels)``, the data owner's batches (used on rank 0 only).
    loss_fn, metric_fn : callable
        The last stage's objective.
    optim : ArrayRecord, optional
        ``train.optimizer_state=keep``: the stage's layers' optimizer state by parameter
        name (:mod:`sky_flower.sky.migration`), loaded before the round and returned
        after it (:data:`~sky_flower.sky.migration.OPTIM_KEY`); None: a fresh optimizer.

    A stage whose own computation raises (its model, loss or data) replies with
    :data:`~sky_flower.sky.protocol.STAGE_ERROR` instead (:func:`own_error`).

    Raises
    ------
    RankRefusedError
        If the message was planned for another node, or its rank's ticket does not
        match the store's (before the node joins the group).
    DirectStageError
        If a peer fails or stalls (bounded by ``timeout_s``), or a fault is injected.
    """
    rdv, st = cfg.rendezvous, cfg.stage
    if cfg.node_id != int(node_id):
        raise RankRefusedError(
            f"rank {rdv.rank} refused: it is planned for node {cfg.node_id}, "
            f"not for this node ({node_id})"
        )
    device = emu.torch_device()  # the node's device; gloo peers exchange CPU tensors
    chunks = node_chunks(cfg, model_fn, weights.to_torch_state_dict(), device)
    module = nn.Sequential(*(ch.module for ch in chunks))  # every chunk's layers
    opt = stage_optimizer(module, st.optimizer, st.lr)
    if optim is not None and opt is not None:  # migrated (train.optimizer_state=keep)
        if cfg.chunk_layers != "-":  # refused by the settings (SkySettings.check_combinations)
            raise ValueError("train.optimizer_state=keep needs one chunk per stage")
        local = migration.local_optimizer_state(model_fn, st.first, st.last, optim)
        optimizer_from_tensors(opt, local.to_torch_state_dict())
    try:
        res = run_stage(
            rdv,
            chunks if cfg.chunk_layers != "-" else chunks[0].module,
            opt,
            kind=cfg.kind,
            microbatches=st.microbatches,
            steps=cfg.steps,
            batch_size=st.batch_size,
            input_shape=list(cfg.input_shape),
            input_dtype=cfg.input_dtype,
            batch_fn=batch_fn if rdv.rank == 0 else None,
            emulated=emulated(emu, cfg.links),
            fault=faults.step_hook(),
            loss_fn=loss_fn,
            metric_fn=metric_fn,
            rng=RngKey(st.seed, st.round),
            device=device,
            reduction=stage_reduction(st),  # the loss scaling on the last stage
        )
    except Exception as err:
        own = own_error(err)
        if own is None:
            raise
        return RecordDict({P.STAGE_ERROR: P.stage_error(own)})
    metrics = P.DirectMetrics(
        losses=tuple(float(v) for v in res.losses),
        correct=int(res.correct),
        n=int(res.samples),
        step_times_s=tuple(float(t) for t in res.step_times_s),
        setup_s=float(res.setup_s),
        compute_s=float(res.compute_s),
    )
    record = metrics.to_record()
    record[EMULATED_S] = float(res.compute_s) * float(emu.slowdown)  # this round's slowdown
    weights_out: dict[str, torch.Tensor] = {}
    for ch in chunks:  # back on the CPU for the server, without the frozen parameters
        weights_out.update(trained_state(ch.module.state_dict(), frozen_keys(ch.module)))
    out = RecordDict(
        {
            P.ARRAYS: ArrayRecord(weights_out),
            P.METRICS: record,
        }
    )
    if optim is not None:  # the state after the round, by parameter name
        local = ArrayRecord(optimizer_to_tensors(opt) if opt is not None else {})
        out[migration.OPTIM_KEY] = migration.global_optimizer_state(
            model_fn, st.first, st.last, local
        )
    return out
