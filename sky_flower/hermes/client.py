"""Worker side of Hermes and its baselines (server side: ``strategies/hermes.py``), and
their data layout.

=========================  ============================================================
``query.hermes_hello``     this worker's position (``partition-id``) and pool size
``query.hermes_profile``   time training steps at several batch sizes (the benchmark
                           round: emulated slowdown included); median seconds per size
``train.hermes_round``     one round: if the message carries ``global``, start from it,
                           else from this worker's own model (kept in ``context.state``);
                           one pass over its share of ``data`` samples in batches of
                           ``batch`` (or cycling through ``batch_cycle``; the median
                           seconds per step size come back for the step-time fit);
                           its local validation loss; with ``gate`` on, Hermes'
                           significant-update test decides whether the model goes back
                           (``sent`` 1) or not (``sent`` 0, a *minor* round: no arrays);
                           the emulated link is charged on what crossed it
=========================  ============================================================

Every worker holds a data partition (data-parallel): the digits train split minus a
server validation split is the *pool*, shuffled once (seeded, so the server and every
worker agree without exchanging data); worker ``i`` of ``n`` reads the pool from offset
``i * len(pool) // n`` on, wrapping round, so a share of ``len(pool) // n`` is exactly its
equal partition and Hermes' larger or smaller shares grow or shrink it from there. Each
worker also has a fixed local validation set (for the gate) held out of the pool.

Emulated devices: a step's compute (a small MLP: well under a millisecond) is padded by a
sleep to a nominal native step time ``overhead_s + per_sample_s * batch``, then the fleet's
slowdown sleeps ``slowdown x`` that (:meth:`sky_flower.emulation.devices.Emulation.after_compute`),
so wall time follows the emulated fleet without burning the host's CPUs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from sky_flower.emulation.devices import Emulation
from sky_flower.flower.vectors import node_position, vector_of, vector_record
from sky_flower.gossip.training import FlatModel
from sky_flower.hermes.core import SignificanceGate
from sky_flower.hermes.protocol import HELLO, PROFILE, ROUND
from sky_flower.pipeline.data import Split

MODEL_KEY, GATE_KEY = "hermes_model", "hermes_gate"


@dataclass(frozen=True)
class HermesData:
    """The data layout: the server's validation split, the workers' pool, and each
    worker's local validation split (all disjoint)."""

    server_val: Split
    pool: Split
    worker_val: list[Split]

    def share(self, worker: int, num_workers: int, size: int) -> np.ndarray:
        """Pool indices of ``worker``'s share of ``size`` samples (wrapping round)."""
        start = worker * len(self.pool) // num_workers
        return (start + np.arange(int(size))) % len(self.pool)


def hermes_data(
    train: Split,
    num_workers: int,
    seed: int = 0,
    server_val_fraction: float = 0.1,
    worker_val_size: int = 32,
) -> HermesData:
    """Split ``train`` into the server's validation split (``server_val_fraction``), one
    local validation split of ``worker_val_size`` per worker, and the pool (the rest).

    Raises
    ------
    ValueError
        If the pool would hold fewer samples than workers.
    """
    if not 0 < server_val_fraction < 1:
        raise ValueError(f"server_val_fraction must be in (0, 1), got {server_val_fraction}")
    order = np.random.default_rng([seed, 6]).permutation(len(train))
    n_server = max(1, int(round(server_val_fraction * len(train))))
    n_val = num_workers * int(worker_val_size)
    pool = order[n_server + n_val :]
    if len(pool) < num_workers:
        raise ValueError(
            f"{len(train)} training samples leave a pool of {len(pool)} for {num_workers} "
            "workers: lower hermes.worker_val_size or the number of workers"
        )

    def take(idx: np.ndarray) -> Split:
        return Split(train.x[idx], train.y[idx])

    vals = order[n_server : n_server + n_val].reshape(num_workers, -1) if n_val else None
    return HermesData(
        server_val=take(order[:n_server]),
        pool=take(pool),
        worker_val=[
            take(vals[i]) if vals is not None else take(pool[:0]) for i in range(num_workers)
        ],
    )


@dataclass(frozen=True)
class NominalDevice:
    """A native-speed device's step time, ``overhead_s + per_sample_s * batch``, that a
    step's real compute is padded up to before the fleet's slowdown applies."""

    overhead_s: float = 0.005
    per_sample_s: float = 0.001

    def step_s(self, batch: int) -> float:
        """Nominal seconds of a step of ``batch`` samples."""
        return self.overhead_s + self.per_sample_s * batch


class HermesClient:
    """Worker side of Hermes, BSP, ASP and SSP.

    Parameters
    ----------
    model : FlatModel
        The model as a flat parameter vector (the same on every worker and the server).
    load_data : Callable[[], HermesData]
        The data layout (called on every message: cache it).
    num_workers : int
        Workers in the fleet (positions ``0 .. num_workers - 1``).
    emulation_fn : Callable[[Context], Emulation]
        This worker's emulated device (slowdown, link).
    device : NominalDevice
        Native step time a step's compute is padded to (see the module docstring).
    """

    def __init__(
        self,
        model: FlatModel,
        load_data: Callable[[], HermesData],
        num_workers: int,
        emulation_fn: Callable[[Context], Emulation],
        device: NominalDevice | None = None,
    ) -> None:
        self.model, self.load_data = model, load_data
        self.num_workers = int(num_workers)
        self.emulation_fn = emulation_fn
        self.device = device or NominalDevice()

    def register(self, app: ClientApp) -> ClientApp:
        """Add the handlers to ``app`` and return it."""
        app.query(HELLO.removeprefix("query."))(self.hello)
        app.query(PROFILE.removeprefix("query."))(self.profile)
        app.train(ROUND.removeprefix("train."))(self.round)
        return app

    # --- one emulated step -------------------------------------------------------------
    def _step(
        self, vec: np.ndarray, x: np.ndarray, y: np.ndarray, lr: float, emu: Emulation
    ) -> tuple[np.ndarray, float, float]:
        """One SGD step; returns the new vector, the batch loss and the step's seconds."""
        t0 = time.perf_counter()
        loss, grad = self.model.loss_and_grad(vec, x, y)
        vec = vec - lr * grad
        elapsed = time.perf_counter() - t0
        nominal = self.device.step_s(len(y))
        if nominal > elapsed:
            time.sleep(nominal - elapsed)
            elapsed = nominal
        emu.after_compute(elapsed)
        return vec, loss, time.perf_counter() - t0

    def _position(self, context: Context) -> int:
        pos = node_position(context)
        if not 0 <= pos < self.num_workers:
            raise ValueError(f"worker position {pos} not in [0, {self.num_workers})")
        return pos

    # --- handlers ----------------------------------------------------------------------
    def hello(self, msg: Message, context: Context) -> Message:
        """Position, pool size and emulated slowdown. When the message asks (the server's
        readiness barrier), first warm up (one gradient and one evaluation: the first
        ``torch.func`` call in a fresh process costs seconds) and hold for ``hold_s``."""
        emu = self.emulation_fn(context)
        cfg = msg.content.config_records.get("cfg")
        if cfg is not None and float(cfg["hold_s"]) > 0:  # type: ignore[arg-type]
            torch.set_num_threads(1)
            pool = self.load_data().pool
            vec = np.zeros(self.model.dim)
            self.model.loss_and_grad(vec, pool.x[:8], pool.y[:8])
            self.model.evaluate(vec, pool)
            time.sleep(float(cfg["hold_s"]))  # type: ignore[arg-type]
        metrics = MetricRecord(
            {
                "position": self._position(context),
                "pool": len(self.load_data().pool),
                "slowdown": float(emu.slowdown),
            }
        )
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    def profile(self, msg: Message, context: Context) -> Message:
        """Median seconds of a training step at each of ``batches`` (``repeats`` steps each
        after one warm-up), on this worker's data, emulation included."""
        torch.set_num_threads(1)
        cfg = msg.content.config_records["cfg"]
        batches, repeats = [int(b) for b in cfg["batches"]], int(cfg["repeats"])  # type: ignore[union-attr]
        data, emu = self.load_data(), self.emulation_fn(context)
        vec = self.model.initial(0)
        rng = np.random.default_rng(self._position(context))
        seconds = []
        for b in batches:
            times = []
            for k in range(repeats + 1):
                idx = rng.choice(len(data.pool), min(b, len(data.pool)), replace=False)
                _, _, t = self._step(vec, data.pool.x[idx], data.pool.y[idx], 0.0, emu)
                if k:
                    times.append(t)
            seconds.append(float(np.median(times)))
        metrics = MetricRecord({"batches": batches, "seconds": seconds})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    def round(self, msg: Message, context: Context) -> Message:
        """One training round (see the module docstring)."""
        torch.set_num_threads(1)
        t_start = time.perf_counter()
        cfg = msg.content.config_records["cfg"]
        pos, data, emu = self._position(context), self.load_data(), self.emulation_fn(context)
        if "global" in msg.content.array_records:
            vec = vector_of(msg.content, "global")
        elif MODEL_KEY in context.state.array_records:
            vec = vector_of(context.state, MODEL_KEY)
        else:
            raise ValueError("first round without a global model: the server must send one")
        if vec.shape != (self.model.dim,):
            raise ValueError(f"model vector has shape {vec.shape}, expected ({self.model.dim},)")
        size, batch = int(cfg["data"]), int(cfg["batch"])
        lr, rnd, seed = float(cfg["lr"]), int(cfg["round"]), int(cfg["seed"])
        share = data.share(pos, self.num_workers, size)
        order = share[np.random.default_rng([seed, pos, rnd]).permutation(len(share))]
        cycle = [int(b) for b in cfg["batch_cycle"]] if "batch_cycle" in cfg else [batch]  # type: ignore[union-attr]
        losses, steps_s, steps_b = [], [], []
        start = 0
        while start < len(order):
            idx = order[start : start + cycle[len(steps_s) % len(cycle)]]
            vec, loss, t = self._step(vec, data.pool.x[idx], data.pool.y[idx], lr, emu)
            losses.append(loss)
            steps_s.append(t)
            steps_b.append(len(idx))
            start += len(idx)
        train_s = time.perf_counter() - t_start
        step_batches, step_seconds = step_medians(steps_b, steps_s)
        val = data.worker_val[pos] if len(data.worker_val[pos]) else data.pool
        val_loss = self.model.evaluate(vec, val)["loss"]
        context.state[MODEL_KEY] = vector_record("x", vec)
        send, z, threshold = True, 0.0, 0.0
        if bool(cfg["gate"]) and math.isfinite(val_loss):  # non-finite: sent, refused by name
            state = context.state.config_records.get(GATE_KEY)
            gate = (
                SignificanceGate.from_dict(json.loads(str(state["gate"])))
                if state is not None
                else SignificanceGate(
                    window=int(cfg["window"]),
                    threshold=float(cfg["threshold"]),
                    patience=int(cfg["patience"]),
                    relax=float(cfg["relax"]),
                )
            )
            decision = gate.observe(val_loss)
            context.state[GATE_KEY] = ConfigRecord({"gate": json.dumps(gate.to_dict())})
            send, z, threshold = decision.send, decision.z, decision.threshold
        metrics = MetricRecord(
            {
                "position": pos,
                "sent": int(send),
                "train_time_s": train_s,
                "step_time_s": float(np.mean(steps_s)),
                "step_batches": step_batches,
                "step_seconds": step_seconds,
                "steps": len(steps_s),
                "data": size,
                "batch": batch,
                "train_loss": float(np.mean(losses)),
                "val_loss": float(val_loss),
                "z": float(np.clip(z, -1e9, 1e9)),
                "threshold": float(threshold),
            }
        )
        content = RecordDict({"metrics": metrics})
        if send:
            content["model"] = vector_record("x", vec)
        # the emulated link: latency once, plus the global model received and the update
        # sent at its bandwidth (a minor round after a minor round pays only the latency)
        link_bytes = _bytes(msg.content) + _bytes(content)
        delay = emu.link_delay_s(link_bytes)
        metrics["link_bytes"], metrics["link_s"] = link_bytes, float(delay)
        if delay > 0:
            time.sleep(delay)
        return Message(content, reply_to=msg)


def _bytes(content: RecordDict) -> int:
    return sum(rec.count_bytes() for rec in content.array_records.values())


def step_medians(batches: list[int], seconds: list[float]) -> tuple[list[int], list[float]]:
    """Per distinct step size of a round (ascending), the median seconds of its steps:
    the observations the server fits each worker's step-time model from
    (:meth:`sky_flower.hermes.server.HermesSizing.observe`)."""
    sizes = sorted(set(batches))
    b, t = np.asarray(batches), np.asarray(seconds)
    return sizes, [float(np.median(t[b == s])) for s in sizes]


def hermes_data_fn(
    num_workers: int, test_fraction: float = 0.2, seed: int = 0, worker_val_size: int = 32
) -> Callable[[], HermesData]:
    """A cached loader of :func:`hermes_data` on the digits train split."""
    from sky_flower.pipeline.data import load_split

    cache: list[HermesData] = []

    def load() -> HermesData:
        if not cache:
            train, _ = load_split("digits", test_fraction, seed)
            cache.append(hermes_data(train, num_workers, seed, worker_val_size=worker_val_size))
        return cache[0]

    return load
