"""Federated split training: one pipeline per data owner, all running in a round, FedAvg
across (``sky_flower.sky.rounds.federation``). Every owner's pipeline, on either transport,
equals the owner training the whole model alone on the same batches, and the global
model is their FedAvg weighted by samples trained (``reference_rounds``; the in-process
``ConcurrentGrid`` runs the nodes at once, so pipelines overlap)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import (
    ConcurrentGrid,
    ProcessPerMessageGrid,
    _step_batch,
    reference_rounds,
    sky_app_client,
    sky_app_on_grid,
    sky_app_run_config,
    sky_app_task,
)

from sky_flower.sky.rounds.federation import fedavg
from sky_flower.sky.transport.runner import RoundOutcome

QUICK = {"benchmark-repeats": 1, "echo-repeats": 1, "state-probe-mb": 0.0, "allocation": "even"}
BATCH = 32
# fleet federated6: owner-a, owner-b, owner-c, helper-x, helper-y, helper-z. Each owner's
# partition, chosen so that the owners hold different sample counts (719, 359, 479)
PARTS = {0: (0, 2), 1: (1, 4), 2: (2, 3)}
# steps per round of the fault tests: what they check (who is averaged, dropped, named)
# does not depend on the number of steps; multi-step training is checked above them
FAULT_STEPS = 1


def _node_extra(owners: int, fault: dict | None = None, on: int = 1) -> dict[int, dict]:
    """node config per fleet node: owners 0..owners-1 hold the partitions of
    :data:`PARTS`; owner-c is a helper when ``owners`` is 2; ``fault`` on node ``on``
    (default owner-b)."""
    extra: dict[int, dict] = {
        i: {"partition-id": pid, "num-partitions": n} for i, (pid, n) in PARTS.items()
    }
    if owners == 2:
        extra[2]["sky-holds-data"] = False
    if fault:
        extra.setdefault(on, {}).update(fault)
    return extra


def _run(run: dict, owners: int, fault: dict | None = None, on: int = 1):  # noqa: ANN202
    extra = _node_extra(owners, fault, on)
    strategy, grid, start = sky_app_on_grid(ConcurrentGrid, run, extra)
    try:
        result = strategy.start(**start)
    finally:
        grid.close()
    return strategy, result


def _owner_round(part: tuple, weights: dict, rnd: int, steps: int, run: dict) -> tuple:
    """The owner of partition ``part`` (id, count) training the whole model alone in
    round ``rnd`` from ``weights`` on the batches its stage 0 draws: (weights after,
    per-step losses)."""
    task = sky_app_task()
    data = task.load_data(*part)
    batch = int(run["batch-size"])
    batches = [_step_batch(data, s, rnd, batch, 0) for s in range(steps)]
    ((after, losses),) = reference_rounds(
        task.Net,
        batches,
        rounds=1,
        steps=steps,
        lr=float(run["lr"]),
        microbatches=int(run["microbatches"]),
        weights=weights,
    )
    return after, losses


def _expected(  # noqa: ANN202
    run: dict,
    steps: dict[str, int],
    rounds: int,
    lost: frozenset = frozenset(),
    parts: dict[str, tuple] | None = None,
):
    """The reference: every round, each owner (its partition ``parts[owner]``, default
    :data:`PARTS` by fleet index) trains alone from the global model; the new global
    model is their FedAvg weighted by samples trained (``steps x batch``); owners in
    ``lost`` drop out. Returns per round the global weights and, per owner, its losses."""
    parts = parts or {"owner-a": PARTS[0], "owner-b": PARTS[1], "owner-c": PARTS[2]}
    weights = sky_app_task().initial_weights()
    out = []
    for rnd in range(1, rounds + 1):
        trained = {
            o: _owner_round(parts[o], weights, rnd, k, run)
            for o, k in steps.items()
            if o not in lost
        }
        total = sum(steps[o] for o in trained)
        weights = {
            key: sum(trained[o][0][key] * (steps[o] / total) for o in trained) for key in weights
        }
        out.append((weights, {o: losses for o, (_, losses) in trained.items()}))
    return out


def _assert_close(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key].numpy(), value.numpy(), rtol=1e-5, atol=1e-5)


CASES = [  # transport, schedule kind, micro-batches, owners (one per transport in make test)
    pytest.param("relay", "sequential", 1, 2, marks=pytest.mark.slow),
    ("relay", "gpipe", 2, 3),
    pytest.param("direct", "gpipe", 2, 2, marks=pytest.mark.slow),
    pytest.param("direct", "1f1b", 2, 3, marks=pytest.mark.processes),
]


@pytest.mark.parametrize(("transport", "kind", "microbatches", "owners"), CASES)
def test_pipelines_with_fedavg_equal_owners_training_alone(
    transport, kind, microbatches, owners, server_identity
):
    """K owners (different sample counts, so different steps and FedAvg weights), each
    heading its own pipeline with helpers, all running in the round; two rounds: the
    global model after each equals the FedAvg of every owner training the whole model
    alone on the same batches, and each pipeline's loss its owner's."""
    run = {**QUICK, **sky_app_run_config(), "fleet": "federated6", "num-server-rounds": 2}
    run |= {"transport": transport, "schedule-kind": kind, "microbatches": microbatches}
    run |= {"batch-size": BATCH, "steps-per-round": 0, "local-epochs": 0.1, **QUICK}
    run |= {"direct-timeout-s": 20.0, "direct-join-timeout-s": 40.0}
    strategy, result = _run(run, owners)
    steps = {r.owner: r.steps for r in strategy.runs}
    assert sorted(steps) == ["owner-a", "owner-b", "owner-c"][:owners]
    assert len(set(steps.values())) > 1, steps  # the owners' sample counts differ
    for r in strategy.runs:  # every pipeline is headed by its owner; helpers are used
        assert r.pipeline.plan.stages[0].node == r.owner
    assert sum(len(r.pipeline.plan.stages) for r in strategy.runs) > owners
    expected = _expected(run, steps, rounds=2)
    assert len(strategy.rounds) == 2
    for row, (_, losses) in zip(strategy.rounds, expected, strict=True):
        assert row.error is None and row.failed_pipelines == [], row
        assert [p.owner for p in row.pipelines] == list(steps)
        for p in row.pipelines:
            assert p.error is None
            assert p.steps == steps[p.owner]
            assert p.samples_trained == steps[p.owner] * BATCH
            assert abs(p.train_loss - float(np.mean(losses[p.owner]))) < 1e-5
        assert row.samples_trained == sum(steps.values()) * BATCH
    _assert_close(result.arrays.to_torch_state_dict(), expected[-1][0])


def test_failing_owner_drops_out_of_the_average(server_identity):
    """owner-b's node replies with an error to its forward messages in both rounds:
    each round averages the other two pipelines (owner-b's update is lost, the others'
    kept: the global model is their FedAvg), the round row names owner-b and its node,
    and the run goes on (an owner is never dropped)."""
    run = {**sky_app_run_config(), "fleet": "federated6", "num-server-rounds": 2}
    run |= {"batch-size": BATCH, "steps-per-round": FAULT_STEPS, "max-failed-rounds": 1, **QUICK}
    fault = {"sky-fail-on": "train.sky_forward", "sky-fail-mode": "raise"}
    strategy, result = _run(run, 3, fault)
    assert len(strategy.rounds) == 2 and strategy.failed_rounds == []
    for row in strategy.rounds:
        assert row.error is None
        (failed,) = row.failed_pipelines
        assert failed.owner == "owner-b" and "owner-b" in failed.nodes
        assert "owner-b" in failed.error
        by_owner = {p.owner: p for p in row.pipelines}
        assert by_owner["owner-b"].error and by_owner["owner-b"].samples_trained == 0
        assert by_owner["owner-a"].error is None and by_owner["owner-c"].error is None
        assert row.samples_trained == 2 * FAULT_STEPS * BATCH
    steps = dict.fromkeys(("owner-a", "owner-b", "owner-c"), FAULT_STEPS)
    expected = _expected(run, steps, rounds=2, lost=frozenset({"owner-b"}))
    _assert_close(result.arrays.to_torch_state_dict(), expected[-1][0])


def test_failing_helper_is_dropped_and_the_next_round_replanned(server_identity):
    """helper-x replies with an error to its forward messages: round 1 averages the
    pipelines it is not in and names the one it broke (owner and helper-x); helper-x is
    dropped, the round re-planned without it, and round 2 trains every owner."""
    run = {**sky_app_run_config(), "fleet": "federated6", "num-server-rounds": 2}
    run |= {"batch-size": BATCH, "steps-per-round": FAULT_STEPS, "max-failed-rounds": 1, **QUICK}
    fault = {"sky-fail-on": "train.sky_forward", "sky-fail-mode": "raise"}
    strategy, _ = _run(run, 3, fault, on=3)  # node 3: helper-x
    first, second = strategy.rounds
    (failed,) = first.failed_pipelines
    assert failed.nodes == ["helper-x"] and "helper-x" in failed.error
    assert first.samples_trained == 2 * FAULT_STEPS * BATCH
    assert second.failed_pipelines == []
    assert second.samples_trained == 3 * FAULT_STEPS * BATCH
    assert all("helper-x" not in p.nodes for p in second.pipelines)
    assert "helper-x" not in {n.name for n in strategy.node_profiles}
    assert strategy.failed_rounds == []  # round 1 did not fail: two pipelines finished


def test_fedavg_is_flowers_weighted_mean_and_keeps_dtypes():
    """FedAvg of two models weighted 3:1 by samples trained; integer buffers keep their
    dtype."""
    from flwr.app import ArrayRecord

    a = {"w": torch.ones(2, 2), "n": torch.tensor(4, dtype=torch.int64)}
    b = {"w": torch.zeros(2, 2), "n": torch.tensor(4, dtype=torch.int64)}

    def out(sd: dict, seen: int) -> RoundOutcome:
        return RoundOutcome(ArrayRecord(sd), [0.0], 0, seen, [0.0], [])

    avg = fedavg([out(a, 96), out(b, 32)]).to_torch_state_dict()
    torch.testing.assert_close(avg["w"], torch.full((2, 2), 0.75))
    assert avg["n"].dtype == torch.int64 and int(avg["n"]) == 4
    with pytest.raises(ValueError, match="at least one pipeline"):
        fedavg([])


# make run's default fleet (edge4, two owners) under Flower's simulation engine: one
# pipeline per owner, each trained its steps: tests/test_simulation.py's
# test_default_fleet_trains_every_owner_above_90_percent


def test_flower_template_nodes_without_a_fleet_all_own_their_partition(server_identity):
    """A real federation: no fleet file (``fleet=""``, ``min-nodes=0``), four SuperNodes
    whose node config is Flower's template only (``partition-id`` / ``num-partitions``).
    The strategy takes every node that connected within ``node-wait-s``; each node owns
    its partition and heads its own pipeline (here alone: no helpers, a FedAvg client),
    so all four partitions train, and the global model is their FedAvg."""
    from flwr.app import ArrayRecord

    from sky_flower.app import sky_strategy

    task = sky_app_task()
    run = {**sky_app_run_config(), **QUICK, "fleet": "", "min-nodes": 0}
    run |= {"node-wait-s": 0.5, "num-server-rounds": 1, "steps-per-round": 2}
    # fleet="" alone means transport=stream (auto), whose stage message lasts the round:
    # this Grid handles each message synchronously inside push, so it runs the relay
    run["transport"] = "relay"
    configs = [{"partition-id": i, "num-partitions": 4} for i in range(4)]
    grid = ProcessPerMessageGrid(sky_app_client, configs, run)
    strategy = sky_strategy(run, model_fn=task.Net, input_shape=[64])
    initial = ArrayRecord(task.initial_weights())
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=1)
    owners = [f"node{i}" for i in range(4)]
    assert [r.owner for r in strategy.runs] == owners
    (row,) = strategy.rounds
    assert [p.owner for p in row.pipelines] == owners
    batch = int(run["batch-size"])
    assert [p.samples_trained for p in row.pipelines] == [2 * batch] * 4
    parts = {f"node{i}": (i, 4) for i in range(4)}
    expected = _expected(run, dict.fromkeys(owners, 2), rounds=1, parts=parts)
    _assert_close(result.arrays.to_torch_state_dict(), expected[-1][0])


# examples/sky-app under `flwr run` in simulation, every SuperNode heading its own
# pipeline: checked on tests/test_example.py's sky-app run (the same app, fleet and runtime)


def test_federated_benchmark_uses_every_owner_and_never_loses_to_fedavg():
    """``python -m sky_flower.bench.federated``'s two fleets, small: with owners too
    small for the model FedAvg uses only the two that fit (a third of the data), Sky's
    heuristic every owner; with every owner fitting, Sky's predicted round is at most
    1.05x FedAvg's."""
    import argparse

    from sky_flower.bench.federated import ALL_FIT, SMALL_OWNERS, compare

    args = argparse.Namespace(
        width=64, layers=3, batch_size=32, lr=1e-3, rounds=1, target=0.5, flops=5e9
    )
    small = {r["method"]: r for r in compare(SMALL_OWNERS, args, time_limit_s=5.0)}
    assert small["fedavg (owners that fit)"]["owners"] == ["bigphone0", "bigphone1"]
    assert small["fedavg (owners that fit)"]["data_share"] == pytest.approx(1 / 3, abs=0.01)
    assert small["sky heuristic"]["data_share"] == 1.0
    fit = {r["method"]: r for r in compare(ALL_FIT, args, time_limit_s=5.0)}
    assert fit["fedavg (owners that fit)"]["data_share"] == 1.0
    assert fit["sky heuristic"]["round_s"] <= 1.05 * fit["fedavg (owners that fit)"]["round_s"]


def test_pipelines_sharing_a_node_run_one_after_another():
    """``run_pipelines``: pipeline 2 waits for pipeline 0 (they share a node), pipeline
    1 runs at once; a pipeline that raises ``SkyNodeError`` is recorded, the others'
    outcomes kept, and FedAvg in ``federated_round`` averages those that finished."""
    import threading
    from types import SimpleNamespace

    from flwr.app import ArrayRecord

    from sky_flower.sky.planning.planning import PipelineRun
    from sky_flower.sky.rounds.federation import federated_round
    from sky_flower.sky.transport.runner import SkyNodeError

    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    both_started = threading.Barrier(2, timeout=10)  # 0 and 1 run at once, or this fails

    class FakeRunner:
        def run_round(self, grid, plan, arrays, steps, server_round):  # noqa: ANN001, ANN201
            owner = plan.owner
            with lock:
                events.append((owner, "start"))
            if owner in ("a", "b"):
                both_started.wait()
            with lock:
                events.append((owner, "end"))
            if owner == "b":
                raise SkyNodeError("b's helper failed", nodes=["h"])
            value = {"a": 1.0, "c": 4.0}[owner]
            sd = {"w": torch.full((2,), value)}
            return RoundOutcome(ArrayRecord(sd), [float(value)], 0, 32 * steps, [0.1], [])

    def run(owner: str, steps: int, after: tuple = ()) -> PipelineRun:
        inner = SimpleNamespace(predicted_step_time_s=0.1, stages=[SimpleNamespace(node=owner)])
        plan = SimpleNamespace(owner=owner, plan=inner)
        return PipelineRun(owner, 100, steps, plan, after)  # type: ignore[arg-type]

    runs = [run("a", 1), run("b", 1), run("c", 3, (0,))]
    res = federated_round(None, runs, FakeRunner, ArrayRecord({}), 1)  # type: ignore[arg-type]
    row, arrays = res.record, res.arrays
    assert events.index(("a", "end")) < events.index(("c", "start"))
    assert [f.owner for f in row.failed_pipelines] == ["b"]
    assert row.failed_pipelines[0].nodes == ["h"]
    assert row.samples_trained == 32 * 4
    # FedAvg of a (32 samples, w=1) and c (96 samples, w=4): 0.25 * 1 + 0.75 * 4
    torch.testing.assert_close(arrays.to_torch_state_dict()["w"], torch.full((2,), 3.25))
