"""Split training equals unsplit training for ANY loss (issue 30): whatever the loss's
reduction (a per-sample mean, a sum, a mean over a label-dependent count: padding /
``ignore_index`` tokens, class weights), the number of micro-batches, the cut points,
the schedule (sequential, GPipe, 1F1B) and the transport (in process, relay, direct).

The reference (``tests/reference.py``'s ``reference_rounds``) calls the user's loss
ONCE on the whole batch's output and labels and back-propagates it once: it knows
nothing of reductions. Split training declares the reduction
(:class:`sky_flower.pipeline.objective.LossReduction`) and scales each micro-batch's
loss by it before its backward.

Tolerances: split and unsplit add the same terms in another order (per micro-batch,
then scaled and summed, against one reduction over the batch): float32 rounding of
about 1e-7 relative per term, over at most 16 terms, then one SGD step of lr 0.1 per
step: weights agree to ``atol = 1e-6`` (``rtol = 1e-5``), losses to ``rel = 1e-5``.
SGD, not Adam: Adam's update does not depend on the gradient's scale, so it would hide
a loss scaled ``M`` times off (the bug this file is about).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from factories import runner_settings
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from hypothesis import given, settings
from hypothesis import strategies as hs
from reference import ProcessPerMessageGrid, forkserver, reference_rounds
from tiers import examples
from torch import nn

from sky_flower.core.partition.plan import Plan, StagePlan
from sky_flower.pipeline.data import Split
from sky_flower.pipeline.direct import RoundHost, run_stage, stage_input_shapes
from sky_flower.pipeline.lm import IGNORE_INDEX, lm_cross_entropy, token_count
from sky_flower.pipeline.objective import LossReduction, check_objective, correct_count
from sky_flower.pipeline.stage import (
    RngKey,
    StageExecutor,
    build_stage,
    run_split_step,
    slice_state,
    step_batch,
)
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.relay import RelayRunner
from sky_flower.sky.transport.runner import Pipeline, RunSettings

LR, CLASSES = 0.1, 5
CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5])


def net() -> nn.Sequential:
    """7 layers: BatchNorm (1) and Dropout (3) in front, so the micro-batch semantics
    (buffers per micro-batch, keyed masks) are exercised too."""
    return nn.Sequential(
        nn.Linear(6, 12, bias=False),
        nn.BatchNorm1d(12),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, CLASSES),
    )


def _weights() -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return net().state_dict()


# -- the losses (module level: they travel to the nodes by reference) -------------------
def sum_cross_entropy(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the samples (``reduction="sum"``)."""
    return F.cross_entropy(out, labels, reduction="sum")


def class_weighted_cross_entropy(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Class-weighted cross-entropy: PyTorch's mean divides by the labels' summed class
    weight, so it is a mean over :func:`class_weight_total`."""
    return F.cross_entropy(out, labels, weight=CLASS_WEIGHTS)


def class_weight_total(labels: torch.Tensor) -> float:
    """What :func:`class_weighted_cross_entropy` averages over."""
    return float(CLASS_WEIGHTS[labels].sum())


def per_sample_cross_entropy(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Not reduced (``reduction="none"``): refused."""
    return F.cross_entropy(out, labels, reduction="none")


# name -> (loss, reduction, weight function, labels padded with IGNORE_INDEX)
CASES = {
    "mean": (F.cross_entropy, "mean", None, False),
    "sum": (sum_cross_entropy, "sum", None, False),
    "tokens": (lm_cross_entropy, "weighted", token_count, True),
    "class_weights": (class_weighted_cross_entropy, "weighted", class_weight_total, False),
}


def _labels(gen: torch.Generator, n: int, padded: bool, pad: float) -> torch.Tensor:
    y = torch.randint(0, CLASSES, (n,), generator=gen)
    if padded:
        mask = torch.rand(n, generator=gen) < pad
        mask[torch.randint(0, n, (1,), generator=gen)] = False  # one real label at least
        y[mask] = IGNORE_INDEX
    return y


def _split_step(bounds, x, y, microbatches, case, seed):  # noqa: ANN001, ANN202
    """One SGD step of the model cut at ``bounds``, in process; (weights, loss)."""
    loss_fn, kind, weight_fn, _ = CASES[case]
    w0 = _weights()
    stages = []
    for a, b in bounds:
        module = build_stage(net, a, b, slice_state(w0, a, b))
        params = list(module.parameters())
        opt = torch.optim.SGD(params, lr=LR) if params else None
        stages.append(StageExecutor(module, opt, microbatches))
    loss = run_split_step(
        stages,
        x,
        y,
        RngKey(seed, 1, 0),
        loss_fn=loss_fn,
        reduction=LossReduction(kind, weight_fn),
    )
    return {k: v for st in stages for k, v in st.module.state_dict().items()}, loss


def _unsplit(batches, microbatches, case, seed, steps=1):  # noqa: ANN001, ANN202
    """The reference: the user's loss once on each whole batch, SGD."""
    ((weights, losses),) = reference_rounds(
        net,
        batches,
        1,
        steps,
        LR,
        microbatches=microbatches,
        seed=seed,
        optimizer="sgd",
        weights=_weights(),
        loss_fn=CASES[case][0],
    )
    return weights, losses


def _assert_weights(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _bounds(cuts: set[int], layers: int = 7) -> list[tuple[int, int]]:
    edges = [0, *sorted(cuts), layers]
    return [(a, b - 1) for a, b in zip(edges, edges[1:], strict=False)]


@settings(max_examples=examples(60), deadline=None)
@given(
    case=hs.sampled_from(sorted(CASES)),
    microbatches=hs.sampled_from([1, 2, 3, 4, 6]),
    cuts=hs.sets(hs.integers(1, 6), max_size=4),
    seed=hs.integers(0, 2**16),
    pad=hs.floats(0.0, 0.8),
)
def test_split_step_equals_unsplit_for_any_reduction_microbatches_and_cuts(
    case, microbatches, cuts, seed, pad
):
    """Property: for a random loss reduction, number of micro-batches and cut points,
    one split step gives the weights (BatchNorm buffers included) and the loss of the
    whole model trained on the user's loss of the whole batch. Padded labels leave
    micro-batches with different token counts, some with none."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 6, generator=gen)
    y = _labels(gen, 12, CASES[case][3], pad)
    got, loss = _split_step(_bounds(cuts), x, y, microbatches, case, seed)
    expected, (ref_loss,) = _unsplit([(x, y)], microbatches, case, seed)
    _assert_weights(got, expected)
    assert math.isclose(loss, ref_loss, rel_tol=1e-5, abs_tol=1e-6)


# -- relay and direct --------------------------------------------------------------------
BOUNDS = [(0, 2), (3, 4), (5, 6)]
SEED, ROUND, STEPS, BATCH = 3, 1, 2, 16


def _data(padded: bool) -> Split:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=gen).numpy()
    return Split(x=x, y=_labels(gen, 64, padded, 0.5).numpy().astype(np.int64))


DATA = {True: _data(True), False: _data(False)}


def _owner_data_padded(context) -> Split | None:  # noqa: ANN001
    return DATA[True] if int(context.node_config["partition-id"]) == 0 else None


def _owner_data(context) -> Split | None:  # noqa: ANN001
    return DATA[False] if int(context.node_config["partition-id"]) == 0 else None


def _relay_app() -> ClientApp:
    return SkyClient(model_fn=net, load_data=_owner_data).register(ClientApp())


def _relay_app_padded() -> ClientApp:
    return SkyClient(model_fn=net, load_data=_owner_data_padded).register(ClientApp())


def _batches(padded: bool) -> list:
    return [step_batch(DATA[padded], BATCH, ROUND, SEED, s) for s in range(STEPS)]


def _relay_round(case: str, kind: str, microbatches: int, per_message: int):  # noqa: ANN202
    loss_fn, reduction, weight_fn, padded = CASES[case]
    names = [f"n{k}" for k in range(len(BOUNDS))]
    stages = [
        StagePlan(name, k, a, b, 0.0, 0.0, 0.0, 0.0)
        for k, (name, (a, b)) in enumerate(zip(names, BOUNDS, strict=True))
    ]
    configs = [{"sky-node": n, "partition-id": k} for k, n in enumerate(names)]
    grid = ProcessPerMessageGrid(_relay_app_padded if padded else _relay_app, configs, {})
    pred = [{"node": n, "messages": 0, "compute_s": 0.0, "busy_s": 0.0} for n in names]
    pipeline = Pipeline(
        Plan("even", stages, 0.0, 0.0, 0.0),
        tuple(grid.ids),
        per_message,
        tuple(pred),
        (0.0,) * 3,
        ((0.0, 0.0),) * 3,
    )
    run = RunSettings(
        model_fn=net,
        input_shape=(6,),
        num_layers=7,
        settings=runner_settings(
            {
                "schedule.batch_size": BATCH,
                "schedule.microbatches": microbatches,
                "schedule.kind": kind,
                "train.optimizer": "sgd",
                "train.lr": LR,
                "seed": SEED,
            }
        ),
        loss_fn=loss_fn,
        loss_reduction=reduction,
        loss_weight_fn=weight_fn,
    )
    out = RelayRunner(run).run_round(grid, pipeline, ArrayRecord(_weights()), STEPS, ROUND)
    return out.arrays.to_torch_state_dict(), out.losses


@pytest.mark.parametrize(
    ("case", "kind", "microbatches", "per_message"),
    [
        ("sum", "gpipe", 4, 1),
        ("sum", "1f1b", 4, 2),
        ("sum", "sequential", 4, 4),
        ("tokens", "gpipe", 4, 2),
        ("tokens", "1f1b", 4, 1),
        ("class_weights", "gpipe", 2, 1),
    ],
)
def test_relay_equals_unsplit_for_any_loss(case, kind, microbatches, per_message, server_identity):
    """The relay (3 stages, every schedule): weights and per-step losses of the user's
    loss on the whole batch; the token-weighted case sends the step's token count from
    the data owner to the last stage with the labels."""
    got, losses = _relay_round(case, kind, microbatches, per_message)
    expected, ref_losses = _unsplit(_batches(CASES[case][3]), microbatches, case, SEED, STEPS)
    _assert_weights(got, expected)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)


def _direct_worker(rdv, case: str, kind: str, microbatches: int, shape: tuple, queue) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    loss_fn, reduction, weight_fn, padded = CASES[case]
    a, b = BOUNDS[rdv.rank]
    module = build_stage(net, a, b, slice_state(_weights(), a, b))
    opt = torch.optim.SGD(module.parameters(), lr=LR) if list(module.parameters()) else None
    try:
        res = run_stage(
            rdv,
            module,
            opt,
            kind,
            microbatches,
            STEPS,
            BATCH,
            shape,
            batch_fn=lambda s: step_batch(DATA[padded], BATCH, ROUND, SEED, s),
            loss_fn=loss_fn,
            rng=RngKey(SEED, ROUND),
            reduction=LossReduction(reduction, weight_fn),
        )
        sd = {k: v.numpy().copy() for k, v in module.state_dict().items()}
        queue.put((rdv.rank, (sd, list(res.losses))))
    except Exception as err:  # noqa: BLE001 - reported to the test
        queue.put((rdv.rank, repr(err)))


@pytest.mark.processes
@pytest.mark.parametrize(("case", "kind"), [("sum", "gpipe"), ("sum", "1f1b"), ("tokens", "gpipe")])
def test_direct_equals_unsplit_for_any_loss(case, kind):
    """The direct transport (torch.distributed.pipelining, 3 ranks, M = 4): weights
    and the last stage's per-step losses of the user's loss on the whole batch."""
    microbatches = 4
    ctx = forkserver()
    queue = ctx.Queue()
    shapes = stage_input_shapes(net, (6,), BOUNDS)
    with RoundHost(len(BOUNDS), timeout_s=30.0) as host:
        procs = [
            ctx.Process(
                target=_direct_worker,
                args=(host.rendezvous(k), case, kind, microbatches, shapes[k], queue),
            )
            for k in range(len(BOUNDS))
        ]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(timeout=10)
    errors = {k: v for k, v in got.items() if isinstance(v, str)}
    assert not errors, errors
    merged = {k: torch.from_numpy(v) for sd, _ in got.values() for k, v in sd.items()}
    expected, ref_losses = _unsplit(_batches(CASES[case][3]), microbatches, case, SEED, STEPS)
    _assert_weights(merged, expected)
    np.testing.assert_allclose(got[len(BOUNDS) - 1][1], ref_losses, rtol=1e-5, atol=1e-6)


# -- refusals ---------------------------------------------------------------------------
def test_a_loss_that_is_not_a_scalar_is_refused_by_name():
    """``reduction="none"``: refused naming the loss and how to reduce it, on the node
    (StageExecutor) and up front (check_objective)."""
    st = StageExecutor(build_stage(net, 0, 6, _weights()), None, 2)
    x, y = torch.randn(4, 6), torch.randint(0, CLASSES, (4,))
    with pytest.raises(ValueError, match=r"per_sample_cross_entropy returned \(2,\), not one"):
        st.forward_backward_loss(x, y, False, loss_fn=per_sample_cross_entropy)
    with pytest.raises(ValueError, match="objective.loss=.*not a finite scalar"):
        check_objective(net(), x, y, per_sample_cross_entropy, correct_count)


def test_a_loss_that_does_not_reduce_as_declared_is_refused_up_front():
    """A sum declared as a mean (the default) trains a model M times off: refused before
    any node is contacted, naming the setting that fixes it; declared right, accepted."""
    x, y = torch.randn(4, 6), torch.randint(0, CLASSES, (4,))
    with pytest.raises(ValueError, match="set objective.reduction=sum"):
        check_objective(net(), x, y, sum_cross_entropy, correct_count)
    with pytest.raises(ValueError, match="set objective.reduction=mean"):
        check_objective(net(), x, y, F.cross_entropy, correct_count, reduction=LossReduction("sum"))
    check_objective(net(), x, y, sum_cross_entropy, correct_count, reduction=LossReduction("sum"))
    padded = y.clone()
    padded[:3] = IGNORE_INDEX
    weighted = LossReduction("weighted", token_count)
    check_objective(net(), x, padded, lm_cross_entropy, correct_count, reduction=weighted)
    with pytest.raises(ValueError, match="set objective.reduction=sum"):
        check_objective(net(), x, padded, lm_cross_entropy, correct_count)  # halves 0 vs 1


def test_reduction_settings_are_checked():
    """``weighted`` needs ``objective.weight`` (and only it takes one); the ``lm`` task
    declares its token weighting; a step whose labels are all padding is refused."""
    with pytest.raises(ValueError, match="needs objective.weight"):
        SkySettings.from_run_config({"loss-reduction": "weighted"})
    with pytest.raises(ValueError, match="choose one of mean, sum, weighted"):
        SkySettings.from_run_config({"loss-reduction": "median"})
    s = SkySettings.from_run_config(
        {"loss-reduction": "sum", "loss": "test_exact_objective:sum_cross_entropy"}
    )
    assert s.objective.reduction_object().kind == "sum"
    from hydra import compose, initialize_config_dir

    from sky_flower.jobs.common import conf_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        lm = SkySettings.from_hydra(compose("config", overrides=["task=lm"]))
    assert lm.objective.reduction_object() == LossReduction("weighted", token_count)
    with pytest.raises(ValueError, match="weight 0"):
        LossReduction("weighted", token_count).total(torch.full((4,), IGNORE_INDEX))


@pytest.mark.parametrize("case", sorted(CASES))
def test_server_side_evaluation_reports_the_users_loss_on_the_whole_test_set(case):
    """The Hydra job's test loss, computed in chunks of 7, is the user's loss on the
    whole test set for every reduction (float32 sums in another order: rel 1e-5)."""
    from sky_flower.jobs.sky import evaluate_fn_for

    loss_fn, kind, weight_fn, padded = CASES[case]
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(50, 6, generator=gen), _labels(gen, 50, padded, 0.6)
    evaluate = evaluate_fn_for(
        net,
        Split(x.numpy(), y.numpy()),
        loss_fn,
        correct_count,
        chunk=7,
        reduction=LossReduction(kind, weight_fn),
    )
    found = evaluate(1, ArrayRecord(_weights()))
    model = net()
    model.load_state_dict(_weights())
    with torch.no_grad():
        expected = float(loss_fn(model.eval()(x), y))
    assert math.isclose(found["loss"], expected, rel_tol=1e-5)
