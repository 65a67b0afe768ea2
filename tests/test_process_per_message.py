"""Sky under the deployment engine's message semantics, in this process (fast, no
engine): every message handled by a fresh ClientApp whose context was carried over only
as protobuf bytes (``tests/reference.py``). Split training, relay (sequential and
pipelined) and direct, equals the unsplit model trained on the same batches
(``reference_rounds``)."""

import numpy as np
import pytest
from reference import (
    ConcurrentGrid,
    ProcessPerMessageGrid,
    assert_pipelined_relay_row,
    reference_rounds,
    run_sky_app,
    sky_app_on_grid,
    sky_app_run_config,
    sky_app_task,
)
from sky_flower.strategies.sky import SkyNodeError

QUICK = {"benchmark-repeats": 1, "echo-repeats": 1, "state-probe-mb": 0.0, "allocation": "even"}


def _expected(run: dict, fleet_size: int = 3) -> list:
    """``reference_rounds`` for the sky-app run ``run`` (its data owner's partition)."""
    task = sky_app_task()
    run = {**sky_app_run_config(), **run}
    return reference_rounds(
        task.Net,
        task.load_data(0, fleet_size),
        rounds=int(run["num-server-rounds"]),
        steps=int(run["steps-per-round"]),
        lr=float(run["lr"]),
        batch_size=int(run["batch-size"]),
        microbatches=int(run["microbatches"]),
        weights=task.initial_weights(),
    )


def _assert_weights(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key].numpy(), value.numpy(), rtol=1e-4, atol=1e-6)


def test_relay_with_a_fresh_clientapp_per_message_equals_unsplit_training(server_identity):
    """Three stages (``even`` on edge3), two micro-batches, two rounds: the global model
    and the mean train loss after each round equal unsplit training's."""
    run = {**QUICK, "fleet": "edge3", "num-server-rounds": 2, "steps-per-round": 3}
    run |= {"microbatches": 2}
    strategy, result, grid = run_sky_app(ProcessPerMessageGrid, run)
    assert len(strategy.plan.stages) == 3
    assert ("train.sky_backward" in {t for _, t in grid.handled}) and len(strategy.rounds) == 2
    expected = _expected(run)
    for row, (_, losses) in zip(strategy.rounds, expected, strict=True):
        assert abs(row.train_loss - float(np.mean(losses))) < 1e-5, (row, losses)
    _assert_weights(result.arrays.to_torch_state_dict(), expected[-1][0])


@pytest.mark.parametrize(("kind", "per_message"), [("gpipe", 1), ("1f1b", 2)])
def test_pipelined_relay_equals_unpipelined(kind, per_message, server_identity):
    """The pipelined relay (3 stages, 4 micro-batches in flight in groups of
    ``per_message``, gradients accumulated across messages) gives the weights of
    unpipelined training with the same micro-batch split after 3 steps; every stage
    handled the planned number of messages and reported its compute. (The Ray
    version of the 1f1b case is in tests/test_simulation.py.)"""
    run = {**QUICK, "fleet": "uniform3", "num-server-rounds": 1, "steps-per-round": 3}
    run |= {"microbatches": 4, "schedule-kind": kind, "microbatches-per-message": per_message}
    strategy, result, _ = run_sky_app(ProcessPerMessageGrid, run)
    _assert_weights(result.arrays.to_torch_state_dict(), _expected(run)[-1][0])
    (row,) = strategy.rounds
    assert row.error is None
    assert_pipelined_relay_row(row.to_dict(), per_message, 4)


@pytest.mark.processes
@pytest.mark.parametrize(
    "kind",
    [  # through the strategy on direct in make test: gpipe under Ray in
        # tests/test_direct_sim.py, 1f1b in tests/test_federation.py (three owners)
        pytest.param("gpipe", marks=pytest.mark.slow),
        pytest.param("1f1b", marks=pytest.mark.slow),
        "zero_bubble",
    ],
)
def test_direct_training_equals_local_training(kind, server_identity):
    """transport=direct, every stage in its own process at once, peer to peer: weights
    after 3 steps through 3 stages (4 micro-batches) equal those of the unsplit model
    trained on the same batches and micro-batches. (The Ray version of the gpipe case
    is in tests/test_direct_sim.py.) zero_bubble: one chunk per stage (the 4-layer
    model has too few layers for 2 x 3), sent as the chunk fields of DirectConfig; the
    engine's several chunks per rank: tests/test_direct.py."""
    run = {**QUICK, "fleet": "uniform3", "num-server-rounds": 1, "steps-per-round": 3}
    run |= {"transport": "direct", "schedule-kind": kind, "microbatches": 4}
    run |= {"schedule-chunks": 1}
    run |= {"direct-timeout-s": 20.0, "direct-join-timeout-s": 30.0}
    strategy, result, _ = run_sky_app(ConcurrentGrid, run)
    (row,) = strategy.rounds
    assert row.error is None, row
    assert row.setup_s > 0 and row.measured_step_time_s > 0
    assert [s.node for s in row.stages] == ["node0", "node1", "node2"]
    assert strategy.plan.schedule["kind"] == kind
    _assert_weights(result.arrays.to_torch_state_dict(), _expected(run)[-1][0])


def test_malformed_node_reply_ends_run_naming_the_node(server_identity):
    """box (the last stage) replies to its forward messages with arrays of the wrong
    shape: round 1 fails naming it, and with max-failed-rounds=1 the run ends; round 2
    never starts. (A node that raises is the Ray version: tests/test_simulation.py.)"""
    run = {**QUICK, "fleet": "edge3", "num-server-rounds": 2, "steps-per-round": 2}
    run["max-failed-rounds"] = 1
    fault = {"sky-fail-on": "train.sky_forward", "sky-fail-mode": "malformed"}
    strategy, _, start = sky_app_on_grid(ProcessPerMessageGrid, run, {2: fault})
    with pytest.raises(
        SkyNodeError, match=r"round 1 failed.*box.*has shape.*max_failed_rounds=1 reached"
    ):
        strategy.start(**start)
    assert [r.round for r in strategy.rounds] == [1]  # round 2 never started
    assert all("box" in r.error and "has shape" in r.error for r in strategy.rounds)
