"""Results are data: a Sky run under ``flwr run`` semantics (in this process, a fresh
ClientApp per message) writes ``results.json`` at the run config's ``results-path``, in
the Hydra job's structure; the launcher reads accuracies from it (fast, no engine)."""

import json

from flwr.app import ArrayRecord, MetricRecord
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from reference import ProcessPerMessageGrid, sky_app_run_config, sky_app_task

from sky_flower.app import load_fleet, register_sky_client, sky_strategy
from sky_flower.deploy import node_config, round_accuracies
from sky_flower.jobs.common import ROUND_KEYS

RUN = {
    "fleet": "edge3",
    "allocation": "even",
    "num-server-rounds": 2,
    "steps-per-round": 2,
    "benchmark-repeats": 1,
    "echo-repeats": 1,
    "state-probe-mb": 0.0,
}


def test_flwr_run_writes_the_hydra_jobs_results_json(monkeypatch, tmp_path):
    for attr, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)  # as a ServerApp process has them
    task = sky_app_task()
    path = tmp_path / "results.json"
    run_config = {**sky_app_run_config(), **RUN, "results-path": str(path)}
    fleet = load_fleet("edge3")
    node_configs = [parse_config_args([node_config(n, i, len(fleet))]) for i, n in enumerate(fleet)]

    def fresh_app() -> ClientApp:
        return register_sky_client(ClientApp(), model_fn=task.Net, load_data=task.load_data)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = task.Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = task.test(model, task.load_test())
        return MetricRecord({"accuracy": acc, "loss": loss})

    grid = ProcessPerMessageGrid(fresh_app, node_configs, run_config)
    strategy = sky_strategy(run_config, model_fn=task.Net, input_shape=[64])
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(task.initial_weights()),
        num_rounds=2,
        evaluate_fn=evaluate,
    )
    saved = json.loads(path.read_text())
    assert saved["completed"] and saved["error"] is None and saved["failed_rounds"] == []
    assert (saved["allocation"], saved["fleet"]) == ("even", "edge3")
    assert [r["round"] for r in saved["rounds"]] == [1, 2]
    assert all(set(r) == set(ROUND_KEYS) for r in saved["rounds"])
    assert all(r["measured_step_time_s"] > 0 and r["steps"] == 2 for r in saved["rounds"])
    # nothing frozen: every round's replies carried the whole model (full fine-tuning)
    full = ArrayRecord(task.initial_weights()).count_bytes()
    assert all(r["weights_sent_bytes"] == r["full_weights_bytes"] == full for r in saved["rounds"])
    initial = float(result.evaluate_metrics_serverapp[0]["accuracy"])
    assert saved["initial_test_accuracy"] == initial
    assert saved["final_test_accuracy"] == saved["rounds"][-1]["test_accuracy"]
    assert round_accuracies(saved) == {
        0: initial,
        **{r["round"]: r["test_accuracy"] for r in saved["rounds"]},
    }
    # the app's own save_results (identical in both example apps) keeps Sky's record
    task.save_results(run_config, result)
    assert json.loads(path.read_text())["rounds"] == saved["rounds"]


def test_the_example_apps_save_results_writes_strict_json_when_a_metric_is_nan(tmp_path):
    """A diverged run's NaN / inf metrics become ``null``: the file parses strictly."""
    from types import SimpleNamespace

    task = sky_app_task()
    path = tmp_path / "results.json"
    result = SimpleNamespace(
        evaluate_metrics_serverapp={
            0: {"accuracy": 0.1, "loss": 2.3},
            1: {"accuracy": float("nan"), "loss": float("inf")},
        }
    )
    task.save_results({"results-path": str(path)}, result)

    def refuse(token: str) -> None:
        raise AssertionError(f"not strict JSON: {token}")

    saved = json.loads(path.read_text(), parse_constant=refuse)
    assert saved["initial_test_accuracy"] == 0.1
    assert saved["rounds"] == [{"round": 1, "test_accuracy": None, "test_loss": None}]
    assert saved["final_test_accuracy"] is None


def test_results_json_schema_is_pinned_and_written_from_the_records(tmp_path):
    """``results.json``'s keys (issue 43 pins them): written from the records' ``to_dict``
    alone, ``failed_rounds``, ``replans`` and ``joins`` entries as the dicts they were."""
    from sky_flower.jobs.common import SkyRecorder
    from sky_flower.sky.planning.replan import ReplanRecord
    from sky_flower.sky.rounds.hooks import RoundEnd, RunEnd, RunRecords
    from sky_flower.sky.rounds.records import FailedRound, JoinRecord, RoundRecord

    trained = RoundRecord(2, 1.5, train_loss=0.5, train_accuracy=0.75, test={"accuracy": 0.5})
    records = RunRecords(
        rounds=(RoundRecord(1, 1.0, error="round 1 failed: box"), trained),
        failed_rounds=(FailedRound(1, "box", ["box"], set_aside=None),),
        replans=(ReplanRecord(1.0, False, after_round=2, drift="", joined=[], reason="drift"),),
        joins=(JoinRecord(2, "fast", 104), JoinRecord(2, "box", 7, rejoined=True, admitted=True)),
    )
    recorder = SkyRecorder(tmp_path / "results.json", "even", "edge3")
    recorder.on_round(RoundEnd(trained, records))
    recorder.on_end(RunEnd(records, None))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert list(saved) == [
        "allocation",
        "fleet",
        "initial_test_accuracy",
        "final_test_accuracy",
        "rounds",
        "error",
        "failed_rounds",
        "replans",
        "joins",
        "completed",
    ]
    assert all(list(r) == list(ROUND_KEYS) for r in saved["rounds"])
    assert saved["rounds"][1]["test_accuracy"] == saved["final_test_accuracy"] == 0.5
    assert saved["failed_rounds"] == [{"round": 1, "error": "box", "dropped_nodes": ["box"]}]
    assert saved["joins"] == [
        {"round": 2, "node": "fast", "node_id": 104},
        {"round": 2, "node": "box", "node_id": 7, "rejoined": True, "admitted": True},
    ]
    assert saved["replans"] == [
        {
            "measured_round_s": 1.0,
            "forced": False,
            "after_round": 2,
            "drift": "",
            "joined": [],
            "reason": "drift",
        }
    ]
    assert saved["completed"] is True and saved["error"] is None
