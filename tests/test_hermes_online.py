"""Issue 18 on Hermes, in this process through Flower's real ClientApp and Messages: the
step-time model fitted from training rounds' own step timings (no benchmark round), and
the emulated link charged on what each round sends."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from sky_flower.strategies.hermes import HermesStrategy
from test_exchange import _hermes, server_identity

from sky_flower.emulation.devices import Emulation
from sky_flower.flower.vectors import vector_record
from sky_flower.gossip.training import FlatModel
from sky_flower.hermes.client import HermesClient, NominalDevice, hermes_data_fn
from sky_flower.hermes.protocol import PROFILE, ROUND
from sky_flower.hermes.server import HermesSizing, WorkerBook

__all__ = ["server_identity"]  # the autouse fixture of test_exchange.py, used here too


def _worker(emulation: Emulation, device: NominalDevice) -> tuple[HermesClient, Context]:
    """One emulated worker (position 0 of 2) and its node context."""
    model, load = FlatModel(8), hermes_data_fn(2)
    client = HermesClient(model, load, 2, lambda ctx: emulation, device)
    ctx = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )
    return client, ctx


def _round(client: HermesClient, ctx: Context, rnd: int, with_global: bool, **cfg) -> Message:  # noqa: ANN003
    """Run one ``train.hermes_round`` on the worker and return its reply."""
    base = {"round": rnd, "data": 129, "batch": 32, "lr": 0.1, "seed": 0, "gate": False}
    content = RecordDict({"cfg": ConfigRecord({**base, **cfg})})
    if with_global:
        content["global"] = vector_record("x", client.model.initial(0))
    msg = Message(content, dst_node_id=7, message_type=ROUND)
    msg.metadata.__dict__["_message_id"] = f"m{rnd}"
    return client.round(msg, ctx)


def test_the_fit_from_training_rounds_recovers_an_emulated_workers_affine_step_time():
    """A worker of nominal step 20 ms + 1 ms per sample at slowdown 1 (so twice that:
    40 ms + 2 ms per sample) trains three rounds cycling through steps of 8, 32, 128 samples;
    the server's fit from those rounds' reported step timings (no benchmark round)
    recovers both coefficients."""
    client, ctx = _worker(Emulation(name="w0", slowdown=1.0), NominalDevice(0.020, 0.001))
    book = WorkerBook.equal(1, 129, 32)
    sizing = HermesSizing(book, 32, (8, 1000), (8, 128), 0.1)
    x = client.load_data().pool.x[:8]  # warm up torch.func, as the readiness barrier does
    client.model.loss_and_grad(client.model.initial(0), x, client.load_data().pool.y[:8])
    for rnd in range(3):
        m = _round(client, ctx, rnd, rnd == 0, batch_cycle=[8, 32, 128]).content.metric_records[
            "metrics"
        ]
        assert list(m["step_batches"]) == [8, 32, 89]  # 129 samples: 8 + 32 + the rest
        sizing.observe(0, m["step_batches"], m["step_seconds"])
    assert sizing.ready_to_plan() and not sizing.planned
    sizing.plan_from_training()
    fitted = sizing.step_models[0]
    assert fitted.overhead_s == pytest.approx(0.040, rel=0.3)  # sleeps overshoot under load
    assert fitted.per_sample_s == pytest.approx(0.002, rel=0.15)
    assert sizing.planned and book.data[0] >= 8  # the search ran on the fit


def test_the_online_refit_follows_a_worker_that_slows_down():
    """After the plan, rounds three times slower move the refit model's level with them."""
    book = WorkerBook.equal(1, 100, 32)
    sizing = HermesSizing(book, 32, (8, 100), (8, 128), 0.1)
    sizing.observe(0, [8, 32, 128], [0.016, 0.040, 0.136])  # 8 ms + 1 ms / sample
    sizing.plan_from_training()
    assert sizing.step_models[0].step_s(32) == pytest.approx(0.040)
    for _ in range(sizing.OBSERVED_WINDOW):
        sizing.observe(0, [32], [0.120])
    assert sizing.step_models[0].step_s(32) == pytest.approx(0.120)


def test_a_worker_removed_before_its_timings_gets_the_slowest_fit():
    """Planning waits for the live workers only; a worker with no timed rounds (removed)
    is sized with the slowest timed worker's model."""
    book = WorkerBook.equal(3, 300, 32)
    sizing = HermesSizing(book, 32, (8, 300), (8, 128), 0.1)
    sizing.observe(0, [8, 32], [0.016, 0.040])
    sizing.observe(1, [8, 32], [0.032, 0.080])
    assert not sizing.ready_to_plan() and sizing.ready_to_plan([0, 1])
    sizing.plan_from_training()
    assert sizing.step_models[2] == sizing.step_models[1] != sizing.step_models[0]


class CountingGrid:
    """A grid wrapper counting the message types pushed (the rest passes through)."""

    def __init__(self, grid) -> None:  # noqa: ANN001
        self.grid, self.types, self.cycles = grid, [], []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        for m in messages:
            self.types.append(m.metadata.message_type)
            cfg = m.content.config_records.get("cfg")
            self.cycles.append(cfg is not None and "batch_cycle" in cfg)
        return self.grid.push_messages(messages)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.grid, name)


@pytest.mark.realtime
def test_hermes_in_training_mode_sends_no_benchmark_message_and_still_plans():
    """Hermes (``step_model="training"``) on 3 workers (slowdowns 0, 1, 2) for 4 s: no
    ``query.hermes_profile`` is ever pushed, the sizes are searched from the training
    rounds (the first rounds carry the step cycle, later ones not). 4 s, not the other
    drivers' 2 s: the search waits for every worker's first round, and under load (two
    xdist workers on two cores) the slowest one's took more than 2 s."""
    model, grid, common, val_loss = _hermes(3)
    common["max_time_s"] = 4.0
    counting = CountingGrid(grid)
    strategy = HermesStrategy(**common, val_loss_fn=val_loss)
    strategy.ready_hold_s, strategy.ready_limit_s = 0.1, 0.5
    strategy.start(
        grid=counting, initial_arrays=vector_record("x", model.initial(0)), num_rounds=1000
    )
    assert PROFILE not in counting.types
    assert strategy.sizing.planned and strategy.benchmark["source"] == "training rounds"
    rounds = [c for t, c in zip(counting.types, counting.cycles, strict=True) if t == ROUND]
    assert rounds[:3] == [True] * 3 and not rounds[-1]


def test_an_emulated_round_pays_latency_plus_bytes_over_bandwidth():
    """Link 40 ms + 0.2 MB/s: a round that receives the global model and sends its update
    pays 40 ms + both models' bytes / bandwidth; a following minor round (nothing
    received, nothing sent) pays the latency only; the round's wall time includes it."""
    emu = Emulation(name="w0", latency_ms=40.0, bandwidth_mb_s=0.2)
    client, ctx = _worker(emu, NominalDevice(0.0, 0.0))
    t0 = time.perf_counter()
    gate = {"gate": True, "window": 10, "threshold": -1.3, "patience": 5, "relax": 0.1}
    reply = _round(client, ctx, 0, True, **gate)
    wall = time.perf_counter() - t0
    m = reply.content.metric_records["metrics"]
    model_bytes = reply.content.array_records["model"].count_bytes()
    assert int(m["sent"]) == 1 and int(m["link_bytes"]) == 2 * model_bytes
    assert float(m["link_s"]) == pytest.approx(0.040 + 2 * model_bytes / 0.2e6)
    assert wall >= float(m["link_s"])
    # same loss again (lr 0, own model): z = 0 > threshold, a minor round
    minor = _round(client, ctx, 1, False, lr=0.0, **gate)
    m = minor.content.metric_records["metrics"]
    assert int(m["sent"]) == 0 and int(m["link_bytes"]) == 0
    assert float(m["link_s"]) == pytest.approx(0.040)
    assert not np.isnan(float(m["val_loss"]))


@pytest.mark.parametrize("name", ["slowlinks8", "straggler8", "slowlinks16"])
def test_the_async_fleets_have_links_on_every_worker(name):
    """The issue-18 fleets load, every worker has a latency and a bandwidth, and
    ``straggler8`` is 10:1 (one worker 1 + 9 times slower than seven native ones)."""
    from pathlib import Path

    from sky_flower.emulation.devices import compose_fleet, expand_fleet

    conf = Path(__file__).parents[1] / "conf" / "fleet"
    fleet = expand_fleet(compose_fleet(name, lambda n: (conf / f"{n}.yaml").read_text()))
    assert all(f.latency_ms > 0 and f.bandwidth_mb_s for f in fleet)
    if name == "straggler8":
        assert sorted(1 + f.slowdown for f in fleet) == [1.0] * 7 + [10.0]
