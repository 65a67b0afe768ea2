"""Sky handlers for a Flower ``ClientApp``: benchmark, echo, and the stage protocol.

Register them on your own ClientApp beside your FedAvg handlers::

    app = ClientApp()
    SkyClient(model_fn=Net, load_data=my_partition).register(app)

Every message type of :mod:`sky_flower.sky.protocol` (its table: names and records) is
served by one handler method of :class:`SkyClient` (:meth:`SkyClient.register`), each
saying what it does.

A forward or backward is one op that the node's interpreter
(:func:`sky_flower.sky.node.stage_ops.answer_op`, the stream's too) serves over the
message (:class:`~sky_flower.sky.node.channels.MessageChannel`) on the stage in
``context.state`` (:class:`ContextStage`). One whose stage raises (its model, loss or
data) replies with the error in :data:`~sky_flower.sky.protocol.STAGE_ERROR`: the server
fails the round naming the node and the reason, and drops no node for it. A malformed op
(:class:`~sky_flower.sky.node.stage_ops.MalformedOpError`), a node that lacks the state a
message needs (:class:`NodeStateError`: it restarted or missed a message) and an
injected fault still raise, which Flower turns into an error reply: the node failed.

Every stage message is applied once: a repeat gets its first reply, an older one a
``STAGE_ERROR`` refusal (:func:`sky_flower.sky.node.stage_state.replay`).

Stage weights, optimizer state and stashed inputs persist in ``context.state`` between
messages (records only: this also works where each message runs in a fresh process).
Raw inputs never leave the data owner; labels travel to the last stage. A fleet entry
that sets ``fail_on`` gets :func:`sky_flower.emulation.faults.inject` around its
handlers (failure tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import asdict, replace
from functools import partial

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from sky_flower.core.example import as_dtype
from sky_flower.core.profile import (
    default_optimizer_factory,
    time_layers,
    time_optimizer_steps,
)
from sky_flower.emulation import faults
from sky_flower.emulation.devices import Emulation, message_round
from sky_flower.flower.quiet import quiet_actor_exit
from sky_flower.flower.runtime import simulation_workers
from sky_flower.pipeline.calibrate import NodeCalibration, calibrate_node
from sky_flower.pipeline.data import Split
from sky_flower.pipeline.device import device_info
from sky_flower.pipeline.objective import resolve
from sky_flower.pipeline.sources import DataSource
from sky_flower.pipeline.stage import (
    LossFn,
    MetricFn,
    StageExecutor,
    model_frozen_keys,
    step_batch,
)
from sky_flower.sky import migration
from sky_flower.sky import protocol as P
from sky_flower.sky.node.channels import MessageChannel
from sky_flower.sky.node.stage_ops import NodeStage, OpStage, answer_op
from sky_flower.sky.node.stage_state import (
    NodeStateError,
    direct_ran,
    direct_repeat,
    load_stage,
    remember,
    replay,
    save_stage,
    session_ran,
    session_repeat,
    time_state_roundtrip,
)

STAGE = "sky.stage"
WEIGHTS = "sky.weights"
OPTIM = "sky.optim"
PROBE = "sky.probe"
GRADS = "sky.grads"  # gradients accumulated over the step so far
ACCUM = "sky.accum"  # {"step", "done"} micro-batches back-propagated
STASH_MB = "sky.stash."  # + first micro-batch of the group

Handler = Callable[[Message, Context, Emulation], RecordDict]


class _ContextStash(MutableMapping[int, torch.Tensor]):
    """A relay stage's stashed forward inputs in ``context.state``, by a group's first
    micro-batch (``ArrayRecord`` ``{"x": input}`` under ``sky.stash.<first>``)."""

    def __init__(self, context: Context) -> None:
        self.state = context.state

    def __getitem__(self, first: int) -> torch.Tensor:
        key = f"{STASH_MB}{first}"
        if key not in self.state:
            raise KeyError(first)
        return self.state.array_records[key].to_torch_state_dict()["x"]

    def __setitem__(self, first: int, x: torch.Tensor) -> None:
        self.state[f"{STASH_MB}{first}"] = ArrayRecord({"x": x})

    def __delitem__(self, first: int) -> None:
        del self.state[f"{STASH_MB}{first}"]

    def __iter__(self) -> Iterator[int]:
        n = len(STASH_MB)
        return iter(int(k[n:]) for k in self.state if k.startswith(STASH_MB))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ContextStage(OpStage):
    """A relay stage: rebuilt from ``context.state`` for each op (weights and buffers,
    optimizer state, the gradients accumulated so far), saved back after it; its stash
    a :class:`_ContextStash` (records only: this also works where each message runs in a
    fresh process).

    Parameters
    ----------
    client : SkyClient
        The node's model, data and objective.
    context : Context
        The node's context (its ``state`` holds the stage).
    emu : Emulation
        The node's emulation (its device).

    Raises
    ------
    NodeStateError
        If no stage is installed on this node (``train.sky_setup`` first).
    """

    missing = NodeStateError  # a backward without its stash: the node lost its state

    def __init__(self, client: SkyClient, context: Context, emu: Emulation) -> None:
        self.client, self.context, self.emu = client, context, emu
        self.st = client._stage(context)
        self.stash = _ContextStash(context)
        self.compute_s = 0.0

    def layers(self) -> tuple[nn.Module, torch.optim.Optimizer | None, torch.device]:
        """The stage from ``context.state`` on the node's device (``emu.device``: the
        records stay on the CPU, the executor moves tensors at its edges)."""
        st, records = self.st, self.context.state.array_records
        device = self.emu.torch_device()
        factory = default_optimizer_factory(st.optimizer, st.lr)
        weights = (records[WEIGHTS], records.get(OPTIM))
        module, opt = load_stage(self.client.model_fn, st.first, st.last, weights, factory, device)
        return module, opt, device

    def executor(self, group: P.MicroBatchGroup) -> StageExecutor:
        """The stage's executor for ``group``, with the gradients accumulated over the
        step so far."""
        ex = super().executor(group)
        if GRADS in self.context.state:
            ex.load_grads(self.context.state.array_records[GRADS].to_torch_state_dict())
        return ex

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The data owner's batch of step ``step`` (the node's ``load_data``)."""
        return self.client._batch(self.context, self.st, step)  # type: ignore[return-value]

    def objective(self) -> tuple[LossFn, MetricFn]:
        """The node's loss and metric, else the stage config's."""
        return self.client._objective(self.st)

    def accumulated(self, group: P.MicroBatchGroup) -> int:
        """Micro-batches of ``group.step`` back-propagated on this stage, this group's
        included.

        Raises
        ------
        NodeStateError
            If another step's micro-batches are still accumulating.
        """
        state, done = self.context.state, 0
        if ACCUM in state:
            acc = state.config_records[ACCUM]
            if int(acc["step"]) != group.step:
                raise NodeStateError(
                    f"step {group.step} arrived while step {int(acc['step'])} still has "
                    f"{self.st.microbatches - int(acc['done'])} micro-batches to "
                    "back-propagate"
                )
            done = int(acc["done"])
        return done + group.count

    def keep(self, ex: StageExecutor, group: P.MicroBatchGroup, done: int) -> None:
        """Save the stepped stage (``done == M``), else the gradients accumulated so far
        and the buffers this group updated (BatchNorm: every group's micro-batches count,
        as in the whole model)."""
        state = self.context.state
        if done >= self.st.microbatches:
            state[WEIGHTS], state[OPTIM] = save_stage(ex.module, ex.optimizer)
            for key in (GRADS, ACCUM):
                if key in state:
                    del state[key]
        else:
            state[GRADS] = ArrayRecord({k: v.detach() for k, v in ex.grads().items()})
            weights = state.array_records[WEIGHTS]
            for name, array in ArrayRecord(ex.buffers()).items():
                weights[name] = array
            state[ACCUM] = ConfigRecord({"step": group.step, "done": done})


def _payload_bytes(content: RecordDict) -> int:
    return sum(rec.count_bytes() for rec in content.values())


class SkyClient:
    """Node side of sky-flower.

    Parameters
    ----------
    model_fn : callable
        ``() -> nn.Sequential``: the same model the server uses (only its structure
        matters; weights come from the server).
    load_data : callable
        ``Context -> Split | DataSource | None``: this node's local training data
        (numpy ``x`` of shape ``(n, *input_shape)``, ``y`` int64 labels of shape
        ``(n,)``, or any :mod:`sky_flower.pipeline.sources` source), or None if the
        node holds none. A node whose loader returns data is a data owner. It is
        called on every training step of the data owner: cache what it loads.
    emulation_fn : callable, optional
        ``Context -> Emulation``: the node's emulated device (slowdown, memory cap,
        link). Default: none (native speed), the node named by
        ``node_config["sky-node"]``, else ``node<partition-id>``.
    loss_fn : callable, optional
        ``(output, labels) -> scalar`` loss of a micro-batch, on the last stage
        (relay and direct), reduced as the stage config's ``reduction`` declares.
        Default: the stage config's ``loss`` (the server's, by reference;
        cross-entropy unless set).
    metric_fn : callable, optional
        ``(output, labels) -> int`` (reported as ``correct``), on the last stage.
        Default: the stage config's ``metric`` (correct predictions unless set).
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        load_data: Callable[[Context], Split | DataSource | None],
        emulation_fn: Callable[[Context], Emulation] | None = None,
        loss_fn: LossFn | None = None,
        metric_fn: MetricFn | None = None,
    ) -> None:
        self.model_fn = model_fn
        self.load_data = load_data
        self.emulation_fn = emulation_fn or default_emulation
        self.loss_fn = loss_fn
        self.metric_fn = metric_fn

    def register(self, app: ClientApp) -> ClientApp:
        """Add the Sky handlers to ``app`` and return it."""
        handlers: dict[str, Handler] = {
            P.PROFILE: self.profile,
            P.ECHO: self.echo,
            P.SETUP: self.setup,
            P.FORWARD: self.forward,
            P.BACKWARD: self.backward,
            P.COLLECT: self.collect,
            P.DIRECT: self.direct,
            P.STREAM: self.stream,
            P.STREAM_ECHO: self.stream_echo,
        }
        for mtype, fn in handlers.items():
            kind = app.query if mtype.startswith("query.") else app.train
            kind(P.action(mtype))(self._wrap(fn))
        return app

    # --- plumbing --------------------------------------------------------------------
    def _wrap(self, fn: Handler) -> Callable[[Message, Context], Message]:
        """The Flower handler of ``fn``: the node's emulation (faults of its fleet entry,
        link delay) around it, ``busy_s`` added to its metrics."""
        faulty = faults.inject(fn)

        def handler(msg: Message, context: Context) -> Message:
            t_start = time.perf_counter()
            quiet_actor_exit()  # the engine's shutdown notice, in this (actor) process
            again = replay(msg, context)  # a repeat (its first reply) or a stale message
            if again is not None:
                return Message(again, reply_to=msg)
            torch.set_num_threads(1)
            emu = self.emulation_fn(context)
            if emu.drifts:  # fleet drift: this round's slowdown; absent: fails (raises)
                emu = emu.at_round(message_round(msg))
            # a stage session applies faults round by round itself (faults.round_hook)
            faults_here = emu.fail_on and not P.starts_session(msg.content)
            content = (faulty if faults_here else fn)(msg, context, emu)
            delay = emu.link_delay_s(_payload_bytes(msg.content) + _payload_bytes(content))
            if delay > 0:
                time.sleep(delay)
            if P.METRICS in content.metric_records:  # wall seconds inside the handler
                content.metric_records[P.METRICS][P.BUSY_S] = time.perf_counter() - t_start
            remember(msg, context, content)  # applied once: a repeat gets this reply
            return Message(content, reply_to=msg)

        handler.__name__ = fn.__name__
        return handler

    @staticmethod
    def _stage(context: Context) -> P.StageConfig:
        if STAGE not in context.state.config_records:
            raise NodeStateError("no stage installed on this node: train.sky_setup first")
        return P.StageConfig.from_config_record(context.state.config_records[STAGE])

    def _objective(self, st: P.StageConfig) -> tuple[LossFn, MetricFn]:
        """The last stage's loss and metric: the node's own, else the stage config's."""
        return self.loss_fn or resolve(st.loss), self.metric_fn or resolve(st.metric)

    def _batch(self, context: Context, st: P.StageConfig, step: int) -> tuple[torch.Tensor, ...]:
        data = self.load_data(context)
        if data is None:
            raise RuntimeError("stage 0 was placed on a node that holds no data")
        return step_batch(data, st.batch_size, st.round, st.seed, step)

    # --- handlers --------------------------------------------------------------------
    def profile(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Benchmark this node on the model's own layers; with a :data:`~sky_flower.sky.
        protocol.LINK` record (``transport=stream``), first answer the server's echo
        frames on that stream endpoint (its link timed over the data plane in the same
        message, :func:`sky_flower.sky.transport.stream_probe.echo_frames`)."""
        req = P.ProfileRequest.from_config_record(msg.content.config_records.get(P.CONFIG))
        link = msg.content.config_records.get(P.LINK)
        if link is not None:
            from sky_flower.sky.transport.stream_probe import echo_frames

            echo_frames(P.StreamLink.from_config_record(link), emu)
        device = emu.torch_device()  # a CUDA node without CUDA: refused, naming the node
        fwd, bwd = time_layers(
            self.model_fn(),
            list(req.input_shape),
            req.microbatch_size,
            warmup=req.warmup,
            repeats=req.repeats,
            dtype=as_dtype(req.input_dtype),
            device=device,
        )
        factor = 1.0 + emu.slowdown
        step_s: list[float] = [0.0] * len(fwd)
        rebuild_rate = save_rate = 0.0
        if req.optimizer is not None:  # optimizer step per layer; the state round trip
            make_opt = default_optimizer_factory(req.optimizer, req.lr)
            step_s = time_optimizer_steps(self.model_fn(), make_opt, device=device)
            rebuild_rate, save_rate = time_state_roundtrip(self.model_fn, make_opt, device=device)
        cal = NodeCalibration()
        if req.calibrate:
            cal = calibrate_node(req.microbatch_size, device=device)
        info = device_info(device)
        data = self.load_data(context)  # a data owner is a node whose loader has data
        holds_data = data is not None and len(data) > 0
        reply = P.ProfileReply(
            name=emu.name,
            holds_data=holds_data,
            num_examples=len(data) if data is not None and holds_data else 0,
            memory_bytes=emu.memory_bytes(info.available_bytes),
            slowdown=float(emu.slowdown),
            emulation=emu.describe(),
            link_latency_s=emu.latency_ms / 1000.0,
            link_bandwidth_bps=(emu.bandwidth_mb_s or 0.0) * 1e6,
            layer_fwd_s=tuple(t * factor for t in fwd),
            layer_bwd_s=tuple(t * factor for t in bwd),
            layer_step_s=tuple(t * factor for t in step_s),
            state_rebuild_s_per_byte=rebuild_rate,
            state_save_s_per_byte=save_rate,
            device=info.device,
            device_name=info.name or P.NO_HOST,
            runtime_workers=simulation_workers(),
            **{k: v for k, v in asdict(cal).items() if v != ""},
        )
        return RecordDict({P.PROFILE_KEY: reply.to_config_record()})

    def echo(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Return the payload unchanged.

        ``config["store_bytes"] > 0`` first stores a probe array of that size in
        ``context.state`` (so later messages show what state costs); ``< 0`` removes it.
        """
        cfg = msg.content.config_records.get(P.CONFIG)
        store = P.EchoRequest.from_config_record(cfg or {}).store_bytes
        if store > 0:
            context.state[PROBE] = ArrayRecord({"p": torch.zeros(store, dtype=torch.uint8)})
        elif store < 0 and PROBE in context.state:
            del context.state[PROBE]
        return RecordDict({P.PAYLOAD: msg.content.array_records[P.PAYLOAD]})

    def setup(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Install this round's stage (layer range, weights, fresh optimizer)."""
        st = P.StageConfig.from_config_record(msg.content.config_records.get(P.CONFIG))
        context.state[STAGE] = st.to_config_record()
        context.state[WEIGHTS] = msg.content.array_records[P.ARRAYS]
        for key in list(context.state.keys()):
            if key in (OPTIM, GRADS, ACCUM) or key.startswith(STASH_MB):
                del context.state[key]
        if migration.OPTIM_KEY in msg.content.array_records:  # kept across rounds
            context.state[OPTIM] = migration.local_optimizer_state(
                self.model_fn, st.first, st.last, msg.content.array_records[migration.OPTIM_KEY]
            )
        return RecordDict({P.METRICS: MetricRecord({P.READY: 1})})

    def forward(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Forward of one group of micro-batches (the last stage: loss and backward too,
        gradients accumulated; the optimizer steps after the step's last micro-batch)."""
        return self._op("F", msg, context, emu)

    def backward(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Backward of one group from its stashed input; gradients accumulate, the
        optimizer steps after the step's last micro-batch."""
        return self._op("B", msg, context, emu)

    def _op(self, op: str, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Op ``op`` of the message (a :class:`MessageChannel`: its one op) served by the
        node's interpreter (:func:`sky_flower.sky.node.stage_ops.answer_op`) on the stage
        in ``context.state`` (:class:`ContextStage`); the reply's content: the op's
        result, or the :data:`~sky_flower.sky.protocol.STAGE_ERROR` of the stage's own
        error.

        Raises
        ------
        NodeStateError
            If the node lacks the stage's state (no set-up, a lost accumulation or stash).
        MalformedOpError
            If the op is malformed (its group, its inputs).
        """
        channel = MessageChannel(op, msg.content)
        stage = ContextStage(self, context, emu)
        for header, records in channel.frames():
            answer_op(stage, channel, header, records, emu)
        channel.close()
        if channel.reply is None:
            raise RuntimeError(f"{msg.metadata.message_type} got no reply")
        return channel.reply

    def collect(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Return the stage's weights (end of round): its trainable parameters and
        buffers, not its frozen parameters (``requires_grad=False``, unchanged by
        training: :func:`sky_flower.pipeline.stage.trained_state`); its optimizer state
        too, keyed by the model's parameter names, when the message asks (``optim``)."""
        weights = context.state.array_records[WEIGHTS]
        frozen = model_frozen_keys(self.model_fn)
        if frozen & set(weights.keys()):
            weights = ArrayRecord({k: v for k, v in weights.items() if k not in frozen})
        out = RecordDict({P.ARRAYS: weights})
        if migration.wants_optimizer(msg.content):
            st = self._stage(context)
            out[migration.OPTIM_KEY] = migration.global_optimizer_state(
                self.model_fn, st.first, st.last, context.state.array_records.get(OPTIM)
            )
        return out

    def direct(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Run this node's stage for one whole round on the ``direct`` transport
        (:func:`sky_flower.sky.node.direct_node.run_direct_stage`), or, for a message
        with a :data:`~sky_flower.sky.protocol.SESSION` record, every round of a stage
        session (:func:`sky_flower.sky.node.direct_node.run_direct_session`).

        Raises
        ------
        RankRefusedError
            If the message was planned for another node, or its rank's ticket does not
            match the store's.
        DirectStageError
            If this stage or a peer fails or stalls (bounded by ``timeout_s``).
        """
        from sky_flower.sky.node.direct_node import run_direct_session, run_direct_stage

        cfg = P.DirectConfig.from_config_record(msg.content.config_records.get(P.CONFIG))
        link = msg.content.config_records.get(P.SESSION)
        if link is None:
            return self._live_stage(msg, context, emu, cfg.stage, partial(run_direct_stage, cfg))
        run = partial(run_direct_session, cfg, P.SessionLink.from_config_record(link))
        return self._live_stage(msg, context, None, cfg.stage, run)

    def stream(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """This node's stage for a whole ``stream`` round, or for every round of a
        stage session (``across_rounds``):
        :func:`sky_flower.sky.node.stream_node.run_stream_session`."""
        from sky_flower.sky.node.stream_node import run_stream_session

        cfg = P.StreamConfig.from_config_record(msg.content.config_records.get(P.CONFIG))
        run = partial(run_stream_session, cfg)
        return self._live_stage(msg, context, None if cfg.across_rounds else emu, cfg.stage, run)

    def _live_stage(
        self,
        msg: Message,
        context: Context,
        emu: Emulation | None,
        st: P.StageConfig,
        run: Callable[[NodeStage], RecordDict],
    ) -> RecordDict:
        """A stage that stays live for a whole round (``direct``, ``stream``; ``emu``:
        the handler's emulation, its faults applied around the handler) or for every
        round of a stage session (``emu`` None: the node's emulation by round, the
        session applying the fleet's faults round by round itself). It runs once: a
        repeat is refused (:func:`direct_repeat`, a session's :func:`session_repeat`).
        ``run`` gets what the node gives the stage (:class:`NodeStage`)."""
        session = emu is None
        repeat, ran = (session_repeat, session_ran) if session else (direct_repeat, direct_ran)
        refused = repeat(st, context)  # a repeat never runs twice
        if refused is not None:
            return refused
        ran(st, context)
        loss_fn, metric_fn = self._objective(st)
        base = self.emulation_fn(context) if emu is None else emu
        node = NodeStage(
            weights=msg.content.array_records[P.ARRAYS],
            model_fn=self.model_fn,
            node_id=int(context.node_id),
            emulation_at=base.at_round if session and base.drifts else (lambda rnd: base),
            batch_fn=lambda rnd, step: self._batch(context, replace(st, round=rnd), step),
            loss_fn=loss_fn,
            metric_fn=metric_fn,
            optim=msg.content.array_records.get(migration.OPTIM_KEY),
        )
        return run(node)

    def stream_echo(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Answer echo frames on the stream endpoint (the link over the data plane)."""
        from sky_flower.sky.transport.stream_probe import echo_frames

        return echo_frames(P.StreamLink.from_config_record(msg.content[P.CONFIG]), emu)


# --- a node's defaults in the simulation engine: its emulation and its data by partition --
def default_emulation(context: Context) -> Emulation:
    """A native node named by ``node_config["sky-node"]`` or its partition id."""
    cfgn = context.node_config
    name = str(cfgn.get("sky-node", f"node{cfgn.get('partition-id', 0)}"))
    return Emulation(name=name)


def fleet_emulation(fleet: list[Emulation]) -> Callable[[Context], Emulation]:
    """Map simulation partition ``i`` to fleet node ``i``."""

    def emulation_fn(context: Context) -> Emulation:
        pid = int(context.node_config.get("partition-id", 0))
        if not 0 <= pid < len(fleet):
            raise ValueError(f"partition-id {pid} has no fleet entry ({len(fleet)} nodes)")
        return fleet[pid]

    return emulation_fn


def owner_data_fn(
    fleet: list[Emulation],
    dataset: str | dict = "digits",
    test_fraction: float = 0.2,
    seed: int = 0,
) -> Callable[[Context], Split | None]:
    """This node's partition if it is a data owner (``pipeline.data.owner_split``)."""
    from sky_flower.pipeline.data import owner_split

    owners = [n.name for n in fleet if n.holds_data]
    cache: dict[str, Split] = {}

    def load(context: Context) -> Split | None:
        emu = fleet_emulation(fleet)(context)
        if not emu.holds_data:
            return None
        if emu.name not in cache:  # the same seeded split as the server's
            i, n = owners.index(emu.name), len(owners)
            cache[emu.name] = owner_split(dataset, i, n, seed, test_fraction)
        return cache[emu.name]

    return load
