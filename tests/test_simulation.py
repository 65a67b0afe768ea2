"""End to end in Flower's simulation engine (Ray): digits, 3 emulated nodes; and the
job's settings refused before Flower starts (no Ray: these run in the fast tier)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import open_dict
from reference import assert_pipelined_relay_row
from simhelpers import FAST, make_cfg, reference_weights
from sky_flower.strategies.sky import SkyNodeError

from sky_flower.core.partition import InfeasibleMemoryError
from sky_flower.pipeline.models import build_model
from sky_flower.run import run_job


@pytest.mark.simulation
# heuristic: make run, sky-app (tests/test_example.py). even: the plan is checked in
# process (tests/test_plan_app.py), the other runs here and in test_direct_sim.py /
# test_chaos.py train on an even plan in the engine, and the optimal run's plan.json
# compares it (alternatives); split training equals unsplit training whatever the plan
@pytest.mark.parametrize("allocation", ["optimal"])
def test_trains_digits_above_90_percent(allocation, tmp_path, no_leftover_processes):
    cfg = make_cfg(
        [*FAST, "fleet=edge3", f"allocation={allocation}", "num_rounds=1", "train.local_epochs=2"]
    )
    results = run_job(cfg, tmp_path)
    assert results["error"] is None
    assert results["final_test_accuracy"] > 0.9

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["allocation"] == allocation
    (row,) = saved["rounds"]
    assert row["measured_step_time_s"] > 0 and row["predicted_step_time_s"] > 0
    assert row["test_accuracy"] == saved["final_test_accuracy"]

    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["method"] == allocation
    layers = [j for s in plan["stages"] for j in range(s["first_layer"], s["last_layer"] + 1)]
    assert layers == list(range(6))  # 5 hidden blocks + head, each exactly once, in order
    assert [s["node"] for s in plan["stages"]][0] == "phone"  # the data owner is stage 0
    assert plan["lower_bound_s"] <= plan["predicted_step_time_s"] + 1e-9
    assert set(plan) >= {"solve_time_s", "proven_optimal"}
    alt = plan["alternatives"]  # every method on this run's own benchmark
    assert alt[allocation] == plan["predicted_step_time_s"]
    assert alt["optimal"] <= alt["heuristic"] + 1e-9 <= alt["even"] + 2e-9
    bench = json.loads((tmp_path / "benchmark.json").read_text())
    assert [n["name"] for n in bench["nodes"]] == ["phone", "cloud", "box"]


@pytest.mark.simulation
def test_pipelined_relay_equals_unpipelined(tmp_path, no_leftover_processes):
    """The relay transport's one equivalence test under Ray (its other schedules, and
    the sequential relay, are checked in-process: tests/test_process_per_message.py).
    The pipelined relay (3 stages, 4 micro-batches in flight in groups of 2, 1F1B,
    gradients accumulated across messages) gives the weights of unpipelined training
    with the same micro-batch split after 3 steps; every stage handled the planned
    number of messages and reported its compute."""
    kind, per_message = "1f1b", 2
    cfg = make_cfg(
        [
            *FAST,
            "fleet=uniform3",
            "allocation=even",
            "num_rounds=1",
            "train.steps_per_round=3",
            "schedule.microbatches=4",
            f"schedule.kind={kind}",
            f"schedule.microbatches_per_message={per_message}",
        ]
    )
    results = run_job(cfg, tmp_path)
    assert results["error"] is None
    split = torch.load(tmp_path / "model.pt")
    for k, v in reference_weights(cfg, 3, 4).items():
        np.testing.assert_allclose(split[k].numpy(), v.numpy(), rtol=1e-4, atol=1e-6)
    (row,) = json.loads((tmp_path / "results.json").read_text())["rounds"]
    assert_pipelined_relay_row(row, per_message, 4)


def test_infeasible_memory_refused_before_flower_starts(tmp_path):
    cfg = make_cfg([*FAST, "fleet=edge3", "allocation=heuristic", "num_rounds=1"])
    with open_dict(cfg):
        for node in cfg.fleet.nodes:
            node.memory_mb = 0.5
    with pytest.raises(
        InfeasibleMemoryError,
        match=r"infeasible memory budget: layer 1 .* needs 1\.3 MiB.*largest node has 0\.5 MiB",
    ):
        run_job(cfg, tmp_path)
    assert not (tmp_path / "results.json").exists()  # nothing ran


@pytest.mark.simulation
# a malformed reply (the strategy's check, not the engine's): tests/test_process_per_message.py
@pytest.mark.parametrize(("fail_mode", "expected"), [("raise", "replied with an error")])
def test_bad_node_reply_ends_run_naming_the_node(
    fail_mode, expected, tmp_path, no_leftover_processes
):
    """box fails (its ClientApp raises under Ray): the failed round is recorded naming
    it, and with train.max_failed_rounds=1 the first failed round ends the run."""
    cfg = make_cfg(
        [*FAST, "fleet=edge3", "allocation=even", "num_rounds=2", "train.max_failed_rounds=1"]
    )
    with open_dict(cfg):
        cfg.fleet.nodes[2].fail_on = "train.sky_forward"  # box: the last stage
        cfg.fleet.nodes[2].fail_mode = fail_mode
    with pytest.raises(
        SkyNodeError, match=rf"round 1 failed.*box.*{expected}.*max_failed_rounds=1 reached"
    ):
        run_job(cfg, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "box" in saved["error"] and saved["final_test_accuracy"] is None
    assert [r["round"] for r in saved["rounds"]] == [1]  # round 2 never started
    assert all("box" in r["error"] and expected in r["error"] for r in saved["rounds"])
    # the last good global model (the initial one) is kept
    assert (tmp_path / "model.pt").exists()


def test_unknown_allocation_refused_before_flower_starts(tmp_path):
    cfg = make_cfg([*FAST, "allocation.method=fastest"])
    with pytest.raises(ValueError, match="unknown allocation 'fastest'.*even, heuristic, optimal"):
        run_job(cfg, tmp_path)
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("schedule.batch_size=5000", "larger than the data owner's 718 training examples"),
        ("num_rounds=0", "num_rounds must be >= 1"),
        ("schedule.microbatches=3", "must divide batch_size=128"),
        ("simulation.num_cpus_per_node=1000", "num_cpus_per_node=1000 must be in"),
        ("train.lr=-1", "lr must be > 0"),
        ("fleet=skycomputing", "the fleet has 64 nodes.*simulation.max_nodes=16"),
        ("allocation.time_limit_s=-5", "time_limit_s must be > 0"),
        ("train.local_epochs=0", "local_epochs must be > 0"),
    ],
)
def test_bad_settings_refused_before_flower_starts(override, message, tmp_path):
    cfg = make_cfg([*FAST, override])
    with pytest.raises(ValueError, match=message):
        run_job(cfg, tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_even_with_more_nodes_than_layers_refused_before_flower_starts(tmp_path):
    cfg = make_cfg([*FAST, "fleet=edge3", "model.hidden_layers=1", "allocation=even"])
    with pytest.raises(ValueError, match="the model has 2 layers, the fleet 3 nodes"):
        run_job(cfg, tmp_path)
    assert not (tmp_path / "results.json").exists()


@pytest.mark.simulation
def test_node_failing_the_benchmark_is_left_out(tmp_path, no_leftover_processes):
    cfg = make_cfg([*FAST, "fleet=edge3", "allocation=optimal", "num_rounds=1"])
    with open_dict(cfg):
        cfg.fleet.nodes[2].fail_on = "query.sky_profile"  # box
    results = run_job(cfg, tmp_path)
    assert results["error"] is None and results["final_test_accuracy"] > 0.5
    plan = json.loads((tmp_path / "plan.json").read_text())
    # box is out of the plan; phone (the data owner) runs stage 0; the planner may
    # leave cloud idle when phone alone is faster
    nodes = [s["node"] for s in plan["stages"]] + plan["idle_nodes"]
    assert sorted(nodes) == ["cloud", "phone"] and plan["stages"][0]["node"] == "phone"


@pytest.mark.simulation
def test_failed_stage_ends_round_and_next_round_runs(tmp_path, no_leftover_processes):
    """Pipelined relay (GPipe, one micro-batch per message): the last stage fails in
    the middle of round 1 (its first forward message raises, with other stages' messages
    in flight). The round ends with an error naming it, the last good global model is
    kept, the node is dropped, the model re-planned on the others, and round 2 trains."""
    cfg = make_cfg(
        [
            *FAST,
            "fleet=edge3",
            "allocation=even",
            "num_rounds=2",
            "train.steps_per_round=3",
            "schedule.kind=gpipe",
            "schedule.microbatches=4",
            "schedule.microbatches_per_message=1",
        ]
    )
    with open_dict(cfg):
        cfg.fleet.nodes[2].fail_on = "train.sky_forward"  # box: the last stage (gpipe too)
    results = run_job(cfg, tmp_path)
    assert results["error"] is None
    (failed,) = results["failed_rounds"]
    assert failed["round"] == 1 and failed["dropped_nodes"] == ["box"]
    assert "box" in failed["error"] and "replied with an error" in failed["error"]
    bad, row = results["rounds"]
    assert bad["round"] == 1 and "box" in bad["error"]
    assert row["round"] == 2 and row["test_accuracy"] is not None
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert {s["node"] for s in plan["stages"]} <= {"phone", "cloud"}
    trained = torch.load(tmp_path / "model.pt")  # round 2's model: moved off the start
    torch.manual_seed(int(cfg.seed))
    initial = build_model(dict(cfg.model)).state_dict()
    assert any(not torch.equal(trained[k], v) for k, v in initial.items())
