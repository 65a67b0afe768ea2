"""Sky under the deployment engine's message semantics, in this process (fast, no
engine): every message handled by a fresh ClientApp whose context was carried over only
as protobuf bytes. Three stages (``even`` on edge3), two micro-batches, two rounds: the
global model after each round equals the unsplit model trained on the same batches."""

import numpy as np
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from reference import SKY_APP, ProcessPerMessageGrid, reference_rounds, sky_app_task

from sky_flower.app import load_fleet, register_sky_client, sky_strategy
from sky_flower.deploy import app_run_config, node_config

RUN = {
    "fleet": "edge3",
    "allocation": "even",
    "num-server-rounds": 2,
    "steps-per-round": 3,
    "microbatches": 2,
    "benchmark-repeats": 1,
    "echo-repeats": 1,
    "state-probe-mb": 0.0,
}


def test_relay_with_a_fresh_clientapp_per_message_equals_unsplit_training(monkeypatch):
    for attr, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)  # as a ServerApp process has them
    task = sky_app_task()
    run_config = {**app_run_config(SKY_APP), **RUN}
    fleet = load_fleet("edge3")
    # the node configs the launcher gives its SuperNodes, parsed as flower-supernode does
    node_configs = [parse_config_args([node_config(n, i, len(fleet))]) for i, n in enumerate(fleet)]

    def fresh_app() -> ClientApp:
        return register_sky_client(ClientApp(), model_fn=task.Net, load_data=task.load_data)

    grid = ProcessPerMessageGrid(fresh_app, node_configs, run_config)
    strategy = sky_strategy(run_config, model_fn=task.Net, input_shape=[64])
    strategy.echo_jitter_s = 0.0
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()), num_rounds=2
    )
    assert len(strategy.plan.stages) == 3
    assert ("train.sky_backward" in {t for _, t in grid.handled}) and len(strategy.rounds) == 2

    expected = reference_rounds(
        task.Net,
        task.load_data(0, 3),
        rounds=2,
        steps=3,
        lr=float(run_config["lr"]),
        microbatches=2,
    )
    for row, (_, losses) in zip(strategy.rounds, expected, strict=True):
        assert abs(row["train_loss"] - float(np.mean(losses))) < 1e-5, (row, losses)
    got = result.arrays.to_torch_state_dict()
    for key, value in expected[-1][0].items():
        np.testing.assert_allclose(got[key].numpy(), value.numpy(), rtol=1e-4, atol=1e-6)
