"""Sky handlers for a Flower ``ClientApp``: benchmark, echo, and the stage protocol.

Register them on your own ClientApp beside your FedAvg handlers::

    app = ClientApp()
    SkyClient(model_fn=Net, load_data=my_partition).register(app)

Message types served (``flwr`` allows ``train``/``evaluate``/``query`` + ``.action``):

=====================  ===============================================================
``query.sky_profile``  time this node's own layers (fwd + bwd per micro-batch, median
                       after warm-up), report memory available and emulation
``query.sky_echo``     send the payload back (the server times two sizes for latency
                       and bandwidth)
``train.sky_setup``    receive this round's stage: layer range, weights, optimizer
``train.sky_forward``  stage 0: run own batch ``step``; other stages: run the incoming
                       activations; the last stage also computes the loss, back-
                       propagates and steps its optimizer
``train.sky_backward`` recompute forward from the stashed input, back-propagate the
                       incoming gradient, step the optimizer, return input gradients
``train.sky_collect``  return the stage's weights at the end of the round
``train.sky_pipe_fwd`` pipelined relay (``schedule.kind=gpipe|1f1b``): forward of the
                       micro-batches ``first .. first+count-1`` of step ``step`` (the
                       last stage: loss and backward too); stashes each group's input
``train.sky_pipe_bwd`` pipelined relay: backward of one group from its stash; gradients
                       accumulate in ``context.state`` and the optimizer steps once
                       the step's ``M`` micro-batches are all back-propagated
``train.sky_direct``   ``transport=direct``: run this node's stage for a whole round
                       peer to peer (:mod:`sky_flower.pipeline.direct`), return its weights
                       and timings (one message per stage per round)
=====================  ===============================================================

Stage weights, optimizer state and stashed inputs persist in ``context.state`` between
messages (records only: this also works where each message runs in a fresh process).
Raw inputs never leave the data owner; labels travel to the last stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from sky_flower.core.profile import (
    as_layers,
    default_optimizer_factory,
    time_layers,
    time_optimizer_steps,
)
from sky_flower.emulation.devices import Emulation
from sky_flower.pipeline.data import Split, batch_indices
from sky_flower.pipeline.stage import (
    StageExecutor,
    build_stage,
    optimizer_from_tensors,
    optimizer_to_tensors,
)

STAGE = "sky.stage"
WEIGHTS = "sky.weights"
OPTIM = "sky.optim"
STASH = "sky.stash"
PROBE = "sky.probe"
GRADS = "sky.grads"  # pipelined relay: gradients accumulated over the step so far
ACCUM = "sky.accum"  # pipelined relay: {"step", "done"} micro-batches back-propagated
STASH_MB = "sky.stash."  # pipelined relay: + first micro-batch of the group


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
        ``Context -> Split | None``: this node's local training data (numpy ``x`` of
        shape ``(n, *input_shape)``, ``y`` int64 labels of shape ``(n,)``), or None if
        the node holds none. A node whose loader returns data is a data owner. It is
        called on every training step of the data owner: cache what it loads.
    emulation_fn : callable, optional
        ``Context -> Emulation``: the node's emulated device (slowdown, memory cap,
        link). Default: none (native speed), the node named by
        ``node_config["sky-node"]``, else ``node<partition-id>``.
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        load_data: Callable[[Context], Split | None],
        emulation_fn: Callable[[Context], Emulation] | None = None,
    ) -> None:
        self.model_fn = model_fn
        self.load_data = load_data
        self.emulation_fn = emulation_fn or default_emulation

    def register(self, app: ClientApp) -> ClientApp:
        """Add the Sky handlers to ``app`` and return it."""
        app.query("sky_profile")(self._wrap(self.profile))
        app.query("sky_echo")(self._wrap(self.echo))
        app.train("sky_setup")(self._wrap(self.setup))
        app.train("sky_forward")(self._wrap(self.forward))
        app.train("sky_backward")(self._wrap(self.backward))
        app.train("sky_collect")(self._wrap(self.collect))
        app.train("sky_pipe_fwd")(self._wrap(self.pipe_forward))
        app.train("sky_pipe_bwd")(self._wrap(self.pipe_backward))
        app.train("sky_direct")(self._wrap(self.direct))
        return app

    # --- plumbing --------------------------------------------------------------------
    def _wrap(
        self, fn: Callable[[Message, Context, Emulation], RecordDict]
    ) -> Callable[[Message, Context], Message]:
        def handler(msg: Message, context: Context) -> Message:
            t_start = time.perf_counter()
            torch.set_num_threads(1)
            emu = self.emulation_fn(context)
            cfg = msg.content.config_records.get("config")
            rnd = int(cfg["round"]) if cfg is not None and "round" in cfg else None
            malformed = emu.check_fault(msg.metadata.message_type, rnd)
            content = fn(msg, context, emu)
            if malformed:  # fault injection: every array cut to one row
                for rec in content.array_records.values():
                    for key in list(rec.keys()):
                        rec[key] = ArrayRecord({key: torch.zeros(1)})[key]
            delay = emu.link_delay_s(_payload_bytes(msg.content) + _payload_bytes(content))
            if delay > 0:
                time.sleep(delay)
            if "metrics" in content.metric_records:  # wall seconds inside the handler
                content.metric_records["metrics"]["busy_s"] = time.perf_counter() - t_start
            return Message(content, reply_to=msg)

        handler.__name__ = fn.__name__
        return handler

    def _executor(
        self, context: Context, microbatches: int | None = None
    ) -> tuple[StageExecutor, ConfigRecord]:
        """The stage from ``context.state``. ``microbatches``: how many micro-batches the
        inputs it is given hold (default: the step's ``M``); the loss is always divided
        by ``M``."""
        cfg = context.state.config_records[STAGE]
        weights = context.state.array_records[WEIGHTS].to_torch_state_dict()
        module = build_stage(self.model_fn, int(cfg["first"]), int(cfg["last"]), weights)
        make_opt = default_optimizer_factory(str(cfg["optimizer"]), float(cfg["lr"]))
        opt = make_opt([p for p in module.parameters() if p.requires_grad])
        if OPTIM in context.state.array_records:
            optimizer_from_tensors(opt, context.state.array_records[OPTIM].to_torch_state_dict())
        M = int(cfg["microbatches"])
        return StageExecutor(module, opt, microbatches or M, loss_divisor=M), cfg

    @staticmethod
    def _save(context: Context, ex: StageExecutor) -> None:
        context.state[WEIGHTS] = ArrayRecord(
            {k: v.detach() for k, v in ex.module.state_dict().items()}
        )
        context.state[OPTIM] = ArrayRecord(optimizer_to_tensors(ex.optimizer))

    def _batch(self, context: Context, cfg: ConfigRecord, step: int) -> tuple[Any, Any]:
        data = self.load_data(context)
        if data is None:
            raise RuntimeError("stage 0 was placed on a node that holds no data")
        bs = int(cfg["batch_size"])
        per_epoch = len(data) // bs
        epoch = int(cfg["round"]) * 1000 + step // max(per_epoch, 1)
        idx = batch_indices(len(data), bs, epoch, int(cfg["seed"]))[step % per_epoch]
        return torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])

    # --- handlers --------------------------------------------------------------------
    def profile(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Benchmark this node on the model's own layers."""
        cfg = msg.content.config_records["config"]
        shape = [int(s) for s in cfg["input_shape"]]
        fwd, bwd = time_layers(
            self.model_fn(),
            shape,
            int(cfg["microbatch_size"]),
            warmup=int(cfg["warmup"]),
            repeats=int(cfg["repeats"]),
        )
        factor = 1.0 + emu.slowdown
        step_s: list[float] = [0.0] * len(fwd)
        rebuild_rate = save_rate = 0.0
        if "optimizer" in cfg:  # optimizer step per layer; the stage's state round trip
            make_opt = default_optimizer_factory(str(cfg["optimizer"]), float(cfg["lr"]))
            step_s = time_optimizer_steps(self.model_fn(), make_opt)
            rebuild_rate, save_rate = time_state_roundtrip(self.model_fn, make_opt)
        data = self.load_data(context)  # a data owner is a node whose loader has data
        holds_data = data is not None and len(data) > 0
        return RecordDict(
            {
                "profile": ConfigRecord(
                    {
                        "name": emu.name,
                        "holds_data": holds_data,
                        "num_examples": len(data) if holds_data else 0,
                        "memory_bytes": emu.memory_bytes(),
                        "slowdown": float(emu.slowdown),
                        "emulation": emu.describe(),
                        "link_latency_s": emu.latency_ms / 1000.0,
                        "link_bandwidth_bps": (emu.bandwidth_mb_s or 0.0) * 1e6,
                        "layer_fwd_s": [t * factor for t in fwd],
                        "layer_bwd_s": [t * factor for t in bwd],
                        "layer_step_s": [t * factor for t in step_s],
                        "state_rebuild_s_per_byte": rebuild_rate,
                        "state_save_s_per_byte": save_rate,
                    }
                )
            }
        )

    def echo(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Return the payload unchanged.

        ``config["store_bytes"] > 0`` first stores a probe array of that size in
        ``context.state`` (so later messages show what state costs); ``< 0`` removes it.
        """
        store = 0
        if "config" in msg.content.config_records:
            store = int(msg.content.config_records["config"].get("store_bytes", 0))
        if store > 0:
            context.state[PROBE] = ArrayRecord({"p": torch.zeros(store, dtype=torch.uint8)})
        elif store < 0 and PROBE in context.state:
            del context.state[PROBE]
        return RecordDict({"payload": msg.content.array_records["payload"]})

    def setup(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Install this round's stage (layer range, weights, fresh optimizer)."""
        cfg = msg.content.config_records["config"]
        context.state[STAGE] = cfg
        context.state[WEIGHTS] = msg.content.array_records["weights"]
        for key in list(context.state.keys()):
            if key in (OPTIM, STASH, GRADS, ACCUM) or key.startswith(STASH_MB):
                del context.state[key]
        return RecordDict({"metrics": MetricRecord({"ready": 1})})

    def forward(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Forward pass of one step (and loss + backward on the last stage)."""
        ex, cfg = self._executor(context)
        first, last = bool(cfg["is_first"]), bool(cfg["is_last"])
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        if first:
            x, labels = self._batch(context, cfg, int(msg.content.config_records["step"]["step"]))
            context.state[STASH] = ArrayRecord({"x": x})
        else:
            x = msg.content.array_records["act"].to_torch_state_dict()["act"]
            labels = None
        if last:
            if labels is None:
                labels = msg.content.array_records["labels"].to_torch_state_dict()["labels"]
            grad, loss, correct = ex.forward_backward_loss(x, labels, input_grad=not first)
            compute = time.perf_counter() - t0
            self._save(context, ex)
            if grad is not None:
                out["grad"] = ArrayRecord({"grad": grad})
            out["metrics"] = MetricRecord(
                {"loss": loss, "correct": correct, "n": int(labels.shape[0]), "compute_s": compute}
            )
        else:
            y = ex.forward(x)
            compute = time.perf_counter() - t0
            if not first:
                context.state[STASH] = ArrayRecord({"x": x})
            out["act"] = ArrayRecord({"act": y})
            if first:
                out["labels"] = ArrayRecord({"labels": labels})
            out["metrics"] = MetricRecord({"compute_s": compute})
        emu.after_compute(compute)
        return RecordDict(out)

    def backward(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Backward pass of one step from the stashed input; steps the optimizer."""
        ex, cfg = self._executor(context)
        x = context.state.array_records[STASH].to_torch_state_dict()["x"]
        g = msg.content.array_records["grad"].to_torch_state_dict()["grad"]
        first = bool(cfg["is_first"])
        t0 = time.perf_counter()
        grad = ex.backward(x, g, input_grad=not first)
        compute = time.perf_counter() - t0
        self._save(context, ex)
        emu.after_compute(compute)
        out: dict[str, Any] = {"metrics": MetricRecord({"compute_s": compute})}
        if grad is not None:
            out["grad"] = ArrayRecord({"grad": grad})
        return RecordDict(out)

    # --- pipelined relay (schedule.kind=gpipe | 1f1b) ----------------------------------
    @staticmethod
    def _group(msg: Message, cfg: ConfigRecord) -> tuple[int, int, int]:
        """``(step, first micro-batch, count)`` of a pipelined message, checked."""
        mb = msg.content.config_records["mb"]
        step, first, count = int(mb["step"]), int(mb["first"]), int(mb["count"])
        M = int(cfg["microbatches"])
        if count < 1 or first < 0 or first + count > M:
            raise ValueError(
                f"micro-batches {first}..{first + count - 1} are outside the step's {M}"
            )
        return step, first, count

    @staticmethod
    def _accumulated(context: Context, cfg: ConfigRecord, step: int, count: int) -> int:
        """Micro-batches of ``step`` back-propagated on this stage, these ``count``
        included.

        Raises
        ------
        RuntimeError
            If another step's micro-batches are still accumulating.
        """
        done = 0
        if ACCUM in context.state:
            acc = context.state.config_records[ACCUM]
            if int(acc["step"]) != step:
                raise RuntimeError(
                    f"step {step} arrived while step {int(acc['step'])} still has "
                    f"{int(cfg['microbatches']) - int(acc['done'])} micro-batches to back-propagate"
                )
            done = int(acc["done"])
        return done + count

    def _keep(self, context: Context, ex: StageExecutor, step: int, done: int, M: int) -> None:
        """Save the stepped stage (``done == M``), else the gradients accumulated so far."""
        if done >= M:
            self._save(context, ex)
            for key in (GRADS, ACCUM):
                if key in context.state:
                    del context.state[key]
        else:
            context.state[GRADS] = ArrayRecord({k: v.detach() for k, v in ex.grads().items()})
            context.state[ACCUM] = ConfigRecord({"step": step, "done": done})

    def _pipe_executor(self, context: Context, count: int) -> tuple[StageExecutor, ConfigRecord]:
        ex, cfg = self._executor(context, microbatches=count)
        if GRADS in context.state:
            ex.load_grads(context.state.array_records[GRADS].to_torch_state_dict())
        return ex, cfg

    def pipe_forward(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Forward of one group of micro-batches (the last stage: loss and backward too,
        gradients accumulated; the optimizer steps after the step's last micro-batch)."""
        cfg = context.state.config_records[STAGE]
        step, first_mb, count = self._group(msg, cfg)
        ex, cfg = self._pipe_executor(context, count)
        is_first, is_last = bool(cfg["is_first"]), bool(cfg["is_last"])
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        if is_first:
            x, labels = self._batch(context, cfg, step)
            rows = int(cfg["batch_size"]) // int(cfg["microbatches"])
            x = x[first_mb * rows : (first_mb + count) * rows]
            labels = labels[first_mb * rows : (first_mb + count) * rows]
        else:
            x = msg.content.array_records["act"].to_torch_state_dict()["act"]
            labels = None
        if is_last:
            if labels is None:
                labels = msg.content.array_records["labels"].to_torch_state_dict()["labels"]
            done = self._accumulated(context, cfg, step, count)
            M = int(cfg["microbatches"])
            grad, loss, correct = ex.forward_backward_loss(
                x, labels, input_grad=not is_first, step=done >= M
            )
            compute = time.perf_counter() - t0
            self._keep(context, ex, step, done, M)
            if grad is not None:
                out["grad"] = ArrayRecord({"grad": grad})
            out["metrics"] = MetricRecord(
                {"loss": loss, "correct": correct, "n": int(labels.shape[0]), "compute_s": compute}
            )
        else:
            y = ex.forward(x)
            compute = time.perf_counter() - t0
            context.state[f"{STASH_MB}{first_mb}"] = ArrayRecord({"x": x})
            out["act"] = ArrayRecord({"act": y})
            if is_first:
                out["labels"] = ArrayRecord({"labels": labels})
            out["metrics"] = MetricRecord({"compute_s": compute})
        emu.after_compute(compute)
        return RecordDict(out)

    def pipe_backward(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Backward of one group from its stashed input; gradients accumulate, the
        optimizer steps after the step's last micro-batch."""
        cfg = context.state.config_records[STAGE]
        step, first_mb, count = self._group(msg, cfg)
        key = f"{STASH_MB}{first_mb}"
        if key not in context.state:
            raise RuntimeError(f"no stashed input for micro-batch {first_mb}: forward first")
        ex, cfg = self._pipe_executor(context, count)
        x = context.state.array_records[key].to_torch_state_dict()["x"]
        g = msg.content.array_records["grad"].to_torch_state_dict()["grad"]
        is_first = bool(cfg["is_first"])
        done = self._accumulated(context, cfg, step, count)
        M = int(cfg["microbatches"])
        t0 = time.perf_counter()
        grad = ex.backward(x, g, input_grad=not is_first, step=done >= M)
        compute = time.perf_counter() - t0
        del context.state[key]
        self._keep(context, ex, step, done, M)
        emu.after_compute(compute)
        out: dict[str, Any] = {"metrics": MetricRecord({"compute_s": compute})}
        if grad is not None:
            out["grad"] = ArrayRecord({"grad": grad})
        return RecordDict(out)

    def collect(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Return the stage's weights (end of round)."""
        return RecordDict({"weights": context.state.array_records[WEIGHTS]})

    def direct(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """Run this node's stage for one whole round on the ``direct`` transport.

        The message carries the stage's layer slice, its settings, its rank and the
        round's rendezvous (:class:`sky_flower.pipeline.direct.Rendezvous`). The node joins the
        round's process group, runs the ``torch.distributed.pipelining`` schedule for
        ``steps`` steps with a fresh optimizer, leaves the group and returns its
        weights and timings. Emulation: the fleet's slowdown after each forward and
        backward of the stage module; link delay per peer message, slept by the sender
        (see :class:`sky_flower.pipeline.direct.Emulated`).

        Raises
        ------
        RankRefusedError
            If the message was planned for another node, or its rank's ticket does not
            match the store's (before the node joins the group).
        DirectStageError
            If this stage or a peer fails or stalls (bounded by ``timeout_s``).
        """
        from sky_flower.pipeline.direct import (
            Emulated,
            RankRefusedError,
            Rendezvous,
            run_stage,
        )

        cfg = msg.content.config_records["config"]
        if int(cfg["node_id"]) != int(context.node_id):
            raise RankRefusedError(
                f"rank {int(cfg['rank'])} refused: it is planned for node {int(cfg['node_id'])}, "
                f"not for this node ({context.node_id})"
            )
        rdv = Rendezvous(
            host=str(cfg["host"]),
            port=int(cfg["port"]),
            key=str(cfg["key"]),
            rank=int(cfg["rank"]),
            world_size=int(cfg["world_size"]),
            ticket=str(cfg["ticket"]),
            timeout_s=float(cfg["timeout_s"]),
            join_timeout_s=float(cfg.get("join_timeout_s", 60.0)),
        )
        first, last = int(cfg["first"]), int(cfg["last"])
        module = build_stage(
            self.model_fn, first, last, msg.content.array_records["weights"].to_torch_state_dict()
        )
        make_opt = default_optimizer_factory(str(cfg["optimizer"]), float(cfg["lr"]))
        opt = make_opt([p for p in module.parameters() if p.requires_grad])

        def link(lat_a: float, bw_a: float, lat_b: float, bw_b: float) -> Callable[[int], float]:
            bw = min(bw_a, bw_b)  # the slower NIC, as sky_flower.core.cost charges direct hops
            return lambda nbytes: 0.5 * (lat_a + lat_b) + (nbytes / bw if bw > 0 else 0.0)

        lat, bw = float(cfg["link_latency_s"]), float(cfg["link_bandwidth_bps"])
        emulated = Emulated(
            slowdown=float(emu.slowdown),
            send_next_s=link(
                lat, bw, float(cfg["next_latency_s"]), float(cfg["next_bandwidth_bps"])
            ),
            send_prev_s=link(
                lat, bw, float(cfg["prev_latency_s"]), float(cfg["prev_bandwidth_bps"])
            ),
        )
        rnd = int(cfg["round"])
        fault = None
        if emu.fails_in(msg.metadata.message_type, rnd) and emu.fail_mode in ("crash", "stall"):
            fault = _mid_round_fault(emu, rdv.timeout_s)
        res = run_stage(
            rdv,
            module,
            opt,
            kind=str(cfg["kind"]),
            microbatches=int(cfg["microbatches"]),
            steps=int(cfg["steps"]),
            batch_size=int(cfg["batch_size"]),
            input_shape=[int(d) for d in cfg["input_shape"]],
            batch_fn=(lambda step: self._batch(context, cfg, step)) if rdv.rank == 0 else None,
            emulated=emulated,
            fault=fault,
        )
        return RecordDict(
            {
                "weights": ArrayRecord({k: v.detach() for k, v in module.state_dict().items()}),
                "metrics": MetricRecord(
                    {
                        "losses": [float(v) for v in res.losses],
                        "correct": int(res.correct),
                        "n": int(res.samples),
                        "step_times_s": [float(t) for t in res.step_times_s],
                        "setup_s": float(res.setup_s),
                        "compute_s": float(res.compute_s),
                    }
                ),
            }
        )


def _mid_round_fault(emu: Emulation, timeout_s: float) -> Callable[[int], None]:
    """The ``crash`` / ``stall`` fault of a node's fleet entry, as a per-step hook."""
    from sky_flower.emulation.devices import FaultInjected

    def fault(step: int) -> None:
        if step != emu.fail_step:
            return
        if emu.fail_mode == "crash":
            import torch.distributed as dist

            dist.destroy_process_group()  # drop out at once: the peers' sockets close
            raise FaultInjected(f"node {emu.name!r}: crashed before step {step} (fault injected)")
        time.sleep(1.5 * timeout_s)
        raise FaultInjected(
            f"node {emu.name!r}: stalled {1.5 * timeout_s:g} s before step {step} (fault injected)"
        )

    return fault


def time_state_roundtrip(
    model_fn: Callable[[], nn.Module],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    repeats: int = 3,
) -> tuple[float, float]:
    """What a stage message spends on its own state, per byte of weights + optimizer
    state: ``(rebuild, save)`` seconds per byte. Every stage message rebuilds its stage
    from the ``context.state`` records (weights, optimizer tensors); messages that
    step the optimizer save them back as records (:class:`SkyClient`). Timed on the
    whole model, median of ``repeats``."""
    import statistics

    layers = as_layers(model_fn())
    stage = build_stage(model_fn, 0, len(layers) - 1)
    opt = optimizer_factory([p for p in stage.parameters() if p.requires_grad])
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # populate the optimizer state
    weights = ArrayRecord({k: v.detach() for k, v in stage.state_dict().items()})
    state = ArrayRecord(optimizer_to_tensors(opt))
    nbytes = max(weights.count_bytes() + state.count_bytes(), 1)
    rebuild, save = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        module = build_stage(model_fn, 0, len(layers) - 1, weights.to_torch_state_dict())
        opt2 = optimizer_factory([p for p in module.parameters() if p.requires_grad])
        optimizer_from_tensors(opt2, state.to_torch_state_dict())
        t1 = time.perf_counter()
        weights = ArrayRecord({k: v.detach() for k, v in module.state_dict().items()})
        state = ArrayRecord(optimizer_to_tensors(opt2))
        save.append(time.perf_counter() - t1)
        rebuild.append(t1 - t0)
    return statistics.median(rebuild) / nbytes, statistics.median(save) / nbytes


# --- defaults for the simulation engine ------------------------------------------------
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
    fleet: list[Emulation], dataset: str = "digits", test_fraction: float = 0.2, seed: int = 0
) -> Callable[[Context], Split | None]:
    """Digits partition of this node if it is a data owner (IID across owners)."""
    from sky_flower.pipeline.data import load_split, owner_partition

    owners = [n.name for n in fleet if n.holds_data]
    cache: dict[str, Split] = {}

    def load(context: Context) -> Split | None:
        emu = fleet_emulation(fleet)(context)
        if not emu.holds_data:
            return None
        if emu.name not in cache:
            train, _ = load_split(dataset, test_fraction, seed)
            cache[emu.name] = owner_partition(train, owners.index(emu.name), len(owners), seed)
        return cache[emu.name]

    return load
