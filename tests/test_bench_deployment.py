"""The pure parts of tables 3 and 4 of the deployment benchmark (no SuperLink)."""

from __future__ import annotations

import pytest

from sky_flower.bench.deployment import (
    accuracy_row,
    best_fedavg,
    fedavg_owners,
    log_marks,
    rounds_table,
    rounds_to_target,
    session_summary,
    time_to_target,
    training_bytes,
)
from sky_flower.core.profile import LayerProfile
from sky_flower.emulation.devices import MIB, Emulation


def _layer(i: int, params: int, state: int, stash: float | None, out: float) -> LayerProfile:
    return LayerProfile(i, f"{i}:x", 1.0, 1.0, params, state, 4.0, out, stash)


def test_training_bytes_counts_weights_gradients_state_and_the_batch_stash():
    layers = [_layer(0, 100, 200, 10.0, 99.0), _layer(1, 50, 100, None, 7.0)]
    # static: 2 x 100 + 200 + 2 x 50 + 100; stash: 10 (measured) + 7 (output, unmeasured)
    assert training_bytes(layers, 32) == 600 + 32 * 17


def test_training_bytes_matches_the_cost_models_whole_model_stage():
    from sky_flower.core.cost import CostModel, Schedule
    from sky_flower.core.profile import NodeProfile

    layers = [_layer(0, 100, 200, 10.0, 99.0), _layer(1, 50, 100, None, 7.0)]
    node = NodeProfile("n", (0.1, 0.1), (0.1, 0.1), 10**9, holds_data=True)
    cost = CostModel(layers, [node], Schedule(32, 4))
    assert training_bytes(layers, 32) == pytest.approx(cost.stage_memory(0, 1))


def test_fedavg_uses_only_owners_whose_memory_holds_the_model():
    fleet = [
        Emulation("phone", holds_data=True, memory_mb=1.0),
        Emulation("laptop", holds_data=True),
        Emulation("box", holds_data=True, memory_mb=4.0),
        Emulation("helper", memory_mb=64.0),
    ]
    assert fedavg_owners(fleet, 2.5 * MIB) == ["laptop", "box"]
    assert fedavg_owners(fleet, 0.5 * MIB) == ["phone", "laptop", "box"]
    assert fedavg_owners(fleet, 8 * MIB) == ["laptop"]


def test_rounds_and_time_to_target():
    rows = [
        {"round": 1, "test_accuracy": 0.7, "round_time_s": 10.0},
        {"round": 2, "test_accuracy": None, "round_time_s": 12.0},
        {"round": 3, "test_accuracy": 0.9, "round_time_s": 11.0},
        {"round": 4, "test_accuracy": 0.95, "round_time_s": 9.0},
    ]
    accs = [r["test_accuracy"] for r in rows]
    assert rounds_to_target(accs, 0.9) == 3  # reaching the target exactly counts
    assert rounds_to_target(accs, 0.95) == 4
    assert rounds_to_target(accs, 0.99) is None
    assert rounds_to_target([0.5, 0.8999999761581421], 0.9) == 2  # float32 324/360
    assert rounds_to_target([0.5, 0.8999], 0.9) is None
    assert time_to_target(rows, 0.9) == 33.0
    assert time_to_target(rows, 0.6) == 10.0
    assert time_to_target(rows, 0.99) is None


def test_accuracy_row_reads_a_sky_results_file():
    res = {
        "rounds": [
            {
                "round": 2,
                "test_accuracy": 0.93,
                "round_time_s": 20.0,
                "samples_trained": 1000,
                "pipelines": [],
            },
            {
                "round": 1,
                "test_accuracy": 0.8,
                "round_time_s": 30.0,
                "samples_trained": 1000,
                "pipelines": [
                    {"nodes": ["a"], "samples": 500},
                    {"nodes": ["c", "helper"], "samples": 520},
                ],
            },
        ]
    }
    row = accuracy_row(res, 0.9)
    assert row["rounds_to_target"] == 2 and row["rounds_sum_to_target_s"] == 50.0
    assert row["plan"] == "a; c+helper" and row["owner_samples"] == 1020
    assert row["accuracies"] == [0.8, 0.93] and row["error"] is None


def test_accuracy_row_of_a_run_without_rounds_names_the_error():
    assert accuracy_row({"error": "boom", "rounds": []}, 0.9) == {"error": "boom"}
    assert "no rounds" in accuracy_row(None, 0.9)["error"]


def test_accuracy_table_puts_fedavg_over_sky_on_the_sky_row():
    from sky_flower.bench.deployment import accuracy_table

    fed = {
        "accuracies": [0.8, 0.92],
        "round_times_s": [30.0, 30.0],
        "rounds_to_target": 2,
        "time_to_target_s": 90.0,
        "rounds_sum_to_target_s": 60.0,
        "round1_start_s": 25.0,
        "samples_trained": 700,
        "run_wall_s": 100.0,
    }
    fed2 = {**fed, "time_to_target_s": 60.0}
    sky = {**fed, "time_to_target_s": 30.0, "rounds_to_target": 1, "samples_trained": 1050}
    sky.update(plan="a; b; c+helper", owner_samples=1050, load_avg=[7.0, 9.5])
    entry = {
        "owners": ["a", "b", "c"],
        "fedavg_owners": ["a", "b"],
        "fedavg_e1": fed,
        "fedavg_e2": fed2,
        "sky": sky,
    }
    assert best_fedavg(entry) == "fedavg_e2"
    header, _, fed_line, fed2_line, sky_line = accuracy_table({"phone": entry}, 0.9)
    assert "rounds to 0.9" in header and "from launch" in header
    assert "alone: a, b" in fed_line and "700/1050 (67%)" in fed_line
    assert "| 90.0 s | 25 s | 60.0 s |" in fed_line
    assert "2 epoch(s) (best FedAvg)" in fed2_line
    assert sky_line.endswith("| 3.00x (1 ep); 2.00x (2 ep, best) |")
    assert "(load 7.0 to 9.5)" in sky_line


def test_log_marks_reads_sky_and_flower_round_lines():
    green = "\x1b[92mINFO \x1b[0m:      "
    sky = [
        (5.0, green + "Starting SkyStrategy strategy:"),
        (40.0, green + "round  train loss   test acc  step time (s)   predicted (s)  round (s)"),
        (52.0, green + "    1      1.2345     0.8123         0.0712          0.1010      11.9"),
        (60.0, green + "    2      0.5432     0.9012         0.0700          0.1010       7.9"),
        (61.0, "    0  phone            479      7    0.1791     0.000     0.895  -      phone"),
    ]
    marks = log_marks(sky)
    assert marks["strategy_start_s"] == 5.0 and marks["round1_start_s"] == 40.0
    assert marks["evaluated_s"] == {1: 52.0, 2: 60.0}
    flower = [
        (3.0, "INFO :      Starting CountingFedAvg strategy:"),
        (4.0, "INFO :      [ROUND 1/2]"),
        (9.0, "INFO :      \t└──> Aggregated MetricRecord: {'train_loss': 1.0}"),
        (9.5, "INFO :      Global evaluation"),
        (10.0, "INFO :      \t└──> MetricRecord: {'accuracy': 0.8}"),
        (11.0, "INFO :      [ROUND 2/2]"),
        (16.0, "INFO :      Global evaluation"),
        (17.0, "INFO :      \t└──> MetricRecord: {'accuracy': 0.9}"),
    ]
    marks = log_marks(flower)
    assert marks["strategy_start_s"] == 3.0 and marks["round1_start_s"] == 4.0
    assert marks["evaluated_s"] == {1: 10.0, 2: 17.0}


def _round(r: int, t: float, pred: float, step: float, msgs: int, setup: float = 0.0) -> dict:
    return {
        "round": r,
        "round_time_s": t,
        "predicted_round_time_s": pred,
        "measured_step_time_s": step,
        "predicted_step_time_s": 0.1,
        "flower_messages": msgs,
        "setup_s": setup,
        "session_round": r,
        "steps": 7,
    }


def test_session_summary_sets_round_one_apart_from_the_steady_state():
    rows = [
        _round(3, 1.2, 1.0, 0.11, 0),
        _round(1, 20.0, 1.0, 0.12, 3, setup=18.0),
        _round(2, 1.0, 1.0, 0.2, 0),
        _round(4, 1.4, 1.0, 0.1, 0),
    ]
    s = session_summary(rows)
    assert s["round1_s"] == 20.0 and s["round1_setup_s"] == 18.0 and s["round1_messages"] == 3
    assert s["steady_rounds"] == 3 and s["steady_round_s"] == 1.2
    assert s["steady_messages"] == (0, 0)
    assert s["steady_round_ratio"] == pytest.approx(1.2)
    assert s["steady_round_within_25"] == 2  # 1.0 and 1.2, not 1.4
    assert s["steady_step_within_25"] == 2  # 1.1 and 1.0, not 2.0
    assert s["step_ratio_range"] == pytest.approx((1.0, 2.0))
    entry = {"sessions": {**s, "run_wall_s": 80.0}, "simulation": {**s, "run_wall_s": 90.0}}
    entry["simulation"]["steady_round_s"] = 1.0
    lines = rounds_table({"edge3": entry})
    assert "| edge3 | deployed, sessions | 20.0 s (18.0 s, 3) | 1.20 s | 0 |" in lines[2]
    assert "| 1.20x | 80 s |" in lines[2]


def test_session_summary_of_a_run_without_rounds():
    s = session_summary([])
    assert s["round1_s"] is None and s["steady_round_s"] is None and s["steady_rounds"] == 0


def test_the_probe_apps_import_as_flower_apps(tmp_path, monkeypatch):
    """The bench's two apps (``examples/hop-probe``; ``examples/fedavg-probe`` as
    :func:`fedavg_probe` assembles it) load the way ``flwr run`` loads them: their
    pyproject's components name a ServerApp and a ClientApp."""
    import importlib
    import tomllib

    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    from sky_flower.bench.deployment import EXAMPLES, fedavg_probe

    for app in (EXAMPLES / "hop-probe", fedavg_probe(tmp_path / "fedavg-probe")):
        monkeypatch.syspath_prepend(str(app))
        components = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
        for key, cls in (("serverapp", ServerApp), ("clientapp", ClientApp)):
            module, name = components["components"][key].split(":")
            assert isinstance(getattr(importlib.import_module(module), name), cls), (app, key)
