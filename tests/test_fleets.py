"""SkyComputing's emulated fleet: slowdowns, synthetic node profiles, integer fleets."""

import math

import numpy as np
import pytest
from factories import fake_layer
from hypothesis import given, settings
from hypothesis import strategies as st
from simhelpers import make_cfg
from tiers import examples

from sky_flower.core.fleets import skycomputing_slowdowns, synthetic_node_profiles
from sky_flower.core.profile import LayerProfile
from sky_flower.emulation.devices import expand_fleet, parse_fleet


def flop_layer(index, fwd, bwd):
    return LayerProfile(index, f"{index}:Fake", fwd, bwd, 0, 0, 0.0, 0.0)


@settings(max_examples=examples(30), deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_slowdowns_are_numpys_draw(n, seed):
    got = skycomputing_slowdowns(n, seed)
    want = np.random.default_rng(seed).integers(1, 7, size=n + 1)
    assert got == [int(v) for v in want[:n]]
    assert all(isinstance(v, int) and 1 <= v <= 6 for v in got)
    # prefix-stable: a bigger fleet keeps the smaller fleet's slowdowns
    assert skycomputing_slowdowns(n + 5, seed)[:n] == got


def test_slowdowns_default_seed_35():
    # SkyComputing's experiment/config.py with 4 cores (3 workers): get_slowdown(i, 3)
    # for workers 1..3 is default_rng(35).integers(1, 7, size=4)[1:4]
    assert skycomputing_slowdowns(4) == [1, 3, 5, 3]
    drawn = skycomputing_slowdowns(64)
    assert len(drawn) == 64 and set(drawn) == {1, 2, 3, 4, 5, 6}
    assert skycomputing_slowdowns(64, seed=36) != drawn


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4"])
def test_slowdowns_bad_count(bad):
    with pytest.raises(ValueError, match="num_nodes must be a positive integer"):
        skycomputing_slowdowns(bad)


@settings(max_examples=examples(40), deadline=None)
@given(
    slowdowns=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    flops=st.lists(st.floats(0, 1e12), min_size=1, max_size=6),
    microbatch=st.integers(1, 64),
    rate=st.floats(1e6, 1e15),
)
def test_synthetic_times_scale_with_slowdown(slowdowns, flops, microbatch, rate):
    layers = [flop_layer(j, f, 2 * f) for j, f in enumerate(flops)]
    nodes = synthetic_node_profiles(layers, slowdowns, microbatch, rate, 2**30)
    assert [n.name for n in nodes] == [f"node{i}" for i in range(len(slowdowns))]
    assert [n.holds_data for n in nodes] == [True] + [False] * (len(slowdowns) - 1)
    assert [n.slowdown for n in nodes] == slowdowns
    for node, s in zip(nodes, slowdowns, strict=True):
        assert len(node.layer_fwd_s) == len(node.layer_bwd_s) == len(flops)
        for j, f in enumerate(flops):
            assert math.isclose(node.layer_fwd_s[j], f * microbatch / rate * (1 + s))
            assert math.isclose(node.layer_bwd_s[j], 2 * f * microbatch / rate * (1 + s))


def test_synthetic_links_memory_and_names():
    layers = [flop_layer(0, 1e9, 2e9), flop_layer(1, 3e9, 6e9)]
    nodes = synthetic_node_profiles(
        layers,
        [1, 0, 5],
        microbatch_size=4,
        flops_per_s=1e12,
        memory_bytes=[1, 2, 3],
        latency_s=1e-4,
        bandwidth_bps=1.25e9,
        names=["a", "b", "c"],
    )
    assert [n.memory_bytes for n in nodes] == [1, 2, 3]
    assert [n.name for n in nodes] == ["a", "b", "c"]
    assert all(n.latency_s == 1e-4 and n.bandwidth_bps == 1.25e9 for n in nodes)
    # node c (slowdown 5) is 6x node b (native), node a 2x
    assert nodes[2].layer_fwd_s[1] == pytest.approx(6 * nodes[1].layer_fwd_s[1])
    assert nodes[0].layer_bwd_s[0] == pytest.approx(2 * nodes[1].layer_bwd_s[0])
    assert nodes[1].layer_fwd_s == pytest.approx((4e-3, 12e-3))
    free = synthetic_node_profiles(layers, [0], 1, 1e12, 10)
    assert free[0].bandwidth_bps == math.inf and free[0].latency_s == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"flops_per_s": 0.0}, "flops_per_s must be a positive finite rate"),
        ({"flops_per_s": -1e12}, "flops_per_s must be a positive finite rate"),
        ({"flops_per_s": math.inf}, "flops_per_s must be a positive finite rate"),
        ({"memory_bytes": [1, 2]}, r"memory_bytes has 2 entries but there are 3 nodes"),
        ({"memory_bytes": 0}, "memory_bytes must be > 0"),
        ({"names": ["a", "b"]}, "names has 2 entries but there are 3 nodes"),
        ({"names": ["a", "a", "b"]}, "unique"),
        ({"slowdowns": [0, -1, 2]}, r"slowdowns must be >= 0.*\(1, -1\)"),
        ({"slowdowns": []}, "no nodes"),
        ({"layers": []}, "no layers"),
        ({"microbatch_size": 0}, "microbatch_size must be >= 1"),
        ({"latency_s": -0.1}, "latency_s must be >= 0"),
        ({"bandwidth_bps": 0.0}, "bandwidth_bps must be > 0"),
    ],
)
def test_synthetic_bad_input(kwargs, message):
    args = {
        "layers": [fake_layer(0)],
        "slowdowns": [1, 2, 3],
        "microbatch_size": 2,
        "flops_per_s": 1e12,
        "memory_bytes": 2**30,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        synthetic_node_profiles(**args)


def test_integer_fleet_config_expands():
    cfg = make_cfg(["fleet=skycomputing", "fleet.nodes=4"])
    fleet = expand_fleet(dict(cfg.fleet))
    assert [n.name for n in fleet] == ["node0", "node1", "node2", "node3"]
    assert [n.holds_data for n in fleet] == [True, False, False, False]
    assert [n.slowdown for n in fleet] == [1.0, 3.0, 5.0, 3.0]
    assert all(n.memory_mb == 8192 and n.latency_ms == 0.1 for n in fleet)
    assert all(n.bandwidth_mb_s == 1250 for n in fleet)
    assert len(expand_fleet(dict(make_cfg(["fleet=skycomputing"]).fleet))) == 64
    other_seed = expand_fleet({"nodes": 16, "seed": 1})
    assert [n.slowdown for n in other_seed] == skycomputing_slowdowns(16, 1)
    assert other_seed[0].memory_mb is None and other_seed[0].bandwidth_mb_s is None


def test_list_fleets_unchanged():
    from omegaconf import OmegaConf

    cfg = make_cfg(["fleet=edge4"])
    fleet_cfg = OmegaConf.to_container(cfg.fleet, resolve=True)
    assert expand_fleet(fleet_cfg) == parse_fleet(fleet_cfg["nodes"])
    assert [n.name for n in expand_fleet(fleet_cfg)][:2] == ["phone", "laptop"]


@pytest.mark.parametrize(
    ("fleet_cfg", "message"),
    [
        ({"name": "x"}, "has no nodes"),
        ({"nodes": 0}, "fleet.nodes must be >= 1"),
        ({"nodes": True}, "list of nodes or a node count"),
        ({"nodes": "4"}, "list of nodes or a node count"),
        ({"nodes": 4, "memroy_mb": 10}, r"unknown key\(s\) \['memroy_mb'\]"),
        ({"nodes": 4, "seed": 1.5}, "fleet.seed must be an integer"),
        ({"nodes": 4, "memory_mb": -1}, "memory_mb must be > 0"),
        ({"nodes": []}, "the fleet has no nodes"),
    ],
)
def test_expand_fleet_bad_input(fleet_cfg, message):
    with pytest.raises(ValueError, match=message):
        expand_fleet(fleet_cfg)
