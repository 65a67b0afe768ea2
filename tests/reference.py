"""What split training must compute, computed without Flower, and in-process Grids that
run Sky's ClientApp with the deployment engine's message semantics.

- :func:`reference_rounds`: the one unsplit reference training loop of the test suite
  (every equivalence test compares against it).
- :class:`ProcessPerMessageGrid`: every message handled synchronously, in this process,
  by a fresh ClientApp whose node context was carried over only as protobuf bytes (what
  a SuperNode of Flower's deployment engine does). Enough for the relay transport.
- :class:`ConcurrentGrid`: the same semantics, but ``push_messages`` returns at once and
  each node handles its messages on its own thread; on the direct and stream transports
  each message in a fresh process (their stages run at the same time, and each joins a
  ``torch.distributed`` process group, one per process, or holds a stream link), on the
  relay in this process.
- :func:`run_sky_app`: ``examples/sky-app`` trained by Sky's strategy on such a Grid.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args
from flwr.common.constant import ErrorCode
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
)
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.serverapp import Grid

from sky_flower.flower.inprocess import InProcessGrid
from sky_flower.pipeline.data import batch_indices
from sky_flower.pipeline.stage import RngKey, forward_layers
from sky_flower.sky.protocol import starts_session
from sky_flower.sky.settings import auto_transport

SKY_APP = Path(__file__).resolve().parents[1] / "examples" / "sky-app"
# what the in-process grids change in the app's run config: they answer at once, so
# there is no SuperNode polling tick to de-phase the benchmark's echoes from (the app's
# echo-jitter-s, 0.1 s, would be pure waiting), and a threaded grid's replies are polled
# every 2 ms instead of the app's 50 ms (each poll there is a SuperLink call)
IN_PROCESS_RUN = {"echo-jitter-s": 0.0, "poll-interval-s": 0.002}


def sky_app_run_config() -> dict[str, Any]:
    """``examples/sky-app``'s run config (``app_run_config``) with ``IN_PROCESS_RUN``:
    the base of a test's run config on an in-process grid."""
    from sky_flower.deploy import app_run_config

    return {**app_run_config(SKY_APP), **IN_PROCESS_RUN}


# imported once by the forkserver, not by every child (imports are not state: each child
# still builds its ClientApp, model and data afresh)
PRELOAD = [
    "reference",
    "sky_flower.app",
    "sky_flower.sky.node.client",
    "sky_flower.pipeline.direct",
    "torch.distributed.pipelining",
    "torch._dynamo",  # what an optimizer's first add_param_group imports: ~2 s a child
    "sklearn.datasets",
    "sklearn.model_selection",
    "sky_app.task",
]

OPTIMIZERS: dict[str, Callable[[Iterable[torch.nn.Parameter], float], torch.optim.Optimizer]] = {
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "sgd_momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
}


def sky_app_task():  # noqa: ANN201 - the example app's task module
    """``examples/sky-app``'s ``sky_app.task`` (Net, load_data, load_test, test)."""
    if str(SKY_APP) not in sys.path:
        sys.path.insert(0, str(SKY_APP))
    from sky_app import task

    return task


def sky_app_client() -> ClientApp:
    """A fresh ClientApp with Sky's handlers for the sky-app's model and data (a
    module-level function: :class:`ConcurrentGrid` builds it in a child process)."""
    from sky_flower.app import register_sky_client

    task = sky_app_task()
    return register_sky_client(ClientApp(), model_fn=task.Net, load_data=task.load_data)


def forkserver():  # noqa: ANN201 - a multiprocessing context
    """The ``forkserver`` multiprocessing context, whose server imports :data:`PRELOAD`
    once (a child then starts in well under a second instead of importing torch and
    Flower again, as a ``spawn`` child does). Child targets must be picklable."""
    sky_app_task()  # on sys.path before the forkserver starts, so it can preload the app
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_direct_stages(
    target: Callable[..., None], args: Sequence[tuple], timeout_s: float = 120.0
) -> dict[str, torch.Tensor]:
    """One ``direct`` round of ``len(args)`` stages, each in a forkserver process:
    ``target(rendezvous, *args[k], queue)`` puts ``(rank, state dict of numpy arrays)``
    (or ``(rank, error text)``) on the queue. Returns the stages' merged state dict;
    fails naming every stage's error."""
    from sky_flower.pipeline.direct import RoundHost

    ctx = forkserver()
    queue = ctx.Queue()
    with RoundHost(len(args), timeout_s=timeout_s / 2) as host:
        procs = [
            ctx.Process(target=target, args=(host.rendezvous(k), *a, queue))
            for k, a in enumerate(args)
        ]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=timeout_s) for _ in procs)
        for p in procs:
            p.join(timeout=10)
    errors = {k: v for k, v in got.items() if isinstance(v, str)}
    assert not errors, errors
    return {k: torch.from_numpy(v) for st in got.values() for k, v in st.items()}


def make_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    """The optimizer ``name`` (``adam``, ``sgd``, ``sgd_momentum`` with momentum 0.9).

    Raises
    ------
    KeyError
        On another name.
    """
    return OPTIMIZERS[name](params, lr)


def _step_batch(data: Any, step: int, rnd: int, batch_size: int, seed: int):  # noqa: ANN202, ANN401
    """Batch of step ``step`` of round ``rnd``: ``data[step % len(data)]`` when ``data``
    is a sequence of ``(x, y)`` tensor pairs; else Sky's data owner's batch
    (``batch_indices``, epoch ``rnd * 1000 + step // per_epoch``) of a Split."""
    if isinstance(data, Sequence):
        return data[step % len(data)]
    per_epoch = len(data) // batch_size
    epoch = rnd * 1000 + step // per_epoch
    idx = batch_indices(len(data), batch_size, epoch, seed)[step % per_epoch]
    if hasattr(data, "batch"):  # a DataLoader's / datasets.Dataset's rows
        return data.batch(idx)
    return torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])  # a Split's arrays


def reference_rounds(  # noqa: PLR0913
    model_fn: Callable[[], torch.nn.Module],
    data: Any,  # noqa: ANN401 - a Split (x, y numpy arrays) or a list of (x, y) tensors
    rounds: int,
    steps: int,
    lr: float,
    batch_size: int = 64,
    microbatches: int = 1,
    seed: int = 0,
    *,
    optimizer: str = "adam",
    weights: dict[str, torch.Tensor] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    keep_optimizer: bool = False,
) -> list[tuple[dict[str, torch.Tensor], list[float]]]:
    """Unsplit training as Sky defines it: each round a fresh optimizer; each step one
    batch (see below), the user's loss called ONCE on the whole batch's output and
    labels, one backward, one optimizer step. Nothing here knows how the loss reduces
    (mean, sum, token-weighted): split training must equal this for any loss.

    The model's forward runs per micro-batch (``microbatches`` equal ones, in order,
    outputs concatenated), because that is what the model computes under Sky: each
    layer's randomness (dropout) is keyed by ``(seed, round, step, micro-batch,
    layer)`` (:func:`sky_flower.pipeline.stage.forward_layers`), as split stages key
    it, and buffers (BatchNorm) update once per micro-batch, in order. For a model
    without such state this is the whole batch's forward.

    Parameters
    ----------
    model_fn : callable
        ``() -> nn.Module``, the whole model.
    data : Split or sequence of (Tensor, Tensor)
        A Split (``x`` ``(n, ...)`` float32, ``y`` ``(n,)`` int64, numpy): step ``s`` of
        round ``r`` takes batch ``s % per_epoch`` of epoch ``r * 1000 + s // per_epoch``
        (``batch_indices(len(data), batch_size, epoch, seed)``), as Sky's data owner
        does. A sequence of ``(x (B, ...), y (B,))`` tensors: step ``s`` takes
        ``data[s % len(data)]`` (``batch_size`` unused; ``seed`` keys the randomness only).
    rounds, steps : int
        Rounds, and optimizer steps per round.
    lr : float
        Learning rate.
    batch_size, microbatches, seed : int
        Samples per step, micro-batches per step (must divide the batch), batch order seed.
    optimizer : {"adam", "sgd", "sgd_momentum"}
        The optimizer (:data:`OPTIMIZERS`).
    weights : dict of str to Tensor, optional
        Initial state dict (default: ``model_fn()``'s own).
    loss_fn : callable, optional
        ``(output, labels) -> scalar``, the user's loss, called on the whole batch
        (default cross-entropy).
    keep_optimizer : bool
        One optimizer for the whole run instead of a fresh one each round (Sky's
        ``train.optimizer_state=keep``).

    Returns
    -------
    list of (dict of str to Tensor, list of float)
        Per round, the weights after it and its per-step losses (the loss of each
        step's whole batch).

    Raises
    ------
    ValueError
        If ``microbatches`` does not divide a batch.
    """
    torch.set_num_threads(1)
    model = model_fn()
    if weights is not None:
        model.load_state_dict(weights)
    out = []
    opt = make_optimizer(optimizer, model.parameters(), lr)
    for rnd in range(1, rounds + 1):
        if not keep_optimizer:
            opt = make_optimizer(optimizer, model.parameters(), lr)
        losses = []
        for step in range(steps):
            x, y = _step_batch(data, step, rnd, batch_size, seed)
            opt.zero_grad()
            if x.shape[0] % microbatches:
                raise ValueError(f"{microbatches} micro-batches do not divide {x.shape[0]}")
            outputs = [  # randomness keyed as split stages key it, buffers per micro-batch
                forward_layers(model, xm, RngKey(seed, rnd, step), m)
                for m, xm in enumerate(x.chunk(microbatches))
            ]
            loss = (loss_fn or torch.nn.functional.cross_entropy)(torch.cat(outputs), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out.append(({k: v.detach().clone() for k, v in model.state_dict().items()}, losses))
    return out


def assert_pipelined_relay_row(row: dict[str, Any], per_message: int, microbatches: int) -> None:
    """A pipelined relay round's row: ``per_message`` micro-batches per message, every
    stage handled the planned number of messages (forward and backward groups; the last
    stage one per group) and reported its measured and predicted compute.

    Raises
    ------
    AssertionError
        If one of these does not hold.
    """
    assert row["microbatches_per_message"] == per_message
    groups = microbatches // per_message
    stages = len(row["stages"])
    assert [st["messages"] for st in row["stages"]] == [2 * groups] * (stages - 1) + [groups]
    assert all(st["predicted_messages"] == st["messages"] for st in row["stages"])
    assert all(
        st["measured_compute_s"] > 0 and st["predicted_compute_s"] > 0 for st in row["stages"]
    )


def error_reply(msg: Message, err: Exception) -> Message:
    """The error reply Flower's engines send when a ClientApp handler raises ``err``
    (code ``CLIENT_APP_RAISED_EXCEPTION``, the engines' reason format)."""
    reason = str(type(err)) + ":<'" + str(err) + "'>"
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


def _wire(msg: Message) -> Message:
    return message_from_proto(message_to_proto(msg))


class ProcessPerMessageGrid(InProcessGrid):
    """A Grid that delivers each message as a SuperNode of Flower's deployment engine
    does: the node's context is restored from the protobuf bytes saved after its last
    message, a ClientApp freshly built by ``app_fn`` (no module-level cache survives)
    handles the message, the updated context is saved back as bytes. Messages and
    replies go through Flower's protobuf too. Runs synchronously in push_messages; a
    raising handler propagates (unlike the base class, which makes it an error reply).

    ``node_configs`` are the SuperNodes' ``--node-config`` dicts (node ids 101, 102, ...)."""

    def __init__(
        self,
        app_fn: Callable[[], ClientApp],
        node_configs: list[dict],
        run_config: dict,
    ) -> None:
        names = [f"node{i}" for i in range(len(node_configs))]
        apps: dict[str, Any] = dict.fromkeys(names)  # built per message by app_fn
        super().__init__(apps, dict(zip(names, node_configs, strict=True)), run_config)
        self.app_fn = app_fn
        self.saved: dict[int, bytes] = {
            nid: context_to_proto(ctx).SerializeToString() for nid, ctx in self.contexts.items()
        }

    def deliver(self, node_id: int, message: Message) -> Message:
        """Restore the node's context from bytes, run a fresh ClientApp, save it back."""
        context = context_from_proto(ProtoContext.FromString(self.saved[node_id]))
        reply = self.app_fn()(_wire(message), context)
        self.saved[node_id] = context_to_proto(context).SerializeToString()
        return _wire(reply)


def _handle(app_fn: Callable[[], ClientApp], msg: bytes, ctx: bytes) -> tuple[bytes, bytes]:
    """One message, one fresh ClientApp, as a SuperNode's ClientApp process handles it:
    ``(reply bytes, context bytes)`` from the message's and the node context's bytes. A
    raising handler gives an error reply (the context is still saved)."""
    message = message_from_proto(ProtoMessage.FromString(msg))
    context = context_from_proto(ProtoContext.FromString(ctx))
    try:
        reply = app_fn()(message, context)
    except Exception as err:  # noqa: BLE001 - every handler error becomes an error reply
        reply = error_reply(message, err)
    saved = context_to_proto(context).SerializeToString()
    return message_to_proto(reply).SerializeToString(), saved


def _handle_in_child(app_fn: Callable[[], ClientApp], msg: bytes, ctx: bytes, conn) -> None:  # noqa: ANN001
    """Child process body of :class:`ConcurrentGrid`: :func:`_handle`, its result sent
    back through ``conn``."""
    conn.send(_handle(app_fn, msg, ctx))
    conn.close()


class ConcurrentGrid(ProcessPerMessageGrid):
    """:class:`ProcessPerMessageGrid`'s semantics with the nodes running at once.

    ``push_messages`` returns at once; each node has one thread that handles its
    messages one at a time, in the order pushed, except a ``stream`` stage session's
    set-up, which runs beside them on a thread of its own (Flower 1.42's SuperExec
    launches a ClientApp process per message, with no capacity gate). With ``processes``
    (default: unless the run config's transport is the relay) each message runs in a
    fresh process (a ``forkserver`` child: ``torch.distributed`` allows one default
    process group per process, so the direct transport's stages cannot share one; a
    stream stage's link must not outlive its ClientApp process) and a child that dies
    without replying gives an error reply naming its exit code; otherwise on the node's
    thread in this process (about 0.3 s a message cheaper). Either way a fresh ClientApp
    handles each message and the node's context travels to and from it as protobuf
    bytes; a raising handler gives an error reply. Replies are collected by
    ``pull_messages``. ``app_fn`` must be picklable (a module-level function such as
    :func:`sky_app_client`).
    """

    def __init__(
        self,
        app_fn: Callable[[], ClientApp],
        node_configs: list[dict],
        run_config: dict,
        processes: bool | None = None,
    ) -> None:
        super().__init__(app_fn, node_configs, run_config)
        if processes is None:  # the relay's stage state lives in the node's context only
            transport = run_config.get("transport", "auto")
            if transport == "auto":
                transport = auto_transport(run_config)
            processes = transport != "relay"
        self.processes = processes
        self._mp = forkserver() if processes else None
        self._lock = threading.Lock()
        self._queues: dict[int, queue.Queue] = {}
        for nid in self.ids:
            self._queues[nid] = queue.Queue()
            threading.Thread(target=self._serve, args=(nid,), daemon=True).start()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            raw = message_to_proto(msg).SerializeToString()
            nid = msg.metadata.dst_node_id
            if starts_session(msg.content):  # beside the node's others, as SuperExec launches it
                threading.Thread(target=self._serve_one, args=(nid, raw), daemon=True).start()
            else:
                self._queues[nid].put(raw)
            ids.append(mid)
        return ids

    def _serve_one(self, nid: int, msg: bytes) -> None:
        reply = (self._run_in_child if self.processes else self._run_here)(nid, msg)
        with self._lock:
            self._record(nid, reply)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        with self._lock:
            return super().pull_messages(message_ids)

    def close(self) -> None:
        """Stop the node threads (after the messages already pushed)."""
        for q in self._queues.values():
            q.put(None)

    def _serve(self, nid: int) -> None:
        while (msg := self._queues[nid].get()) is not None:
            self._serve_one(nid, msg)

    def _record(self, nid: int, reply: Message) -> None:
        """Keep node ``nid``'s reply for ``pull_messages`` (called holding the lock)."""
        self.replies[reply.metadata.reply_to_message_id] = reply
        self.handled.append((nid, reply.metadata.message_type))

    def _run_here(self, nid: int, msg: bytes) -> Message:
        reply, self.saved[nid] = _handle(self.app_fn, msg, self.saved[nid])
        return message_from_proto(ProtoMessage.FromString(reply))

    def _run_in_child(self, nid: int, msg: bytes) -> Message:
        recv, send = self._mp.Pipe(duplex=False)
        child = self._mp.Process(
            target=_handle_in_child, args=(self.app_fn, msg, self.saved[nid], send)
        )
        child.start()
        send.close()
        try:
            reply, self.saved[nid] = recv.recv()
            return message_from_proto(ProtoMessage.FromString(reply))
        except EOFError:  # the child died without replying
            original = message_from_proto(ProtoMessage.FromString(msg))
            child.join()
            reason = f"ClientApp process exited with code {child.exitcode}"
            return Message(Error(code=0, reason=reason), reply_to=original)
        finally:
            child.join()
            recv.close()


def sky_app_on_grid(
    grid_cls: type[ProcessPerMessageGrid],
    run: dict[str, Any],
    node_extra: dict[int, dict[str, Any]] | None = None,
) -> tuple[Any, ProcessPerMessageGrid, dict[str, Any]]:
    """Sky's strategy (``sky_strategy``) for ``examples/sky-app`` and an in-process Grid
    of ``grid_cls`` with one node per node of ``run["fleet"]`` (their ``--node-config``
    as the deployment launcher writes and ``flower-supernode`` parses it, updated with
    ``node_extra[i]`` for node ``i``, e.g. a fault). ``run`` overrides the app's run
    config. Use it in a test with the ``server_identity`` fixture.

    Returns
    -------
    (SkyStrategy, Grid, dict)
        The strategy, the Grid and the keyword arguments of ``strategy.start``.
    """
    from sky_flower.app import load_fleet, sky_strategy
    from sky_flower.deploy import node_config

    task = sky_app_task()
    run_config = {**sky_app_run_config(), **run}
    fleet = load_fleet(str(run_config["fleet"]))
    node_configs = [parse_config_args([node_config(n, i, len(fleet))]) for i, n in enumerate(fleet)]
    for i, extra in (node_extra or {}).items():
        node_configs[i].update(extra)
    grid = grid_cls(sky_app_client, node_configs, run_config)
    strategy = sky_strategy(run_config, model_fn=task.Net, input_shape=[64])
    start = {
        "grid": grid,
        "initial_arrays": ArrayRecord(task.initial_weights()),
        "num_rounds": int(run_config["num-server-rounds"]),
    }
    return strategy, grid, start


def run_sky_app(
    grid_cls: type[ProcessPerMessageGrid], run: dict[str, Any]
) -> tuple[Any, Any, ProcessPerMessageGrid]:
    """``examples/sky-app`` trained by Sky's strategy on an in-process Grid (see
    :func:`sky_app_on_grid`).

    Returns
    -------
    (SkyStrategy, Result, Grid)
        The strategy (``.rounds``, ``.plan``), what ``start`` returned, the Grid.
    """
    strategy, grid, start = sky_app_on_grid(grid_cls, run)
    try:
        result = strategy.start(**start)
    finally:
        if isinstance(grid, ConcurrentGrid):
            grid.close()
    return strategy, result, grid


DELIVERY_FAULTS = ("duplicate", "late", "malformed", "reorder")


def message_at(
    message_type: str, node_id: int, server_round: int, step: int | None = None
) -> Callable[[Message], bool]:
    """A point of a Sky run for :class:`ChaosGrid`: the messages of this type to this
    node in this round (the message's group id) and, for a step message (its ``mb``
    record), of this step."""

    def hit(msg: Message) -> bool:
        meta = msg.metadata
        mb = msg.content.config_records.get("mb")
        return (
            (meta.message_type, meta.dst_node_id, meta.group_id)
            == (message_type, node_id, str(server_round))
            and (step is None or mb is None or int(mb["step"]) == step)  # type: ignore[arg-type]
        )

    return hit


class ChaosGrid(Grid):
    """Delivery-level faults around an in-process Grid (``inner``), at one point: the
    first message pushed for which ``hit(message)`` is true (:func:`message_at`).

    ``duplicate``
        the message is delivered twice (the copy right after it); the caller sees the
        first reply, the copy's is dropped;
    ``late``
        its reply is held back until ``delay_s`` after its push (past the caller's
        deadline when longer than it), then delivered;
    ``malformed``
        its reply loses its array and metric records in transit;
    ``reorder``
        its reply is delivered after the next pull that returns another reply (or on
        the second pull of it alone).

    ``kind=""``: no fault. A message whose handler raises comes back as an error reply,
    as the engines send (:func:`error_reply`). ``injected`` lists each fault done, as
    ``(kind, message type, destination node id)``.
    """

    def __init__(
        self,
        inner: ProcessPerMessageGrid,
        kind: str,
        hit: Callable[[Message], bool],
        delay_s: float = 0.0,
    ) -> None:
        if kind not in ("", *DELIVERY_FAULTS):
            raise ValueError(f"kind must be '' or one of {DELIVERY_FAULTS}, got {kind!r}")
        self.inner, self.kind, self.hit, self.delay_s = inner, kind, hit, delay_s
        self.injected: list[tuple[str, str, int]] = []
        self.target: str | None = None  # the id of the message hit
        self.release_at = 0.0  # late: when its reply may be pulled
        self.held_pulls = 0  # reorder: pulls that held its reply back
        self.own: dict[str, Message] = {}  # error replies made here

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            hit = bool(self.kind) and not self.injected and self.hit(msg)
            copy = _wire(msg) if hit and self.kind == "duplicate" else None
            ids.append(self._push_one(msg))
            if hit:
                self.target = ids[-1]
                self.release_at = time.monotonic() + self.delay_s
                self.injected.append(
                    (self.kind, msg.metadata.message_type, msg.metadata.dst_node_id)
                )
            if copy is not None:
                self._push_one(copy)  # delivered again; its reply is never pulled
        return ids

    def _push_one(self, msg: Message) -> str:
        try:
            return next(iter(self.inner.push_messages([msg])))
        except Exception as err:  # noqa: BLE001 - the engines' error reply
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            self.own[mid] = error_reply(msg, err)
            return mid

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = list(message_ids)
        got = [self.own.pop(m) for m in wanted if m in self.own]
        rest = [m for m in wanted if m not in self.own]
        held = self.target in rest and not self._release(len(rest))
        if held:
            rest.remove(self.target)  # type: ignore[arg-type]
        got += list(self.inner.pull_messages(rest))
        if held and self.kind == "reorder" and got:
            self.held_pulls = 2  # another reply came first: release it next time
        for reply in got:
            if reply.metadata.reply_to_message_id == self.target:
                self.target = None
                if self.kind == "malformed" and not reply.has_error():
                    for name in list(reply.content.array_records):
                        del reply.content[name]
                    for name in list(reply.content.metric_records):
                        del reply.content[name]
        return got

    def _release(self, pending: int) -> bool:
        """Whether the held reply may be pulled now (``pending`` ids asked for)."""
        if self.kind == "late":
            return time.monotonic() >= self.release_at
        if self.kind == "reorder":
            self.held_pulls += 1
            return self.held_pulls > 2 or (pending == 1 and self.held_pulls > 1)
        return True

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    @property
    def handled(self) -> list[tuple[int, str]]:
        """The inner grid's ``(node id, message type)`` of every message handled."""
        return self.inner.handled

    def close(self) -> None:
        """Close the inner grid if it has threads (:class:`ConcurrentGrid`)."""
        if isinstance(self.inner, ConcurrentGrid):
            self.inner.close()

    def _unused(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("SkyStrategy does not use this")

    create_message = send_and_receive = set_run = _unused
    run = property(_unused)
