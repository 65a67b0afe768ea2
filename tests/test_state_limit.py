"""Size limits known up front (issue 17): a relay stage whose ``context.state`` would
exceed Flower's limit (protobuf's and gRPC's 2 GiB - 1 per message) is refused by the
planner, naming the stage, its size and the limit, before any training; the direct
transport keeps stage state out of ``context.state`` and is allowed. Layer sizes are
faked in the profile (nothing of that size is allocated)."""

from __future__ import annotations

import pytest

from sky_flower.core.cost import Schedule
from sky_flower.core.profile import NodeProfile
from sky_flower.sky.planning.planning import (
    CONTEXT_LIMIT_BYTES,
    StageStateTooLargeError,
    make_federated_plan,
)
from tests.factories import fake_layer

MiB, GiB = 1024**2, 1024**3


def _nodes(L: int) -> list[NodeProfile]:
    return [
        NodeProfile(
            name=name,
            layer_fwd_s=(1.0,) * L,
            layer_bwd_s=(2.0,) * L,
            memory_bytes=64 * GiB,
            bandwidth_bps=1e9,
            latency_s=1e-3,
            holds_data=name == "owner",
        )
        for name in ("owner", "big", "small")
    ]


def _plan(transport: str, param: int, act: float = 1024.0):  # noqa: ANN202
    """Three layers of ``param`` bytes each (Adam: twice that in optimizer state) on
    three nodes, ``even``: one layer per stage."""
    layers = [fake_layer(j, param=param, opt=2 * param, act_in=act, act_out=act) for j in range(3)]
    schedule = Schedule(batch_size=8, microbatches=2, kind="gpipe", transport=transport)
    return make_federated_plan(
        layers, _nodes(3), {"owner": 100}, schedule, "even", steps_per_round=1, alternatives=False
    )


def test_flower_limit_is_the_installed_flowers():
    from flwr.common import GRPC_MAX_MESSAGE_LENGTH

    assert CONTEXT_LIMIT_BYTES == GRPC_MAX_MESSAGE_LENGTH == 2**31 - 1


def test_relay_stage_over_two_gib_is_refused_naming_stage_size_and_limit():
    """Each layer: 600 MiB of weights, as much of gradients, 1200 MiB of Adam state:
    2.34 GiB per stage on the relay, refused before any message; on direct, planned."""
    with pytest.raises(StageStateTooLargeError) as info:
        _plan("relay", 600 * MiB)
    text = str(info.value)
    assert text.startswith("stage 0 of owner's pipeline (node owner, layers 0-0)")
    assert "2.34 GiB" in text and f"limit of {2**31 - 1} bytes" in text
    assert "use transport=direct" in text.lower()
    fed = _plan("direct", 600 * MiB)
    assert len(fed.planned[0].plan.stages) == 3


def test_relay_stage_state_counts_one_steps_activations():
    """A stage's weights, gradients and Adam state fit (400 MiB), but on the middle
    stage the step's stashed input, kept outputs and kept input gradients (3 x 8
    samples x 96 MiB = 2.25 GiB) push it over; stage 0 (no input gradients: 1.5 GiB +
    400 MiB) fits."""
    fed = _plan("relay", 100 * MiB, act=16.0 * MiB)  # fits: 0.39 GiB + 0.38 GiB
    assert len(fed.planned[0].plan.stages) == 3
    with pytest.raises(StageStateTooLargeError, match=r"stage 1 of owner's pipeline \(node big"):
        _plan("relay", 100 * MiB, act=96.0 * MiB)


def test_a_layer_over_the_limit_on_relay_is_refused_before_any_node_is_contacted():
    """The pre-check (before the benchmark round, with or without a fleet file): one
    layer of 800 MiB weights + 1600 MiB Adam state cannot fit any relay stage."""
    from sky_flower.sky.planning.planning import precheck

    layers = [fake_layer(0, param=800 * MiB, opt=1600 * MiB), fake_layer(1, param=MiB)]
    relay = Schedule(batch_size=8, microbatches=2, kind="gpipe", transport="relay")
    with pytest.raises(StageStateTooLargeError, match=r"layer 0:Fake alone would keep 3.12 GiB"):
        precheck(layers, relay, "even", [], [])
    direct = Schedule(batch_size=8, microbatches=2, kind="gpipe", transport="direct")
    precheck(layers, direct, "even", [], [])
    with pytest.raises(StageStateTooLargeError, match="transport=direct"):
        precheck(layers, relay, "even", ["a", "b"], [None, None])


def test_other_allocations_over_the_limit_are_reported_infeasible():
    """``even`` (one 1.17 GiB layer per stage) fits the relay; ``heuristic`` and
    ``optimal`` would put the layers together on one node (over 2 GiB): their
    predictions, shown beside the plan, say infeasible (None)."""
    speeds = {"owner": 1.0, "big": 0.01, "small": 1.0}
    nodes = [
        NodeProfile(
            name=n,
            layer_fwd_s=(t,) * 3,
            layer_bwd_s=(2 * t,) * 3,
            memory_bytes=64 * GiB,
            bandwidth_bps=1e6,
            latency_s=0.1,
            holds_data=n == "owner",
        )
        for n, t in speeds.items()
    ]
    layers = [
        fake_layer(j, param=300 * MiB, opt=600 * MiB, act_in=1e6, act_out=1e6) for j in range(3)
    ]
    relay = Schedule(batch_size=8, microbatches=2, kind="gpipe", transport="relay")
    fed = make_federated_plan(layers, nodes, {"owner": 100}, relay, "even", steps_per_round=1)
    assert fed.alternatives["even"] is not None
    assert fed.alternatives["heuristic"] is None and fed.alternatives["optimal"] is None
