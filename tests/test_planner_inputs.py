"""Issue 15: degenerate costs, validated inputs, one-node fleets, packaged fleets, time
limits of the exact paths."""

import math

import pytest
from factories import fake_layer
from simhelpers import make_cfg

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.partition import MIB, brute_force, optimal, partition
from sky_flower.core.profile import NodeProfile
from sky_flower.emulation.devices import Emulation, expand_fleet

SCHEDULES = [
    Schedule(4, 1, "sequential", "relay"),
    Schedule(4, 4, "gpipe", "direct"),
    Schedule(4, 2, "1f1b", "direct"),
    Schedule(4, 4, "gpipe", "relay"),
]


def _node(name, n_layers, t=0.0, memory=2**40, **kw):
    return NodeProfile(
        name=name,
        layer_fwd_s=(t,) * n_layers,
        layer_bwd_s=(t,) * n_layers,
        memory_bytes=memory,
        **kw,
    )


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"{s.kind}-{s.transport}")
@pytest.mark.parametrize("objective", ["step", "throughput"])
def test_every_layer_time_zero_plans_with_every_method(schedule, objective):
    layers = [fake_layer(j, param=MIB, act_out=1024.0) for j in range(5)]
    nodes = [_node(f"n{i}", 5, holds_data=i == 0, bandwidth_bps=1e8) for i in range(3)]
    cost = CostModel(layers, nodes, schedule)
    for method in ("even", "heuristic", "optimal"):
        plan = partition(cost, method, objective=objective, time_limit_s=5)
        assert math.isfinite(plan.objective_value_s) and plan.objective_value_s >= 0
        assert cost.fits(plan.spec)
    bf = brute_force(cost, objective=objective)
    o = partition(cost, "optimal", objective=objective, time_limit_s=5)
    assert o.objective_value_s == pytest.approx(bf.objective_value_s, abs=1e-12)


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("layer_fwd_s", (0.1, math.nan, 0.1), r"node 'n1': layer_fwd_s\[1\] must be a finite"),
        ("layer_bwd_s", (0.1, -1.0, 0.1), r"node 'n1': layer_bwd_s\[1\] must be a finite"),
        ("memory_bytes", math.nan, "node 'n1': memory_bytes must be a finite"),
        ("memory_bytes", -5, "node 'n1': memory_bytes must be a finite"),
        ("latency_s", math.inf, "node 'n1': latency_s must be a finite"),
        ("bandwidth_bps", 0.0, r"node 'n1': bandwidth_bps must be > 0"),
        ("bandwidth_bps", math.nan, r"node 'n1': bandwidth_bps must be > 0"),
        ("state_s_per_byte", math.nan, "node 'n1': state_s_per_byte must be a finite"),
        ("memory_bytes", "8GB", "node 'n1': memory_bytes must be a finite"),
    ],
)
def test_bad_node_fields_are_named_before_planning(field, value, shown):
    layers = [fake_layer(j) for j in range(3)]
    good = {"layer_fwd_s": (0.1,) * 3, "layer_bwd_s": (0.1,) * 3, "memory_bytes": 2**30}
    nodes = [NodeProfile(name="n0", holds_data=True, **good)]
    nodes.append(NodeProfile(name="n1", **{**good, field: value}))
    with pytest.raises(ValueError, match=shown):
        CostModel(layers, nodes, Schedule(4))


def test_bad_layer_field_is_named():
    layers = [fake_layer(0), fake_layer(1, act_out=math.nan)]
    nodes = [_node("n0", 2, 0.1, holds_data=True)]
    with pytest.raises(ValueError, match=r"layer 1 \(1:Fake\): act_out_bytes must be"):
        CostModel(layers, nodes, Schedule(4))


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        ({"slowdown": math.nan}, "node 'a': slowdown must be >= 0"),
        ({"slowdown": math.inf}, "node 'a': slowdown must be >= 0"),
        ({"slowdown": "2"}, "node 'a': slowdown must be >= 0"),
        ({"latency_ms": math.nan}, "node 'a': latency_ms must be >= 0"),
        ({"memory_mb": math.nan}, "node 'a': memory_mb must be > 0"),
        ({"bandwidth_mb_s": math.nan}, "node 'a': bandwidth_mb_s must be > 0 or null"),
        ({"holds_data": "yes"}, "node 'a': holds_data must be true or false"),
        ({"fail_round": -1}, "node 'a': fail_round must be an integer >= 0"),
        # a typo'd message type used to inject nothing, silently (a fault-free run)
        ({"fail_on": "train.sky_forwrd"}, "node 'a': fail_on must be '' or a Sky message type"),
    ],
)
def test_bad_fleet_fields_are_named(spec, shown):
    with pytest.raises(ValueError, match=shown):
        expand_fleet({"nodes": [{"name": "a", "holds_data": True, **spec}]})
    with pytest.raises(ValueError, match=shown):
        Emulation(**{"name": "a", "holds_data": True, **spec})


def test_nan_slowdown_in_a_job_config_is_refused_with_the_node():
    from sky_flower.jobs.sky import _checked_inputs
    from sky_flower.sky.settings import SkySettings

    cfg = make_cfg(["fleet=edge3", "fleet.nodes.1.slowdown=nan"])
    with pytest.raises(ValueError, match="node 'cloud': slowdown must be >= 0"):
        _checked_inputs(cfg, SkySettings.from_hydra(cfg))


def test_num_rounds_abc_names_the_key():
    from sky_flower.sky.settings import SkySettings

    with pytest.raises(ValueError, match="num_rounds='abc' must be an integer"):
        SkySettings.from_hydra(make_cfg(["num_rounds=abc"]))


@pytest.mark.parametrize("method", ["even", "heuristic", "optimal"])
def test_one_node_fleet_plans_with_a_note(method):
    layers = [fake_layer(j) for j in range(3)]
    cost = CostModel(layers, [_node("solo", 3, 0.1, holds_data=True)], Schedule(4))
    plan = partition(cost, method)
    assert plan.spec == [(0, 0, 2)]
    assert "nothing is split" in plan.note


def _packaged_fleets():
    from sky_flower.app import fleet_names

    return fleet_names()


@pytest.mark.parametrize("name", _packaged_fleets())
def test_every_packaged_fleet_loads_on_every_path(name):
    from omegaconf import OmegaConf

    from sky_flower.app import load_fleet

    app_nodes = load_fleet(name)  # the flwr run app's path (and deploy's)
    cfg = make_cfg([f"fleet={name}"])  # the Hydra job's path
    job_nodes = expand_fleet(OmegaConf.to_container(cfg.fleet, resolve=True))
    assert tuple(job_nodes) == app_nodes
    assert any(n.holds_data for n in app_nodes)
    if name == "skycomputing8":
        assert len(app_nodes) == 8


def test_enumeration_respects_the_time_limit():
    # 7 distinct nodes x 9 layers: ~1.5e4 plans, enumerated; a tiny limit stops it early
    L = 9
    layers = [fake_layer(j, act_out=1024.0) for j in range(L)]
    nodes = [
        _node(f"n{i}", L, 0.01 * (1 + i), holds_data=i == 0, latency_s=1e-3 * i) for i in range(7)
    ]
    cost = CostModel(layers, nodes, Schedule(4, 1, "sequential", "relay"))
    plan = optimal(cost, time_limit_s=1e-4, solver="enumerate")
    assert not plan.proven_optimal
    assert "time limit" in plan.note and "not proven" in plan.note
    assert cost.fits(plan.spec)
