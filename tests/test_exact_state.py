"""Split execution computes what the whole model computes, weights AND buffers, on every
path: in process (``run_split_step``), the relay (sequential and pipelined, every
micro-batches-per-message grouping) and the direct transport (GPipe, 1F1B).

The model has a BatchNorm and a Dropout in a non-last stage and a stage without
parameters (:data:`BOUNDS`). The reference is ``reference_rounds``: the whole model on
the same micro-batches in the same order, each layer's randomness keyed by ``(seed,
round, step, micro-batch, layer)`` as every split path keys it
(:func:`sky_flower.pipeline.stage.forward_layers`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factories import runner_settings
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args
from hypothesis import given, settings
from hypothesis import strategies as hs
from reference import (
    ConcurrentGrid,
    ProcessPerMessageGrid,
    reference_rounds,
    run_direct_stages,
    sky_app_on_grid,
    sky_app_run_config,
    sky_app_task,
)
from sky_flower.strategies.sky import SkyNodeError
from tiers import examples
from torch import nn

from sky_flower.app import load_fleet, register_sky_client, sky_strategy
from sky_flower.core.partition.plan import Plan, StagePlan
from sky_flower.deploy import node_config
from sky_flower.pipeline.data import Split
from sky_flower.pipeline.direct import run_stage, stage_input_shapes
from sky_flower.pipeline.stage import (
    RngKey,
    StageExecutor,
    build_stage,
    run_split_step,
    slice_state,
    stage_optimizer,
    step_batch,
)
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.transport.relay import RelayRunner
from sky_flower.sky.transport.runner import Pipeline, RunSettings

SEED, ROUND, STEPS, BATCH, LR = 3, 1, 3, 16, 1e-2
BOUNDS = [(0, 2), (3, 4), (5, 8)]  # BN + dropout | ReLU + dropout (no parameters) | rest


def stateful_net() -> nn.Sequential:
    """9 layers: BatchNorm (1, 6), Dropout (2, 4), parameter-free ReLU (3, 7). A Linear
    before a BatchNorm has no bias (its gradient is zero up to rounding, which Adam
    would amplify to a full step)."""
    return nn.Sequential(
        nn.Linear(8, 16, bias=False),
        nn.BatchNorm1d(16),
        nn.Dropout(0.3),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(16, 16, bias=False),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 4),
    )


def _data() -> Split:
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, size=(64, 8)).astype(np.float32)
    return Split(x=x, y=rng.integers(0, 4, size=64).astype(np.int64))


DATA = _data()


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return stateful_net().state_dict()


def _expected(microbatches: int, model_fn=stateful_net) -> dict[str, torch.Tensor]:  # noqa: ANN001
    ((weights, _),) = reference_rounds(
        model_fn,
        DATA,
        1,
        STEPS,
        LR,
        BATCH,
        microbatches,
        SEED,
        weights=_weights(),
    )
    return weights


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every weight and buffer within 1e-6 (``num_batches_tracked`` exactly)."""
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(got[key]), value, rtol=0, atol=1e-6, msg=key)


def _in_process(bounds, microbatches: int, weights=None) -> list[StageExecutor]:  # noqa: ANN001
    weights = weights or _weights()
    stages = []
    for a, b in bounds:
        module = build_stage(stateful_net, a, b, slice_state(weights, a, b))
        stages.append(StageExecutor(module, stage_optimizer(module, "adam", LR), microbatches))
    for step in range(STEPS):
        x, y = step_batch(DATA, BATCH, ROUND, SEED, step)
        run_split_step(stages, x, y, RngKey(SEED, ROUND, step))
    return stages


def _merged(stages: list[StageExecutor]) -> dict[str, torch.Tensor]:
    return {k: v for st in stages for k, v in st.module.state_dict().items()}


# -- in process -------------------------------------------------------------------------
@pytest.mark.parametrize("microbatches", [1, 4])
def test_in_process_split_equals_whole_weights_and_buffers(microbatches):
    _assert_same(_merged(_in_process(BOUNDS, microbatches)), _expected(microbatches))


def _recording(masks: dict[int, list[torch.Tensor]]):  # noqa: ANN202
    """A model builder whose Dropout layers append their keep-mask to ``masks[layer]``."""

    def build() -> nn.Sequential:
        model = stateful_net()
        for j, layer in enumerate(model):
            if isinstance(layer, nn.Dropout):
                layer.register_forward_hook(
                    lambda m, args, out, j=j: masks.setdefault(j, []).append(out != 0)
                )
        return model

    return build


def test_dropout_masks_of_forward_and_recomputation_are_the_whole_models():
    """Each non-last stage runs a micro-batch twice (graph-free forward, then the
    recomputation): both draw the whole model's mask for that (step, micro-batch)."""
    M = 4
    ref: dict[int, list[torch.Tensor]] = {}
    _expected(M, _recording(ref))
    split: dict[int, list[torch.Tensor]] = {}
    weights = _weights()
    stages = []
    for a, b in BOUNDS:  # the stages of the recording model
        module = build_stage(_recording(split), a, b, slice_state(weights, a, b))
        stages.append(StageExecutor(module, stage_optimizer(module, "adam", LR), M))
    for step in range(STEPS):
        x, y = step_batch(DATA, BATCH, ROUND, SEED, step)
        run_split_step(stages, x, y, RngKey(SEED, ROUND, step))
    for j in (2, 4):  # one dropout in each non-last stage
        assert len(ref[j]) == STEPS * M and len(split[j]) == 2 * STEPS * M
        assert not torch.equal(ref[j][0], ref[j][1])  # a fresh mask per micro-batch
        for s in range(STEPS):
            want = ref[j][s * M : (s + 1) * M]
            forward, recompute = split[j][2 * s * M : (2 * s + 1) * M], split[j][(2 * s + 1) * M :]
            for w, f, r in zip(want, forward, recompute[:M], strict=True):
                assert torch.equal(f, w) and torch.equal(r, w)


@settings(max_examples=examples(25), deadline=None)
@given(
    cuts=hs.sets(hs.integers(1, 8), max_size=5),
    microbatches=hs.sampled_from([1, 2, 4]),
)
def test_any_cut_points_equal_the_whole_model(cuts, microbatches):
    edges = [0, *sorted(cuts), 9]
    bounds = [(a, b - 1) for a, b in zip(edges, edges[1:], strict=False)]
    _assert_same(_merged(_in_process(bounds, microbatches)), _expected(microbatches))


def test_parameter_free_stage_has_no_optimizer_and_passes_gradients():
    module = build_stage(stateful_net, 3, 4)
    assert stage_optimizer(module, "adam", LR) is None
    st = StageExecutor(module, None, 2, rng=RngKey(1, 1, 0))
    x = torch.randn(4, 16)
    y = st.forward(x)
    g = st.backward(x, torch.ones_like(y), input_grad=True)
    assert torch.equal(g, (y != 0).float() / 0.7)  # ReLU then dropout's mask and scale


def recurrent_net() -> nn.Sequential:
    """An LSTM in the first stage (layers 0-3) and a head (4-5): on the CPU, ``nn.LSTM``
    runs oneDNN's inference kernel when no gradient is needed, whose output differs from
    the training kernel's in the last bits (at these sizes)."""
    from sky_flower.pipeline.models import FirstOutput

    return nn.Sequential(
        nn.Linear(8, 64),
        nn.Unflatten(1, (4, 16)),
        nn.LSTM(16, 16, batch_first=True),
        FirstOutput(),
        nn.Flatten(),
        nn.Linear(64, 4),
    )


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_graph_free_forward_sends_what_the_recomputation_computes(microbatches):
    """A non-last stage's forward runs its kernels as its recomputation (and the whole
    model) does, so the activation it sends is the one the backward differentiates:
    under ``torch.no_grad`` an LSTM sent other bits and training drifted from unsplit."""
    torch.manual_seed(0)
    weights = recurrent_net().state_dict()
    stages = []
    for a, b in [(0, 3), (4, 5)]:
        module = build_stage(recurrent_net, a, b, slice_state(weights, a, b))
        stages.append(StageExecutor(module, stage_optimizer(module, "adam", LR), microbatches))
    for step in range(STEPS):
        x, y = step_batch(DATA, BATCH, ROUND, SEED, step)
        run_split_step(stages, x, y, RngKey(SEED, ROUND, step))
    ((want, _),) = reference_rounds(
        recurrent_net, DATA, 1, STEPS, LR, BATCH, microbatches, SEED, weights=weights
    )
    got = _merged(stages)
    for key, value in want.items():
        assert torch.equal(got[key], value), (key, float((got[key] - value).abs().max()))


# -- relay ------------------------------------------------------------------------------
def _owner_data(context) -> Split | None:  # noqa: ANN001
    return DATA if int(context.node_config["partition-id"]) == 0 else None


def _relay_app() -> ClientApp:
    return SkyClient(model_fn=stateful_net, load_data=_owner_data).register(ClientApp())


def stateful_run_settings(
    kind: str, microbatches: int, paths: dict | None = None, **run: object
) -> RunSettings:
    """A runner's settings for :func:`stateful_net` (its 9 layers, input 8) trained with
    this module's batch, Adam, learning rate and seed, plus the Hydra ``paths`` and
    ``RunSettings`` fields ``run`` (e.g. ``describe``) given."""
    base = {
        "schedule.batch_size": BATCH,
        "schedule.microbatches": microbatches,
        "schedule.kind": kind,
        "train.optimizer": "adam",
        "train.lr": LR,
        "seed": SEED,
    }
    return RunSettings(
        model_fn=stateful_net,
        input_shape=(8,),
        num_layers=9,
        settings=runner_settings({**base, **(paths or {})}),
        **run,
    )


def _relay_round(kind: str, microbatches: int, per_message: int) -> dict[str, torch.Tensor]:
    names = [f"n{k}" for k in range(len(BOUNDS))]
    stages = [
        StagePlan(name, k, a, b, 0.0, 0.0, 0.0, 0.0)
        for k, (name, (a, b)) in enumerate(zip(names, BOUNDS, strict=True))
    ]
    plan = Plan("even", stages, 0.0, 0.0, 0.0)
    configs = [{"sky-node": n, "partition-id": k} for k, n in enumerate(names)]
    grid = ProcessPerMessageGrid(_relay_app, configs, {})
    pred = [{"node": n, "messages": 0, "compute_s": 0.0, "busy_s": 0.0} for n in names]
    pipeline = Pipeline(
        plan, tuple(grid.ids), per_message, tuple(pred), (0.0,) * 3, ((0.0, 0.0),) * 3
    )
    settings_ = stateful_run_settings(kind, microbatches)
    outcome = RelayRunner(settings_).run_round(
        grid, pipeline, ArrayRecord(_weights()), STEPS, ROUND
    )
    return outcome.arrays.to_torch_state_dict()


RELAY_CASES = [("sequential", 1, 1), ("sequential", 4, 4)] + [
    (kind, m, c) for kind in ("gpipe", "1f1b") for m in (1, 4) for c in (1, 2, 4) if m % c == 0
]


@pytest.mark.parametrize(("kind", "microbatches", "per_message"), RELAY_CASES)
def test_relay_equals_whole_at_every_grouping(kind, microbatches, per_message, server_identity):
    _assert_same(_relay_round(kind, microbatches, per_message), _expected(microbatches))


# -- direct -----------------------------------------------------------------------------
def _direct_worker(rdv, kind: str, microbatches: int, shape: tuple, queue) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    a, b = BOUNDS[rdv.rank]
    module = build_stage(stateful_net, a, b, slice_state(_weights(), a, b))
    try:
        run_stage(
            rdv,
            module,
            stage_optimizer(module, "adam", LR),
            kind,
            microbatches,
            STEPS,
            BATCH,
            shape,
            batch_fn=lambda s: step_batch(DATA, BATCH, ROUND, SEED, s),
            rng=RngKey(SEED, ROUND),
        )
        queue.put((rdv.rank, {k: v.numpy().copy() for k, v in module.state_dict().items()}))
    except Exception as err:  # noqa: BLE001 - reported to the test
        queue.put((rdv.rank, repr(err)))


@pytest.mark.processes
@pytest.mark.parametrize(  # torch's 1F1B needs M >= S (3)
    ("kind", "microbatches"), [("gpipe", 1), ("gpipe", 4), ("1f1b", 4)]
)
def test_direct_equals_whole(kind, microbatches):
    shapes = stage_input_shapes(stateful_net, (8,), BOUNDS)
    args = [(kind, microbatches, shapes[k]) for k in range(len(BOUNDS))]
    merged = run_direct_stages(_direct_worker, args, timeout_s=60.0)
    _assert_same(merged, _expected(microbatches))


# -- a stage that raises ----------------------------------------------------------------
def raising_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A loss that always fails (the last stage's own error, not its node's)."""
    raise ValueError("this loss cannot be computed")


def test_a_raising_stage_is_its_error_and_drops_no_node(server_identity):
    """The last stage's loss raises every round: each round fails naming the stage, its
    node and the reason, no node is dropped, and the run ends after
    ``max_failed_rounds`` with that error."""
    task = sky_app_task()
    run_config = {
        **sky_app_run_config(),
        **{"fleet": "edge3", "allocation": "even", "steps-per-round": 1},
        **{"benchmark-repeats": 1, "echo-repeats": 1, "state-probe-mb": 0.0},
    }
    fleet = load_fleet("edge3")
    configs = [parse_config_args([node_config(n, i, len(fleet))]) for i, n in enumerate(fleet)]
    grid = ProcessPerMessageGrid(
        lambda: register_sky_client(
            ClientApp(), model_fn=task.Net, load_data=task.load_data, loss_fn=raising_loss
        ),
        configs,
        run_config,
    )
    run_config = {**run_config, "max-failed-rounds": 2}
    strategy = sky_strategy(run_config, model_fn=task.Net, input_shape=[64])
    with pytest.raises(SkyNodeError, match="this loss cannot be computed") as info:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(task.initial_weights()), num_rounds=3)
    last = strategy.plan.stages[-1].node
    assert f"stage 2 on {last} (node " in str(info.value) and "raised ValueError" in str(info.value)
    # both failed rounds are listed, the one that ended the run too (it once was not)
    assert [f.round for f in strategy.failed_rounds] == [1, 2]
    assert [f.dropped_nodes for f in strategy.failed_rounds] == [[], []]
    assert len(strategy.node_profiles) == 3 and len(strategy.plan.stages) == 3


def test_a_run_that_trained_no_round_ends_with_an_error():
    from sky_flower.jobs.sky import untrained  # the Hydra job (not in the stage children)
    from sky_flower.sky.rounds.records import RoundRecord

    failed = RoundRecord(1, 1.0, error="round 1 failed: stage 1 on box raised ValueError: x")
    assert untrained([]) is None and untrained([failed, RoundRecord(2, 1.0)]) is None
    assert "no round trained" in untrained([failed]) and "ValueError: x" in untrained([failed])


def _raising_loss_client() -> ClientApp:
    """The sky-app's ClientApp whose last stage's loss raises (built in a child)."""
    task = sky_app_task()
    return register_sky_client(
        ClientApp(), model_fn=task.Net, load_data=task.load_data, loss_fn=raising_loss
    )


class _RaisingLossGrid(ConcurrentGrid):
    def __init__(self, app_fn, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        super().__init__(_raising_loss_client, *args, **kwargs)


@pytest.mark.processes
def test_a_raising_direct_stage_is_its_error_and_drops_no_node(server_identity):
    """transport=direct: the last stage's loss raises; its peers stop because of it. The
    round fails naming that stage and the reason, no node is dropped, and the run (one
    round, max-failed-rounds=2) trained no round, which ends it with that error."""
    run = {"fleet": "uniform3", "allocation": "even", "num-server-rounds": 1}
    run |= {"benchmark-repeats": 1, "echo-repeats": 1, "state-probe-mb": 0.0}
    run |= {"transport": "direct", "schedule-kind": "gpipe", "microbatches": 4}
    run |= {"steps-per-round": 2, "direct-timeout-s": 20.0, "direct-join-timeout-s": 30.0}
    strategy, grid, start = sky_app_on_grid(_RaisingLossGrid, run)
    with pytest.raises(SkyNodeError, match=r"none of the 1 round\(s\) trained .*this loss"):
        try:
            strategy.start(**start)
        finally:
            grid.close()
    (failed,) = strategy.failed_rounds
    assert failed.dropped_nodes == [] and len(strategy.node_profiles) == 3
    assert "stage 2 on node2" in failed.error
    assert "raised ValueError: this loss cannot be computed" in failed.error
