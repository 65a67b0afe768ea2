"""``sky_flower.flower.exchange.Exchange`` against a real Flower ClientApp, in this
process (no engine): replies in message order, errors naming the failing node with its
reason, deadlines, the stop flag, the poll period; and the decentralized
strategy driving its nodes through it (same rows as the benchmark's one-process path)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from reference import ProcessPerMessageGrid, error_reply
from sky_flower.strategies.decentralized import (
    D2Strategy,
    DecentralizedNodeError,
    DeTAGStrategy,
    DPSGDStrategy,
)
from sky_flower.strategies.hermes import STRATEGIES, ASPStrategy, HermesNodeError

from sky_flower.bench.decentralized import simulate
from sky_flower.emulation.devices import Emulation
from sky_flower.flower.exchange import Exchange, NodeError, short_reason
from sky_flower.flower.vectors import vector_record
from sky_flower.gossip.client import DecentralizedClient, heterogeneous_data_fn
from sky_flower.gossip.matrices import gossip_matrix
from sky_flower.gossip.training import FlatModel, node_splits
from sky_flower.hermes.client import HermesClient, NominalDevice, hermes_data_fn
from sky_flower.pipeline.data import load_split
from sky_flower.sky.node.client import fleet_emulation


@pytest.fixture(autouse=True)
def server_identity(monkeypatch):
    """Building a Message outside a running app needs the process identity of a
    ServerApp (Flower 1.42 internal)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


NEVER = -1  # a hold that never ends


class HoldingGrid(ProcessPerMessageGrid):
    """:class:`reference.ProcessPerMessageGrid` (a ClientApp's handlers run in this
    process as a SuperNode runs them, node ``i`` with ``partition-id`` ``i``), plus what
    the engines do and it does not: a handler's exception becomes an error reply. It can
    hold a node's replies back: ``hold[node_id]`` pulls before they show (``NEVER``), and
    counts ``pull_messages`` calls in ``pulls``."""

    def __init__(self, app: ClientApp, num_nodes: int, hold: dict | None = None) -> None:
        configs = [{"partition-id": i, "num-partitions": num_nodes} for i in range(num_nodes)]
        super().__init__(lambda: app, configs, run_config={})
        self.hold = dict(hold or {})
        self.left: dict[str, int] = {}  # message id -> pulls before its reply shows
        self.pulls = 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            try:
                (mid,) = super().push_messages([msg])
            except Exception as ex:  # noqa: BLE001 - as the engines report it
                mid = msg.metadata.message_id
                self.replies[mid] = error_reply(msg, ex)
            self.left[mid] = self.hold.get(msg.metadata.dst_node_id, 0)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self.pulls += 1
        shown = []
        for mid in message_ids:
            if self.left.get(mid, 0) > 0:
                self.left[mid] -= 1
            elif self.left.get(mid, 0) == 0:
                shown.append(mid)
        return super().pull_messages(shown)


def echo_app() -> ClientApp:
    """``query.echo`` answers with the node's id; ``query.fail`` raises."""
    app = ClientApp()

    @app.query("echo")
    def echo(msg: Message, context: Context) -> Message:
        metrics = MetricRecord({"node": context.node_id})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    @app.query("fail")
    def fail(msg: Message, context: Context) -> Message:
        raise RuntimeError(f"disk full on {context.node_id}")

    return app


NAMES = {101: "alpha", 102: "beta", 103: "gamma"}


def messages(grid: HoldingGrid, types: dict[int, str] | None = None) -> list[Message]:
    types = types or {}
    return [
        Message(RecordDict(), dst_node_id=nid, message_type=types.get(nid, "query.echo"))
        for nid in grid.ids
    ]


def test_replies_come_back_in_message_order_whatever_order_they_arrive_in():
    grid = HoldingGrid(echo_app(), 3, hold={101: 4, 102: 1})  # 103 first, 101 last
    ex = Exchange(grid, timeout_s=5.0, poll_interval_s=0.0, describe=NAMES.get)
    replies = ex.request(messages(grid))
    assert [int(r.content.metric_records["metrics"]["node"]) for r in replies] == grid.ids
    assert not ex.pending and grid.pulls >= 5


def test_an_error_reply_raises_naming_exactly_the_failing_node_and_its_reason():
    class MyError(NodeError):
        pass

    grid = HoldingGrid(echo_app(), 3)
    ex = Exchange(grid, timeout_s=5.0, describe=NAMES.get, error_cls=MyError)
    with pytest.raises(MyError) as info:
        ex.request(messages(grid, {102: "query.fail"}))
    assert info.value.node_ids == [102] and info.value.nodes == ["beta"]
    text = str(info.value)
    assert "beta (node 102)" in text and "disk full on 102" in text
    assert "alpha" not in text and "gamma" not in text


def test_a_withheld_reply_raises_after_the_timeout_naming_that_node():
    grid = HoldingGrid(echo_app(), 3, hold={103: NEVER})
    ex = Exchange(grid, timeout_s=0.3, poll_interval_s=0.01, describe=NAMES.get)
    t0 = time.monotonic()
    with pytest.raises(NodeError, match=r"no reply within 0\.3 s from gamma \(node 103\)") as info:
        ex.request(messages(grid))
    assert 0.3 <= time.monotonic() - t0 < 1.5
    assert info.value.node_ids == [103] and info.value.nodes == ["gamma"]


def test_a_per_push_timeout_overrides_the_default():
    grid = HoldingGrid(echo_app(), 1, hold={101: NEVER})
    ex = Exchange(grid, timeout_s=60.0, poll_interval_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(NodeError, match=r"no reply within 0\.2 s from node 101"):
        ex.request(messages(grid), timeout_s=0.2)
    assert time.monotonic() - t0 < 1.5


def test_the_stop_flag_ends_a_wait_from_another_thread():
    grid = HoldingGrid(echo_app(), 2, hold={102: NEVER})
    stop = threading.Event()
    ex = Exchange(grid, timeout_s=60.0, poll_interval_s=0.01, stop=stop)
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(NodeError, match="stopped by the caller") as info:
        ex.request(messages(grid))
    assert time.monotonic() - t0 < 2.0 and info.value.node_ids is None


@pytest.mark.parametrize("interval", [0.02, 0.1])
def test_the_poll_interval_is_honoured(interval):
    grid = HoldingGrid(echo_app(), 1, hold={101: NEVER})
    ex = Exchange(grid, timeout_s=0.6, poll_interval_s=interval)
    with pytest.raises(NodeError):
        ex.request(messages(grid))
    expected = 0.6 / interval
    assert 0.5 * expected <= grid.pulls <= expected + 2, grid.pulls


def test_wait_any_returns_the_first_arrivals_and_gives_up_at_until():
    grid = HoldingGrid(echo_app(), 3, hold={101: 2, 102: NEVER, 103: NEVER})
    ex = Exchange(grid, timeout_s=30.0, poll_interval_s=0.005, describe=NAMES.get)
    ids = ex.push(messages(grid))
    (first,) = ex.wait_any()
    assert first.metadata.reply_to_message_id == ids[0]
    t0 = time.monotonic()
    assert ex.wait_any(until=time.monotonic() + 0.1) == []
    assert 0.1 <= time.monotonic() - t0 < 1.0
    assert ex.pending == set(ids[1:])


def test_short_reason_keeps_the_nodes_message():
    wrapped = "<class 'flwr.clientapp.ClientAppException'>:<'\nException ...\nMessage: disk full'>"
    assert short_reason(wrapped) == "disk full"


def test_bad_settings_refused():
    grid = HoldingGrid(echo_app(), 1)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Exchange(grid, timeout_s=0)
    with pytest.raises(ValueError, match="poll_interval_s >= 0"):
        Exchange(grid, timeout_s=1, poll_interval_s=-1)


# --- the strategies on it ------------------------------------------------------------
def test_strategy_errors_are_node_errors():

    assert issubclass(DecentralizedNodeError, NodeError)
    assert issubclass(HermesNodeError, NodeError)


def _decentralized(num_nodes: int, rounds: int):  # noqa: ANN202

    model = FlatModel(8)
    app = DecentralizedClient(model, heterogeneous_data_fn(num_nodes, 0.0)).register(ClientApp())
    return model, app


@pytest.mark.parametrize(
    ("name", "options", "lazy"),
    [
        ("detag", {"phase_rounds": 2}, False),  # the paper's Algorithm 2
        ("detag", {"phase_rounds": 2, "variant": "atc"}, False),
        ("d2", {}, True),  # D2 on the lazy ring (I + W) / 2 (the plain 4-ring is refused)
    ],
    ids=["detag-paper", "detag-atc", "d2-lazy"],
)
def test_decentralized_through_the_exchange_equals_the_fast_path(name, options, lazy):
    """The decentralized strategy in this process (4 nodes on a ring, sorted data; DeTAG
    in phases of 2 rounds, both variants; D2 on the lazy ring): its rows are the
    benchmark's one-process rows. (The Hydra job under Ray: tests/test_decentralized_sim.py,
    D2 on the lazy ring.)"""

    model, app = _decentralized(4, 8)
    train, test = load_split("digits", 0.2, 0)
    gossip = gossip_matrix("ring", 4, lazy=lazy)
    cls = DeTAGStrategy if name == "detag" else D2Strategy
    strategy = cls(gossip=gossip, lr=0.2, poll_interval_s=0.0, **options)

    def evaluate(step, arrays):  # noqa: ANN001, ANN202
        res = model.evaluate(arrays["x"].numpy(), test)
        return MetricRecord({"accuracy": res["accuracy"], "loss": res["loss"]})

    strategy.start(
        grid=HoldingGrid(app, 4),
        initial_arrays=vector_record("x", model.initial(0)),
        num_rounds=8,
        evaluate_fn=evaluate,
    )
    rows = strategy.rounds
    step = 2 if name == "detag" else 1
    assert [r["round"] for r in rows] == list(range(0, 9, step))
    splits = node_splits(train, 4, 0.0, 0)
    fast = simulate(name, strategy.gossip, model, splits, test, 8, 0.2, **options)
    keys = ("loss", "test_accuracy", "consensus_distance")
    got, want = ([[r[k] for k in keys] for r in rs] for rs in (rows, fast))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_a_silent_decentralized_node_is_named_by_position():

    model, app = _decentralized(3, 2)
    grid = HoldingGrid(app, 3)
    strategy = DPSGDStrategy(
        gossip=gossip_matrix("complete", 3), message_timeout_s=0.3, poll_interval_s=0.01
    )
    original = grid.push_messages

    def push(msgs):  # noqa: ANN001, ANN202 - node 102 goes silent after the hello
        ids = original(msgs)
        if msgs[0].metadata.message_type == "train.dec_grad":
            grid.left[ids[1]] = NEVER
        return ids

    grid.push_messages = push
    with pytest.raises(DecentralizedNodeError, match=r"position 1 \(node 102\)") as info:
        strategy.start(grid=grid, initial_arrays=vector_record("x", model.initial(0)), num_rounds=2)
    assert info.value.node_ids == [102] and info.value.nodes == ["position 1"]


class ThreadedGrid(HoldingGrid):
    """:class:`HoldingGrid` whose nodes handle their messages on their own threads, so
    replies arrive in any order while others still run, as in the engines (the
    asynchronous drivers and Hermes' readiness barrier need that). ``fail`` makes a
    node's handler of one message type raise."""

    def __init__(self, app: ClientApp, num_nodes: int, fail: tuple[int, str] = (0, "")) -> None:
        super().__init__(app, num_nodes)
        self.fail = fail
        self.contexts = {
            nid: Context(
                run_id=1,
                node_id=nid,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i, nid in enumerate(self.ids)
        }
        self.pool = ThreadPoolExecutor(num_nodes)
        self.futures: dict[str, Future] = {}

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            self.futures[mid] = self.pool.submit(self._handle, msg)
            ids.append(mid)
        return ids

    def _handle(self, msg: Message) -> Message:
        nid = msg.metadata.dst_node_id
        try:
            if (nid, msg.metadata.message_type) == self.fail:
                raise RuntimeError(f"injected failure on node {nid}")
            return self.app_fn()(msg, self.contexts[nid])
        except Exception as ex:  # noqa: BLE001 - as the engines report it
            return error_reply(msg, ex)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self.pulls += 1
        done = [m for m in message_ids if m in self.futures and self.futures[m].done()]
        return [self.futures.pop(m).result() for m in done]


class ThreadSafeModel(FlatModel):
    """FlatModel whose torch calls take turns: ``torch.func`` transforms are not safe to
    run from several threads at once (the engines run each node in its own process)."""

    lock = threading.Lock()

    def loss_and_grad(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        with self.lock:
            return super().loss_and_grad(*args, **kwargs)

    def evaluate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        with self.lock:
            return super().evaluate(*args, **kwargs)


def _hermes(num_workers: int, fail: tuple[int, str] = (0, "")):  # noqa: ANN202

    model = ThreadSafeModel(8)
    load = hermes_data_fn(num_workers)
    fleet = [Emulation(name=f"w{i}", slowdown=float(i)) for i in range(num_workers)]
    device = NominalDevice(0.002, 0.0001)
    app = HermesClient(model, load, num_workers, fleet_emulation(fleet), device).register(
        ClientApp()
    )
    grid = ThreadedGrid(app, num_workers, fail)
    common = {
        "model": model,
        "num_workers": num_workers,
        "pool_size": len(load().pool),
        "batch_size": 8,
        "stop_at_target": False,
        "max_time_s": 2.0,
        "poll_interval_s": 0.005,
    }
    val = load().server_val
    return model, grid, common, (lambda vec: model.evaluate(vec, val)["loss"])


@pytest.mark.realtime
@pytest.mark.parametrize("name", ["hermes", "bsp"])
def test_the_asynchronous_driver_runs_through_the_exchange(name):
    """Hermes and BSP on 3 workers (slowdowns 0, 1, 2) for 2 s, replies taken as they
    arrive: every round is counted, sent or minor; BSP runs in lockstep and sends every
    round (its Ray run was merged away: tests/test_hermes_sim.py)."""

    model, grid, common, val_loss = _hermes(3)
    extra = {"val_loss_fn": val_loss, "profile_repeats": 1} if name == "hermes" else {}
    strategy = STRATEGIES[name](**common, **extra)
    t0 = time.monotonic()
    strategy.start(grid=grid, initial_arrays=vector_record("x", model.initial(0)))
    assert time.monotonic() - t0 < 30
    assert strategy.wall_time_s < 2.0 + 1.0 and len(strategy.timeline) >= 2
    rows = strategy.worker_rows()
    assert all(r["rounds"] == r["updates_sent"] + r["minor_rounds"] > 0 for r in rows)
    if name == "bsp":
        assert max(strategy.clock) - min(strategy.clock) <= 1  # the barrier: nobody runs ahead
        assert all(r["minor_rounds"] == 0 for r in rows)  # every round sends
    else:
        assert strategy.benchmark is not None and min(strategy.searches) >= 1
    assert not grid.futures  # the rounds still running at the end were drained


def test_a_failing_worker_is_named_by_position():

    model, grid, common, _ = _hermes(3, fail=(102, "train.hermes_round"))
    strategy = ASPStrategy(**common)
    with pytest.raises(HermesNodeError, match=r"worker 1 \(node 102\).*injected failure") as info:
        strategy.start(grid=grid, initial_arrays=vector_record("x", model.initial(0)))
    assert info.value.node_ids == [102] and info.value.nodes == ["worker 1"]
    assert not hasattr(strategy, "wall_time_s")  # the run did not end


def test_nodes_reporting_the_same_position_are_all_named():
    app = ClientApp()

    @app.query("dec_hello")
    def hello(msg: Message, context: Context) -> Message:
        metrics = MetricRecord({"position": 0, "n": 1})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    strategy = DPSGDStrategy(gossip=gossip_matrix("complete", 3), poll_interval_s=0.0)
    with pytest.raises(DecentralizedNodeError, match=r"positions \[0, 0, 0\], expected 0..2") as e:
        strategy.connect(HoldingGrid(app, 3))
    assert sorted(e.value.node_ids) == [101, 102, 103]
