"""The example apps run with ``flwr run`` on Flower's simulation runtime, 4 SuperNodes
(a private SuperLink started by ``sky_flower.deploy --simulation``): the standard
FedAvg app and the same app switched to Sky (every SuperNode heading its own pipeline)."""

from pathlib import Path

import pytest

from sky_flower.deploy import round_accuracies, run_local

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUN_CONFIG = {
    "fedavg-app": "num-server-rounds=2",
    # the benchmark round at its cheapest (one timed pass, one echo per size, no state
    # probe): every message through the simulation runtime costs a ClientApp call
    "sky-app": (
        "num-server-rounds=2 steps-per-round=5 lr=0.003 "
        "benchmark-repeats=1 echo-repeats=1 state-probe-mb=0.0"
    ),
}


@pytest.mark.simulation
@pytest.mark.parametrize(
    "app",
    [
        # the plain Flower app Sky's diff starts from: the same `flwr run` path as the
        # sky-app's run (make test); its own run is in make test-all
        pytest.param("fedavg-app", marks=pytest.mark.slow),
        # make test runs Flower's quickstart-pytorch switched (below) on the same path
        pytest.param("sky-app", marks=pytest.mark.slow),
    ],
)
def test_app_runs_with_flwr_run_in_simulation(app, tmp_path, no_leftover_processes):
    text, pids, results = run_local(
        EXAMPLES / app,
        "edge4",
        simulation=True,
        run_config=RUN_CONFIG[app],
        workdir=tmp_path,
        timeout_s=480,
        echo=False,
    )
    assert "(4 simulated SuperNodes)" in text, text[-3000:]
    assert "Final results:" in text, text[-3000:]
    assert results["completed"] and not results["error"], results  # the app's results.json
    acc = round_accuracies(results)
    assert sorted(acc) == [0, 1, 2], text[-3000:]
    assert acc[2] > acc[0] + 0.2  # untrained: ~0.1
    if app == "sky-app":  # the same per-round table as `make run`, and the plan
        assert "Benchmark round:" in text and "Plan (heuristic):" in text
        assert results["initial_test_accuracy"] is not None
        assert [r["round"] for r in results["rounds"]] == [1, 2]
        assert all(r["measured_step_time_s"] > 0 for r in results["rounds"])
        owners = ["phone", "laptop", "cloud-gpu", "edge-box"]
        for node in owners:
            assert node in text
        # every SuperNode (node config: Flower's partition-id / num-partitions) owns its
        # partition and heads a pipeline, as every SuperNode trains in the FedAvg app; the
        # log and results.json say how many samples each trained (this run was also
        # test_federation.py's test_sky_app_under_flwr_run_trains_every_supernodes_partition)
        assert "one pipeline per data owner" in text, text[-3000:]
        for row in results["rounds"]:
            pipelines = row["pipelines"]
            assert sorted(p["owner"] for p in pipelines) == sorted(owners), pipelines
            assert all(p["samples_trained"] == 5 * 64 for p in pipelines), pipelines


@pytest.mark.simulation
@pytest.mark.parametrize(
    "app, rounds", [("quickstart-pytorch-sky", 2), ("quickstart-huggingface-sky", 1)]
)
def test_flowers_quickstart_apps_switched_run_with_flwr_run(
    app, rounds, tmp_path, monkeypatch, no_leftover_processes
):
    """Flower's quickstart-pytorch (DataLoaders over a flwr_datasets partition, its CNN)
    and quickstart-huggingface (a padding collator's dict batches, a transformers
    classifier) apps, switched to Sky, train under `flwr run`'s simulation runtime."""
    monkeypatch.setenv("SKY_FLOWER_CACHE", str(tmp_path / "cache"))  # the text app's model
    text, _, results = run_local(
        EXAMPLES / app,
        "edge4",
        simulation=True,
        run_config=f"num-server-rounds={rounds} steps-per-round=5",
        workdir=tmp_path,
        timeout_s=480,
        echo=False,
    )
    assert "(4 simulated SuperNodes)" in text, text[-3000:]
    assert results["completed"] and not results["error"], results
    rows = results["rounds"]
    assert [r["round"] for r in rows] == list(range(1, rounds + 1)), text[-3000:]
    for row in rows:  # every SuperNode's partition trained, through Sky's data owners
        assert sorted(p["samples_trained"] for p in row["pipelines"]) == [5 * 32] * 4, row
        assert row["train_loss"] > 0
    assert "Benchmark round:" in text and "Plan (heuristic):" in text, text[-3000:]
    assert "one pipeline per data owner" in text, text[-3000:]
    assert all(r["measured_step_time_s"] > 0 for r in rows)
    owners = ["phone", "laptop", "cloud-gpu", "edge-box"]  # every SuperNode heads one
    assert all(sorted(p["owner"] for p in r["pipelines"]) == sorted(owners) for r in rows)
    if app == "quickstart-pytorch-sky":  # the app's own evaluate_fn, on the app's keys
        acc = round_accuracies(results)
        assert acc[rounds] > acc[0] + 0.2, acc  # untrained: ~0.1
