"""Calibration of the cost model (issue 16, fast, no engine): the benchmark's new node
fields travel through the protocol records and JSON, the node measures them, and the
cost model charges them with known numbers (defaults change nothing)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from sky_flower.core.calibration import CALIBRATION_FIELDS, uncalibrated
from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.emulation.devices import Emulation
from sky_flower.pipeline.calibrate import calibrate_node
from sky_flower.sky import protocol as P
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.planning.benchmark import calibration

CAL = {
    "microbatch_overhead_s": 0.004,
    "peer_latency_s": 0.002,
    "host": "box",
    "host_parallelism": 2.0,
}
LAYERS = [LayerProfile(j, f"{j}:Linear", 0.0, 0.0, 0, 0, 4.0, 4.0) for j in range(4)]


def node(k: int, **cal: object) -> NodeProfile:
    """Node ``k``: 1 s forward and 1 s backward per layer and micro-batch, free links."""
    return NodeProfile(f"n{k}", (1.0,) * 4, (1.0,) * 4, 2**40, holds_data=k == 0, **cal)


def step(nodes: list[NodeProfile], M: int, kind: str, transport: str = "direct") -> float:
    S = len(nodes)
    plan = [(k, k * 4 // S, (k + 1) * 4 // S - 1) for k in range(S)]
    return CostModel(LAYERS, nodes, Schedule(8, M, kind, transport)).step_time(plan)


def test_profile_reply_and_node_profile_carry_the_fields_through_records_and_json():
    reply = P.ProfileReply(
        name="box",
        holds_data=True,
        num_examples=10,
        memory_bytes=2**33,
        slowdown=0.5,
        emulation="native speed",
        link_latency_s=0.01,
        link_bandwidth_bps=1e6,
        layer_fwd_s=(0.1,),
        layer_bwd_s=(0.2,),
        layer_step_s=(0.0,),
        **CAL,
    )
    back = P.ProfileReply.from_config_record(reply.to_config_record())
    assert back == reply and calibration(back) == {**CAL, "layer_step_s": (0.0,)}
    # a reply from before the calibration (no such keys) reads as "not measured"
    old = {k: v for k, v in reply.to_config_record().items() if k not in CAL}
    unmeasured = P.ProfileReply.from_config_record(ConfigRecord(old))
    assert unmeasured.to_config_record().count_bytes() > 0  # Flower can send it
    assert calibration(unmeasured) == {
        "microbatch_overhead_s": 0.0,
        "peer_latency_s": 0.0,
        "host": "",
        "host_parallelism": 0.0,
    }
    assert P.ProfileRequest.from_config_record(
        P.ProfileRequest((4,), 2, 0, 1, calibrate=True).to_config_record()
    ).calibrate
    prof = node(0, **CAL, layer_step_s=(0.1,) * 4)
    d = json.loads(json.dumps(prof.to_dict()))
    assert {f: d[f] for f in CALIBRATION_FIELDS} == CAL
    d["bandwidth_bps"] = math.inf if d["bandwidth_bps"] is None else d["bandwidth_bps"]
    assert NodeProfile(**{**d, "layer_fwd_s": tuple(d["layer_fwd_s"]),
                          "layer_bwd_s": tuple(d["layer_bwd_s"]),
                          "layer_step_s": tuple(d["layer_step_s"])}) == prof  # fmt: skip
    assert uncalibrated([prof]) == [node(0)]


@pytest.mark.parametrize(("S", "M"), [(1, 1), (2, 4), (4, 8)])
def test_microbatch_overhead_and_peer_latency_are_charged_per_microbatch(S, M):
    c, p = 0.004, 0.002
    plain = [node(k) for k in range(S)]
    over = [node(k, microbatch_overhead_s=c) for k in range(S)]
    peer = [node(k, peer_latency_s=p) for k in range(S)]
    # sequential: M micro-batches through S stages, each paying c, and 2 (S - 1) hops
    assert step(over, M, "sequential") - step(plain, M, "sequential") == pytest.approx(M * S * c)
    assert step(peer, M, "sequential") - step(plain, M, "sequential") == pytest.approx(
        M * 2 * (S - 1) * p
    )
    # gpipe: the overhead lies on the S + M - 1 forward and backward slots of the flow shop
    assert step(over, M, "gpipe") - step(plain, M, "gpipe") == pytest.approx((S + M - 1) * c)
    # the relay is not calibrated by these (its own per-message terms are measured)
    assert step(over, M, "sequential", "relay") == step(plain, M, "sequential", "relay")


@pytest.mark.parametrize(("S", "M"), [(1, 1), (2, 2), (4, 8)])
def test_direct_charges_the_optimizer_step_once_after_the_last_backward(S, M):
    # the benchmark spreads a 0.5 s step per layer over the M micro-batches' backward
    spread = [
        dataclasses.replace(
            node(k), layer_bwd_s=(1.0 + 0.5 / M,) * 4, layer_step_s=(0.5,) * 4
        )
        for k in range(S)
    ]  # fmt: skip
    plain = [node(k) for k in range(S)]
    # direct: stage 0 steps last, its 4 / S layers x 0.5 s after the pipeline's end
    assert step(spread, M, "gpipe") - step(plain, M, "gpipe") == pytest.approx(2.0 / S)
    # the relay keeps the spread (its step is inside the last backward message)
    relay = step(spread, M, "sequential", "relay") - step(plain, M, "sequential", "relay")
    assert relay == pytest.approx(2.0)
    # on one host of parallelism 1 the S stages step at once: their 2 s of CPU work
    one = {"host": "box", "host_parallelism": 1.0}
    shared = [dataclasses.replace(n, **one) for n in spread]
    plain_shared = [dataclasses.replace(n, **one) for n in plain]
    if M == 1:  # (M = 1: no stage computes alongside another, so no other stretch)
        assert step(shared, M, "gpipe") - step(plain_shared, M, "gpipe") == pytest.approx(2.0)
    # without layer_step_s (profiles from before the calibration) nothing moves
    old = uncalibrated(spread)
    assert step(old, M, "gpipe") > step(spread, M, "gpipe") or S == 1


def test_stages_sharing_a_host_are_stretched_by_its_parallelism():
    shared = [node(k, host="box", host_parallelism=2.0) for k in range(4)]
    plain = [node(k) for k in range(4)]
    # M = 4: four stages compute at once on a host that runs two: twice as slow
    assert step(shared, 4, "gpipe") == pytest.approx(2 * step(plain, 4, "gpipe"))
    # M = 2: two at once; M = 1 or sequential: one at a time
    assert step(shared, 2, "gpipe") == pytest.approx(step(plain, 2, "gpipe"))
    assert step(shared, 1, "gpipe") == pytest.approx(step(plain, 1, "gpipe"))
    assert step(shared, 4, "sequential") == pytest.approx(step(plain, 4, "sequential"))
    # emulated slowdown x1 halves each stage's CPU share: 4 x 0.5 = 2 workers, no stretch
    slow = [dataclasses.replace(n, slowdown=1.0) for n in shared]
    assert step(slow, 4, "gpipe") == pytest.approx(step(plain, 4, "gpipe"))
    # two hosts of two stages each: no stretch; unmeasured parallelism: none either
    apart = [dataclasses.replace(n, host=f"h{k // 2}") for k, n in enumerate(shared)]
    assert step(apart, 4, "gpipe") == pytest.approx(step(plain, 4, "gpipe"))
    unmeasured = [dataclasses.replace(n, host_parallelism=0.0) for n in shared]
    assert step(unmeasured, 4, "gpipe") == pytest.approx(step(plain, 4, "gpipe"))
    cost = CostModel(LAYERS, shared, Schedule(8, 4, "gpipe", "direct"))
    assert cost.contention(np.arange(4)).tolist() == [2.0] * 4


@pytest.fixture
def server_identity(monkeypatch):
    for attr, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)  # as a ServerApp process has them


def test_node_measures_the_calibration_in_its_profile_handler(server_identity):
    """The real profile handler answers with measured calibration fields when asked, and
    with the defaults when not (the relay's benchmark round stays as short as before)."""
    import torch
    from torch import nn

    client = SkyClient(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU()), lambda ctx: None)
    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    emu = Emulation("n5")
    replies = {}
    for flag in (False, True):
        req = P.ProfileRequest((4,), 2, 0, 1, optimizer="sgd", lr=0.1, calibrate=flag)
        msg = Message(
            RecordDict({P.CONFIG: req.to_config_record()}), dst_node_id=5,
            message_type=P.PROFILE, group_id="1",
        )  # fmt: skip
        out = client.profile(msg, ctx, emu)
        assert out.config_records[P.PROFILE_KEY].count_bytes() > 0  # Flower can send it
        replies[flag] = P.ProfileReply.from_config_record(out.config_records[P.PROFILE_KEY])
    assert replies[False].host == P.NO_HOST and replies[False].peer_latency_s == 0.0
    assert calibration(replies[False])["host"] == ""
    got = replies[True]
    assert got.host != "" and got.peer_latency_s > 0.0 and got.host_parallelism >= 1.0
    assert 0.0 <= got.microbatch_overhead_s < 1.0
    assert not torch.distributed.is_initialized()  # the one-rank group is gone again
    assert calibrate_node(2).host == got.host


def test_logs_show_the_calibration_and_measured_over_predicted_per_stage():
    from sky_flower.sky.planning.benchmark import benchmark_table
    from sky_flower.sky.rounds.records import StageRecord
    from sky_flower.sky.rounds.report import stage_table

    rows = [StageRecord(0, "a", 0.2, predicted_compute_s=0.1), StageRecord(1, "b", 0.1, 0.0)]
    table = stage_table(rows).splitlines()
    assert table[0].split()[-1] == "meas/pred"
    assert table[1].split()[-1] == "2.00" and table[2].split()[-1] == "-"
    assert "meas/pred" not in stage_table([StageRecord(0, "a", 1)])
    assert "Calibration" not in benchmark_table([node(0)])
    text = benchmark_table([node(0, **CAL)])
    assert "micro-batch overhead 4.00 ms, gloo message 2.00 ms, host 'box' runs 2.00" in text


def test_the_emulated_optimizer_steps_exactly_like_its_optimizer():
    """``direct`` stages step through :class:`EmulatedOptimizer` (a slow device steps
    slowly too, as the benchmark predicts): the same weights as the plain optimizer."""
    import torch

    from sky_flower.pipeline.emulated import Emulated, EmulatedOptimizer

    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    plain = torch.optim.Adam(a.parameters(), lr=0.1)
    slow = EmulatedOptimizer(torch.optim.Adam(b.parameters(), lr=0.1), Emulated(slowdown=0.5))
    for _ in range(2):
        for m in (a, b):
            m(torch.ones(4, 3)).sum().backward()
        plain.step()
        plain.zero_grad(set_to_none=True)
        slow.step()
        slow.zero_grad()
        assert all(p.grad is None for p in b.parameters())
    torch.testing.assert_close(a.state_dict(), b.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("microbatch_overhead_s", math.nan), ("peer_latency_s", -1.0),
     ("host_parallelism", math.inf), ("layer_step_s", (0.1, 0.1, math.nan, 0.1))],
)  # fmt: skip
def test_bad_calibration_values_are_refused_by_name(field, value):
    nodes = [node(0), node(1, **{field: value})]
    with pytest.raises(ValueError, match=f"node 'n1': {field}"):
        CostModel(LAYERS, nodes, Schedule(8, 1, "gpipe", "direct"))
