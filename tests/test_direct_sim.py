"""``transport=direct`` end to end in Flower's simulation engine (Ray): every stage of a
round runs at once and trains peer to peer through torch.distributed.pipelining. One
engine run (a Ray start-up is tens of seconds on 2 cores) holds its faults and its
equivalence to unsplit training; settings refused before Flower starts run without Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import open_dict
from simhelpers import FAST, make_cfg, reference_weights

from sky_flower.pipeline.models import build_model
from sky_flower.run import run_job

DIRECT = [*FAST, "transport=direct", "fleet=uniform3", "allocation=even"]


@pytest.mark.simulation
def test_direct_faults_are_named_and_the_rounds_between_equal_unsplit_training(
    tmp_path, no_leftover_processes
):
    """The direct transport under Ray, in one run of the engine (3 stages, GPipe, 4
    micro-batches peer to peer, 4 rounds of 2 steps):

    - round 1: node1 (stage 1) stalls before step 1: the round ends for all stages within
      the 10 s peer timeout (not the 120 s message one), its error naming node1 first and
      the stages that saw their peer fail or stall;
    - round 2 trains from the last good (initial) model: after it the global model equals
      the unsplit model trained on the data owner's batches of round 2;
    - round 3: node2 (the last stage) replies with weights of the wrong shape: the round
      fails naming it, the server keeps round 2's model;
    - round 4 trains from round 2's model: the final model equals unsplit training of
      round 4's batches from round 2's reference weights; no process is left behind.

    (Its crash mode and 1F1B are checked in process: tests/test_direct.py,
    tests/test_process_per_message.py.) SGD for the equality: see
    tests/test_simulation.py's relay test for the derived bound (atol 1e-5)."""
    M, steps, lr = 4, 2, 0.05
    cfg = make_cfg(
        [
            *DIRECT,
            "schedule.kind=gpipe",
            f"schedule.microbatches={M}",
            "num_rounds=4",
            f"train.steps_per_round={steps}",
            "train.optimizer=sgd",
            f"train.lr={lr}",
            # 10 s: the stalled round ends within it; the good rounds' peer operations
            # must not hit it on a loaded machine (5 s did: a good round timed out)
            "direct.timeout_s=10",
        ]
    )
    with open_dict(cfg):
        stall, bad = cfg.fleet.nodes[1], cfg.fleet.nodes[2]
        stall.fail_on, stall.fail_mode, stall.fail_round, stall.fail_step = (
            "train.sky_direct",
            "stall",
            1,
            1,
        )
        bad.fail_on, bad.fail_mode, bad.fail_round = "train.sky_direct", "malformed", 3
    results = run_job(cfg, tmp_path)
    assert results["error"] is None
    first, good, third, last = results["rounds"]
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3, 4]

    assert first.get("test_accuracy") is None
    error = first["error"]
    assert error.startswith("round 1 failed: stage 1 on node1") and "stalled" in error
    assert "stage 0 on node0" in error and "peer stage failed or stalled" in error
    assert first["round_time_s"] < 60  # bounded by the 10 s timeout, not the 120 s one

    assert good.get("error") is None and good["test_accuracy"] > 0
    assert good["setup_s"] > 0 and good["measured_step_time_s"] > 0

    assert third["error"].startswith("round 3 failed: node2"), third["error"]
    assert "has shape (1,)" in third["error"]

    assert last.get("error") is None and last["test_accuracy"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["final_test_accuracy"] == last["test_accuracy"]

    torch.manual_seed(int(cfg.seed))
    initial = build_model(dict(cfg.model)).state_dict()
    after_2 = reference_weights(cfg, steps, M, rnd=2, weights=initial)
    after_4 = reference_weights(cfg, steps, M, rnd=4, weights=after_2)
    moved = max(float((after_4[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 100 * 1e-5
    split = torch.load(tmp_path / "model.pt")
    for k, v in after_4.items():
        np.testing.assert_allclose(split[k].numpy(), v.numpy(), rtol=0, atol=1e-5, err_msg=k)


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
