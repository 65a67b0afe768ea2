"""The pure parts of table 3 of the deployment benchmark (no SuperLink)."""

from __future__ import annotations

import pytest

from sky_flower.bench.deployment import (
    accuracy_row,
    fedavg_owners,
    rounds_to_target,
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
    assert row["rounds_to_target"] == 2 and row["time_to_target_s"] == 50.0
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
        "time_to_target_s": 60.0,
        "samples_trained": 700,
        "run_wall_s": 100.0,
    }
    sky = {**fed, "time_to_target_s": 30.0, "rounds_to_target": 1, "samples_trained": 1050}
    sky.update(plan="a; b; c+helper", owner_samples=1050, load_avg=[7.0, 9.5])
    entry = {"owners": ["a", "b", "c"], "fedavg_owners": ["a", "b"], "fedavg": fed, "sky": sky}
    header, _, fed_line, sky_line = accuracy_table({"phone": entry}, 0.9)
    assert "rounds to 0.9" in header
    assert "alone: a, b" in fed_line and "700/1050 (67%)" in fed_line
    assert sky_line.endswith("| 2.00x |") and "(load 7.0 to 9.5)" in sky_line
