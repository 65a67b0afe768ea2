"""The node's ``train.sky_direct`` handler body: one stage of a ``direct`` round, or of
every round of a ``direct`` stage session.

Set-up from the message's :class:`sky_flower.sky.protocol.DirectConfig` (refuse a rank
planned for another node, build the stage and a fresh optimizer, the emulated links to
its peers), then per round :func:`sky_flower.pipeline.direct.run_stage` and the reply
(:meth:`_DirectStage.train`, the one round both :func:`run_direct_stage` and
:func:`run_direct_session` run; a session's loop over its control stream:
:func:`sky_flower.sky.node.stage_session.serve_session`, the stream's too).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from sky_flower.emulation import faults
from sky_flower.emulation.devices import EMULATED_S, Emulation
from sky_flower.emulation.faults import StepHook
from sky_flower.pipeline.direct import (
    PEER_FAILURE,
    DirectStageError,
    Emulated,
    RankRefusedError,
    run_stage,
)
from sky_flower.pipeline.engine import Chunk
from sky_flower.pipeline.rendezvous import join
from sky_flower.pipeline.stage import RngKey, build_stage, slice_state, stage_optimizer
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.node.channels import Header
from sky_flower.sky.node.stage_ops import NodeStage
from sky_flower.sky.node.stage_session import Frames, SessionStage, serve_session
from sky_flower.sky.node.stage_state import stage_reduction

if TYPE_CHECKING:
    from sky_flower.sky.transport.channel import StageLink


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


def run_direct_stage(cfg: P.DirectConfig, node: NodeStage) -> RecordDict:
    """Run this node's stage for one whole round on the ``direct`` transport.

    The node joins the round's process group, runs the ``torch.distributed.pipelining``
    schedule for ``cfg.steps`` steps with a fresh optimizer (none for a stage without
    parameters), the layers' randomness keyed by the run's seed and the round, leaves
    the group and returns its weights (:data:`~sky_flower.sky.protocol.ARRAYS`) and
    timings (:class:`~sky_flower.sky.protocol.DirectMetrics`). Emulation: the fleet's
    slowdown after each forward and backward of the stage module; link delay per peer
    message, slept by the sender (:class:`sky_flower.pipeline.direct.Emulated`). The
    stage computes on the node's device (``emu.device``); its weights and optimizer
    state come back on the CPU.

    Parameters
    ----------
    cfg : DirectConfig
        The stage, its rendezvous and links.
    node : NodeStage
        The stage's weights (keys of the full model), the model, this node's id (must be
        the one the rank was planned for), its emulation and data (used on rank 0
        only), the objective and (``train.optimizer_state=keep``) the optimizer state by
        parameter name, loaded before the round and returned after it
        (:data:`~sky_flower.sky.migration.OPTIM_KEY`).

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
    stage = _DirectStage(cfg, node)
    rnd = cfg.stage.round
    return stage.train(rnd, cfg.steps, node.emulation_at(rnd), faults.step_hook(), joined=False)


class _DirectStage(SessionStage):
    """This node's rank of a ``direct`` pipeline: its chunks (built from the layers'
    weights, keys of the full model, on the node's device), their optimizer (loaded
    from the optimizer state by parameter name where given) and whether that state is
    kept across rounds (``train.optimizer_state=keep``). It trains one round at a time:
    a per-round message's one round, or each round of a stage session.

    Raises
    ------
    RankRefusedError
        If the message was planned for another node.
    """

    transport = P.DIRECT

    def __init__(self, cfg: P.DirectConfig, node: NodeStage) -> None:
        node.refuse_unless_planned(cfg.node_id, f"rank {cfg.rendezvous.rank}", RankRefusedError)
        self.cfg, self.node, self.st, self.index = cfg, node, cfg.stage, cfg.rendezvous.rank
        self.keeps_optimizer = node.optim is not None
        self.device = node.emulation_at(cfg.stage.round).torch_device()  # peers: CPU on gloo
        self.build(node.weights, node.optim)

    def build(self, weights: ArrayRecord, optim: ArrayRecord | None) -> None:
        """The chunks from ``weights`` and their optimizer, loaded from ``optim`` (the
        state by parameter name, keep) where given."""
        cfg, st = self.cfg, self.cfg.stage
        state = weights.to_torch_state_dict()
        self.chunks = node_chunks(cfg, self.node.model_fn, state, self.device)
        self.module = nn.Sequential(*self.parts())  # every chunk's layers
        self.opt = stage_optimizer(self.module, st.optimizer, st.lr)
        if optim is not None and self.opt is not None and cfg.chunk_layers != "-":
            # refused by the settings (SkySettings.check_combinations)
            raise ValueError("train.optimizer_state=keep needs one chunk per stage")
        migration.load_optimizer_state(self.opt, self.node.model_fn, st.first, st.last, optim)

    def parts(self) -> list[nn.Module]:
        """The chunks' modules."""
        return [ch.module for ch in self.chunks]

    def play(
        self,
        header: Header,
        frames: Frames,
        link: StageLink,
        emu: Emulation,
        fault: StepHook | None,
    ) -> tuple[RecordDict, bool]:
        """The round's ``steps`` in the session's process group (:meth:`train`,
        ``joined``) and the ``begin``'s ``release``. A failed round ends the session:
        an ``end`` frame with ``error`` (the stage's own error: with its
        :data:`~sky_flower.sky.protocol.STAGE_ERROR`, returned), or the error raised
        after it (a peer's failure, an injected fault: the group is unusable)."""
        rnd = int(header["round"])
        end = {"op": "end", "round": rnd}
        try:
            out = self.train(rnd, int(header["steps"]), emu, fault, joined=True)
        except Exception as err:
            link.send({**end, "error": str(err)[:500]})
            raise
        if P.STAGE_ERROR in out:
            link.send({**end, "error": str(out[P.STAGE_ERROR]["error"])[:500]}, out)
        return out, bool(header.get("release"))

    def release(self) -> None:
        """Free the chunks and their optimizer."""
        super().release()
        self.chunks = []

    def train(
        self, rnd: int, steps: int, emu: Emulation, fault: StepHook | None, joined: bool
    ) -> RecordDict:
        """Round ``rnd``: ``steps`` steps of the schedule
        (:func:`~sky_flower.pipeline.engine.run_stage`; ``joined``: in the session's
        group, else joining the round's and leaving it), ``fault`` called before each
        step, emulated as ``emu``. Returns the reply: the weights and buffers, the
        :class:`~sky_flower.sky.protocol.DirectMetrics` and (keep) the optimizer state
        by parameter name; or the :data:`~sky_flower.sky.protocol.STAGE_ERROR` of the
        stage's own error (:func:`own_error`), whose group is then gone.

        Raises
        ------
        RankRefusedError, DirectStageError
            As :func:`run_direct_stage` (a peer's failure or stall, a fault).
        """
        cfg, st, node = self.cfg, self.cfg.stage, self.node
        try:
            res = run_stage(
                cfg.rendezvous,
                module=self.chunks,  # with their input shapes and dtypes
                optimizer=self.opt,
                kind=cfg.kind,
                microbatches=st.microbatches,
                steps=steps,
                batch_size=st.batch_size,
                input_shape=list(cfg.input_shape),
                batch_fn=partial(node.batch_fn, rnd) if cfg.rendezvous.rank == 0 else None,
                emulated=emulated(emu, cfg.links),
                fault=fault,
                loss_fn=node.loss_fn,
                metric_fn=node.metric_fn,
                rng=RngKey(st.seed, rnd),
                device=emu.torch_device(),
                reduction=stage_reduction(st),  # the loss scaling on the last stage
                joined=joined,
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
        record[EMULATED_S] = float(res.compute_s) * float(emu.slowdown)  # this round's
        return migration.live_stage_reply(  # the weights back on the CPU
            self.parts(), record, self.opt, node.model_fn, st, self.keeps_optimizer
        )


def run_direct_session(cfg: P.DirectConfig, session: P.SessionLink, node: NodeStage) -> RecordDict:
    """Serve this node's stage for every round of a ``direct`` stage session until the
    server's ``close`` (:func:`~sky_flower.sky.node.stage_session.serve_session`).

    The stage connects its control stream (``session.link``: TLS, the certificate
    pinned, its ticket), joins the session's process group once
    (:func:`sky_flower.pipeline.rendezvous.join`) and plays each round in it
    (:meth:`_DirectStage.play`); its ``end`` frames carry its weights and buffers,
    :class:`~sky_flower.sky.protocol.DirectMetrics` and (keep) optimizer state.

    Returns
    -------
    RecordDict
        At ``close``: figures over the session (``rounds``, ``compute_s``); or the
        stage's own error.

    Raises
    ------
    RankRefusedError
        A message planned for another node, a rank's ticket that does not match.
    StreamRefusedError
        The control stream's certificate or ticket refused, its endpoint not reached.
    StreamError
        The control stream broke or ended before ``close``, or a frame is malformed.
    DirectStageError
        A peer failed or stalled (bounded by the group's timeout), or a fault struck.
    """
    from sky_flower.sky.transport.channel import connect

    rdv = cfg.rendezvous
    stage = _DirectStage(cfg, node)
    if rdv.rank == 0:  # the data owner's first draw loads its data: in the set-up
        node.batch_fn(cfg.stage.round, 0)
    link = connect(session.link, rdv.rank)
    try:
        join(rdv, stage.device)
        return serve_session(stage, link, session.silence_s)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        link.close(drain_s=2.0)  # a last end frame (an error) reaches the server
