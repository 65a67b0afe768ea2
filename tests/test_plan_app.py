"""The planner app: `python -m sky_flower.plan` (no Flower, no Ray)."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from inprocess_cli import hydra_main

from sky_flower.core.partition import InfeasibleMemoryError
from sky_flower.plan import build_planning_problem, plan_job
from sky_flower.run import _conf_dir

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["fleet.nodes=4", "model.num_layers=4"]  # BERT: 1 + 3 x 4 + 2 = 15 entries


def _cfg(overrides):
    with initialize_config_dir(config_dir=_conf_dir(), version_base="1.3"):
        return compose("plan", overrides=overrides)


def _cli(args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "sky_flower.plan", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _check_stages(plan, entries, owner="node0"):
    stages = plan["stages"]
    assert stages[0]["node"] == owner
    assert stages[0]["first_layer"] == 0 and stages[-1]["last_layer"] == entries - 1
    for prev, nxt in zip(stages, stages[1:], strict=False):
        assert nxt["first_layer"] == prev["last_layer"] + 1
    assert all(s["memory_bytes"] <= s["memory_capacity_bytes"] for s in stages)
    nodes = [s["node"] for s in stages]
    assert len(set(nodes)) == len(nodes)


@pytest.mark.parametrize("allocation", ["even", "heuristic", "optimal"])
def test_each_allocation_writes_a_valid_plan(tmp_path, allocation):
    cfg = _cfg([*SMALL, f"allocation={allocation}"])
    result = plan_job(cfg, tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan == json.loads(json.dumps(result["plan"]))
    assert plan["method"] == allocation and plan["objective"] == "step"
    assert plan["problem"]["entries"] == 15 and len(plan["problem"]["nodes"]) == 4
    assert plan["schedule"] == {
        "batch_size": 32,
        "microbatches": 1,
        "kind": "gpipe",
        "transport": "direct",
    }
    assert plan["alternatives"] is None  # plan.compare_methods defaults to false
    for key in ("predicted_step_time_s", "period_s", "lower_bound_s", "solve_time_s"):
        assert plan[key] >= 0
    assert plan["predicted_step_time_s"] >= plan["lower_bound_s"] * (1 - 1e-9)
    _check_stages(plan, 15)
    row = json.loads((tmp_path / "plan_row.json").read_text())
    assert row["status"] == "ok" and row["nodes"] == 4 and row["num_layers"] == 4
    assert (tmp_path / "plan.txt").read_text().startswith("stage")


def test_compare_methods_and_keys(tmp_path):
    cfg = _cfg(
        [
            *SMALL,
            "allocation=heuristic",
            "plan.compare_methods=true",
            "objective=throughput",
            "schedule.microbatches=4",
            "schedule.kind=1f1b",
        ]
    )
    plan = plan_job(cfg, tmp_path)["plan"]
    assert plan["objective"] == "throughput"
    assert plan["schedule"]["microbatches"] == 4 and plan["schedule"]["kind"] == "1f1b"
    assert set(plan["alternatives"]) == {"even", "optimal"}
    for alt in plan["alternatives"].values():
        assert alt["error"] is None and alt["predicted_step_time_s"] > 0
        assert alt["period_s"] >= alt["lower_bound_s"] * (1 - 1e-9)
    # the heuristic's period is no better than optimal's
    assert plan["period_s"] >= plan["alternatives"]["optimal"]["period_s"] * (1 - 1e-9)


def test_one_microbatch_gpipe_is_sequential():
    from sky_flower.core.cost import CostModel

    # on the relay: sequential does not run on direct (refused, as the training job does)
    gp = build_planning_problem(_cfg([*SMALL, "schedule.transport=relay"]))
    sq = build_planning_problem(
        _cfg([*SMALL, "schedule.kind=sequential", "schedule.transport=relay"])
    )
    stages = [(0, 0, 4), (1, 5, 9), (2, 10, 14)]
    a, b = CostModel(*gp), CostModel(*sq)
    assert a.step_time(stages) == pytest.approx(b.step_time(stages))


def test_mlp_on_edge4_times_layers_on_this_host(tmp_path):
    cfg = _cfg(["model=mlp", "fleet=edge4", "benchmark.repeats=2"])
    layers, nodes, schedule = build_planning_problem(cfg)
    assert len(layers) == 9 and [n.name for n in nodes][0] == "phone"
    slow = {n.name: n.slowdown for n in nodes}
    # node times are the host's times x (1 + slowdown)
    ratio = nodes[0].layer_fwd_s[1] / nodes[2].layer_fwd_s[1]
    assert ratio == pytest.approx((1 + slow["phone"]) / (1 + slow["cloud-gpu"]))
    assert nodes[0].memory_bytes == 48 * 2**20
    plan = plan_job(cfg, tmp_path)["plan"]
    _check_stages(plan, 9, owner="phone")
    assert plan["problem"]["node_times_from"].startswith("host timing")


def test_bad_input_is_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match="microbatches=5 must divide"):
        plan_job(_cfg([*SMALL, "schedule.microbatches=5"]), tmp_path)
    assert json.loads((tmp_path / "plan_row.json").read_text())["status"] == "error"
    with pytest.raises(ValueError, match="unknown objective"):
        plan_job(_cfg([*SMALL, "objective=fast"]), tmp_path)
    # what the training job refuses, the planner refuses in the same words
    with pytest.raises(ValueError, match="sequential runs on transport=relay and stream"):
        plan_job(_cfg([*SMALL, "schedule.kind=sequential"]), tmp_path)
    with pytest.raises(ValueError, match="zero_bubble runs on schedule.transport=direct only"):
        plan_job(_cfg([*SMALL, "schedule.kind=zero_bubble", "schedule.transport=relay"]), tmp_path)
    with pytest.raises(ValueError, match="flops_per_s"):
        plan_job(_cfg(["fleet=edge4", "model.num_layers=2"]), tmp_path)
    with pytest.raises(ValueError, match=r"fleet.nodes must be in \[1, 10000\]"):
        plan_job(_cfg([*SMALL, "fleet.nodes=1000000000"]), tmp_path)
    with pytest.raises(ValueError, match="too large to profile"):
        plan_job(_cfg(["model=mlp", "fleet=edge4", "schedule.batch_size=100000"]), tmp_path)


def test_infeasible_memory_in_process(tmp_path):
    with pytest.raises(InfeasibleMemoryError, match="infeasible memory budget"):
        plan_job(_cfg([*SMALL, "fleet.memory_mb=1"]), tmp_path)
    row = json.loads((tmp_path / "plan_row.json").read_text())
    assert row["status"] == "infeasible" and "MiB" in row["error"]
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.processes
@pytest.mark.slow  # the sweep test below shows the same refusal through the CLI
def test_cli_infeasible_memory_exits_nonzero(tmp_path):
    out = tmp_path / "run"
    proc = _cli([*SMALL, "fleet.memory_mb=1", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode != 0
    assert "InfeasibleMemoryError" in proc.stderr + proc.stdout
    assert "infeasible memory budget" in proc.stderr + proc.stdout


@pytest.mark.processes
def test_cli_multirun_writes_csv_and_png(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _cli(
        [
            "-m",
            "fleet.nodes=4,8",
            "model.num_layers=4",
            "allocation=even,heuristic",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert str(sweep / "plan_sweep.csv") in proc.stdout
    rows = list(csv.DictReader((sweep / "plan_sweep.csv").open()))
    assert len(rows) == 4
    assert {(r["nodes"], r["allocation"]) for r in rows} == {
        ("4", "even"),
        ("4", "heuristic"),
        ("8", "even"),
        ("8", "heuristic"),
    }
    assert all(r["status"] == "ok" and r["entries"] == "15" for r in rows)
    for r in rows:
        assert float(r["predicted_step_time_s"]) >= float(r["lower_bound_s"]) * (1 - 1e-9)
    png = (sweep / "plan_sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    for job in range(4):  # each job's own plan, not a previous job's
        plan = json.loads((sweep / str(job) / "plan.json").read_text())
        assert plan["method"] == rows[job]["allocation"]
        assert len(plan["problem"]["nodes"]) == int(rows[job]["nodes"])


def test_cli_multirun_infeasible_job_is_a_row_and_the_sweep_goes_on(tmp_path, capsys):
    """The entry point's ``main()`` in process (``python -m sky_flower.plan -m`` as a
    process: the test above)."""
    from sky_flower import plan

    sweep = tmp_path / "sweep"
    argv = ["-m", *SMALL, "fleet.memory_mb=1,8192", f"hydra.sweep.dir={sweep}"]
    status = hydra_main(plan.main, argv)
    assert status == 0, capsys.readouterr().err[-2000:]  # infeasible is a result, not a crash
    rows = list(csv.DictReader((sweep / "plan_sweep.csv").open()))
    assert [r["status"] for r in rows] == ["infeasible", "ok"]
    assert "infeasible memory budget" in rows[0]["error"]


def test_a_fleet_with_several_data_owners_previews_one_pipeline_per_owner(tmp_path):
    """As the training job plans it: each owner heads its own pipeline (FedAvg across)."""
    plan = plan_job(_cfg(["model=mlp", "fleet=edge4"]), tmp_path)["plan"]
    pipelines = plan["pipelines"]
    owners = [p["owner"] for p in pipelines]
    assert sorted(owners) == ["edge-box", "phone"]
    for p in pipelines:
        assert p["stages"][0][:2] == [p["owner"], 0]  # the owner is stage 0, from layer 0
        assert p["stages"][-1][2] == 8 and p["predicted_step_time_s"] > 0
    single = plan_job(_cfg([*SMALL]), tmp_path / "one")["plan"]
    assert single["pipelines"] is None  # one data owner: the pipeline above is the plan
