"""``transport=direct`` end to end in Flower's simulation engine (Ray): every stage of a
round runs at once and trains peer to peer through torch.distributed.pipelining."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import open_dict
from simhelpers import FAST, make_cfg, reference_weights

from sky_flower.run import run_job

DIRECT = [*FAST, "transport=direct", "fleet=uniform3", "allocation=even"]


@pytest.mark.simulation
def test_direct_training_equals_local_training(tmp_path, no_leftover_processes):
    """The direct transport's one equivalence test under Ray (1F1B is checked
    in-process: tests/test_process_per_message.py). Weights after 3 steps through 3
    stages (GPipe, 4 micro-batches, peer to peer) equal those of the unsplit model
    trained on the same batches and micro-batches in this process."""
    M, steps = 4, 3
    cfg = make_cfg(
        [
            *DIRECT,
            "schedule.kind=gpipe",
            f"schedule.microbatches={M}",
            "num_rounds=1",
            f"train.steps_per_round={steps}",
        ]
    )
    results = run_job(cfg, tmp_path)
    assert results["error"] is None
    (row,) = results["rounds"]
    assert row["setup_s"] > 0 and row["measured_step_time_s"] > 0
    assert [s["node"] for s in row["stages"]] == ["node0", "node1", "node2"]
    split = torch.load(tmp_path / "model.pt")
    for k, v in reference_weights(cfg, steps, M).items():
        np.testing.assert_allclose(split[k].numpy(), v.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.simulation
@pytest.mark.parametrize(("mode", "says"), [("crash", "crashed"), ("stall", "stalled")])
def test_failed_stage_ends_the_round_and_the_next_round_runs(
    mode, says, tmp_path, no_leftover_processes
):
    """node1 (stage 1) crashes or stalls before step 1 of round 1: the round ends for all
    stages within the timeout, with an error naming node1 first; round 2 trains from the
    last good (initial) model; no process is left behind."""
    cfg = make_cfg(
        [
            *DIRECT,
            "num_rounds=2",
            "train.steps_per_round=3",
            "schedule.direct_timeout_s=5",
        ]
    )
    with open_dict(cfg):
        node = cfg.fleet.nodes[1]
        node.fail_on, node.fail_mode, node.fail_round, node.fail_step = (
            "train.sky_direct",
            mode,
            1,
            1,
        )
    results = run_job(cfg, tmp_path)
    assert results["error"] is None
    failed, good = results["rounds"]
    assert failed["round"] == 1 and failed.get("test_accuracy") is None
    error = failed["error"]
    assert error.startswith("round 1 failed: stage 1 on node1") and says in error
    assert "stage 0 on node0" in error and "peer stage failed or stalled" in error
    assert failed["round_time_s"] < 40  # bounded by the 5 s timeout, not the 120 s one
    assert good["round"] == 2 and good.get("error") is None and good["test_accuracy"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["final_test_accuracy"] == good["test_accuracy"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["simulation.num_cpus_per_node=1"], r"lower simulation.num_cpus_per_node to <= 0.5"),
        (["schedule.kind=sequential"], "gpipe and 1f1b on transport=direct"),
    ],
)
def test_direct_settings_refused_before_flower_starts(overrides, message, tmp_path):
    cfg = make_cfg([*FAST, "transport=direct", *overrides])  # edge4: 4 nodes
    with pytest.raises(ValueError, match=message):
        run_job(cfg, tmp_path)
    assert not (tmp_path / "results.json").exists()


@pytest.mark.simulation
def test_malformed_stage_reply_fails_the_round_not_the_server(tmp_path, no_leftover_processes):
    """node2 (the last stage) replies to round 1 with weights of the wrong shape: the
    round fails naming it, the server keeps the last good model and round 2 runs."""
    cfg = make_cfg([*DIRECT, "num_rounds=2", "train.steps_per_round=2"])
    with open_dict(cfg):
        node = cfg.fleet.nodes[2]
        node.fail_on, node.fail_mode, node.fail_round = "train.sky_direct", "malformed", 1
    results = run_job(cfg, tmp_path)
    failed, good = results["rounds"]
    assert (
        failed["error"].startswith("round 1 failed: node2") and "has shape (1,)" in failed["error"]
    )
    assert good.get("error") is None and good["test_accuracy"] > 0
