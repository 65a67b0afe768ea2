"""FedAvg of a model's non-float state (``sky_flower.sky.rounds.federation.fedavg``): integer
and boolean arrays (BatchNorm's ``num_batches_tracked``) are averaged exactly and
rounded, never truncated; every array keeps the dtype and shape of the model's state
dict. And the BatchNorm policy across data owners (``train.bn_policy``): ``average``
or ``local`` (FedBN), each against a reference of owners training alone."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
import torch
from factories import runner_settings
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from hypothesis import given, settings
from hypothesis import strategies as hs
from reference import ProcessPerMessageGrid, reference_rounds
from tiers import examples
from torch import nn

from sky_flower.core.partition.plan import Plan, StagePlan
from sky_flower.pipeline.data import Split
from sky_flower.pipeline.stage import frozen_keys, step_batch
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.planning.planning import PipelineRun
from sky_flower.sky.rounds.federation import (
    LocalBatchNorm,
    batchnorm_keys,
    fedavg,
    federated_round,
    integer_mean,
)
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.relay import RelayRunner
from sky_flower.sky.transport.runner import Pipeline, RoundOutcome, RunSettings

BATCH = 8
STEPS = 7
ROWS: list = []  # the round records of the last _sky_rounds


def _bn_net() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _owner_round(weights: dict, owner: int, rnd: int) -> dict:
    """Data owner ``owner`` trains the whole model ``STEPS`` steps of ``BATCH`` samples
    (its own data, seeded by owner and round) from ``weights``; its state dict after."""
    net = _bn_net()
    net.load_state_dict(weights)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 * rnd + owner)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 6, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _full(shape: tuple, value: int, dtype: type) -> torch.Tensor:
    return torch.from_numpy(np.full(shape, value, dtype=dtype))


def _outcome(sd: dict, seen: int) -> RoundOutcome:
    return RoundOutcome(ArrayRecord(sd), [0.0], 0, seen, [0.0], [])


def test_three_owners_of_seven_steps_count_seven_then_fourteen_batches():
    """Three data owners train a BatchNorm model 7 steps each per round, FedAvg after
    each round: ``num_batches_tracked`` is 7 after one round and 14 after two (a float
    mean of three 7s is 6.999..., which truncation made 6, then 13), int64 and of the
    model's shape; the float entries are Flower's weighted mean."""
    weights = _bn_net().state_dict()
    for rnd, expected in ((1, 7), (2, 14)):
        trained = [_owner_round(weights, owner, rnd) for owner in range(3)]
        avg = fedavg([_outcome(sd, STEPS * BATCH) for sd in trained]).to_torch_state_dict()
        count = avg["1.num_batches_tracked"]
        assert count.dtype == torch.int64 and count.shape == () and int(count) == expected
        for key, value in weights.items():
            assert avg[key].dtype == value.dtype and avg[key].shape == value.shape, key
        mean = sum(sd["1.running_mean"] for sd in trained) / 3
        torch.testing.assert_close(avg["1.running_mean"], mean, rtol=1e-6, atol=1e-7)
        weights = avg


@settings(max_examples=examples(300), deadline=None)
@given(
    owners=hs.integers(1, 6),
    count=hs.integers(1, 10_000),
    values=hs.lists(hs.integers(0, 10**6), min_size=6, max_size=6),
    dtype=hs.sampled_from([np.int64, np.int32, np.uint8]),
)
def test_fedavg_of_integers_with_equal_counts_is_the_rounded_exact_mean(
    owners, count, values, dtype
):
    """Equal sample counts: each integer entry is the exact mean of the owners' values
    rounded to the nearest (halves to even, Python's ``round`` of a Fraction); equal
    values come back unchanged; dtype and shape kept."""
    info = np.iinfo(dtype)
    vals = [int(v) % (int(info.max) + 1) for v in values[:owners]]
    records = [_outcome({"n": _full((2, 3), v, dtype), "w": torch.zeros(2)}, count) for v in vals]
    got = fedavg(records)["n"].numpy()
    assert got.dtype == dtype and got.shape == (2, 3)
    assert (got == round(Fraction(sum(vals), owners))).all()
    same = fedavg([_outcome({"n": _full((3,), vals[0], dtype)}, count)] * owners)
    assert (same["n"].numpy() == vals[0]).all()


@settings(max_examples=examples(200), deadline=None)
@given(
    parts=hs.lists(
        hs.tuples(hs.integers(-(10**12), 10**12), hs.integers(0, 1000)), min_size=1, max_size=5
    ).filter(lambda p: sum(w for _, w in p) > 0)
)
def test_integer_mean_is_exact_for_any_weights(parts):
    """Any weights: the exact weighted mean, rounded (no float error on 10^12-sized
    values)."""
    arrays = [np.array([v], dtype=np.int64) for v, _ in parts]
    weights = [w for _, w in parts]
    expected = round(Fraction(sum(v * w for v, w in parts), sum(weights)))
    assert int(integer_mean(arrays, weights)[0]) == expected


def test_boolean_state_is_the_weighted_majority():
    """A boolean buffer averages to the weighted majority, stays bool."""
    a, b = torch.tensor([True, False]), torch.tensor([False, False])
    got = fedavg([_outcome({"m": a}, 3), _outcome({"m": b}, 1)])["m"].numpy()
    assert got.dtype == np.bool_ and got.tolist() == [True, False]


# -- train.bn_policy: average (FedAvg of every entry) or local (FedBN) ---------------------
LR, SEED, B = 0.1, 5, 16


def _owner_split(shift: float) -> Split:
    """An owner's data: the same task under a feature shift (FedBN's setting)."""
    gen = torch.Generator().manual_seed(int(shift * 10))
    x = torch.randn(64, 6, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return Split(x=(x * (1 + shift) + shift).numpy(), y=y.numpy().astype(np.int64))


OWNERS = {"owner-a": _owner_split(0.0), "owner-b": _owner_split(2.0)}


def _owner_of(context) -> Split:  # noqa: ANN001
    return OWNERS[str(context.node_config["sky-node"])]


def _frozen_bn_net() -> nn.Sequential:
    """:func:`_bn_net` with its first Linear frozen (``requires_grad=False``)."""
    net = _bn_net()
    net[0].requires_grad_(False)
    return net


def _bn_app(model_fn: Callable[[], nn.Module] = _bn_net) -> ClientApp:
    return SkyClient(model_fn=model_fn, load_data=_owner_of).register(ClientApp())


def _one_stage_run(name: str, node_id: int) -> PipelineRun:
    plan = Plan("even", [StagePlan(name, 0, 0, 3, 0.0, 0.0, 0.0, 0.0)], 0.0, 0.0, 0.0)
    pred = ({"node": name, "messages": 0, "compute_s": 0.0, "busy_s": 0.0},)
    pipeline = Pipeline(plan, (node_id,), 1, pred, (0.0,), ((0.0, 0.0),))
    return PipelineRun(name, len(OWNERS[name]), STEPS, pipeline)


def _sky_rounds(
    policy: str, rounds: int, model_fn: Callable[[], nn.Module] = _bn_net
) -> tuple[dict, LocalBatchNorm | None]:
    """``rounds`` federated rounds of two owners (each a one-stage pipeline on the
    relay, Sky's own client handlers); the global model after them, and the store of
    the owners' own BatchNorm entries (``local``). The rows are in ``ROWS``."""
    configs = [{"sky-node": name, "partition-id": k} for k, name in enumerate(OWNERS)]
    grid = ProcessPerMessageGrid(lambda: _bn_app(model_fn), configs, {})
    runs = [_one_stage_run(name, nid) for name, nid in zip(OWNERS, grid.ids, strict=True)]
    settings_ = RunSettings(
        model_fn=model_fn,
        input_shape=(6,),
        num_layers=4,
        settings=runner_settings(
            {
                "schedule.batch_size": B,
                "schedule.microbatches": 1,
                "schedule.kind": "sequential",
                "train.optimizer": "sgd",
                "train.lr": LR,
                "seed": SEED,
            }
        ),
    )
    local = LocalBatchNorm(batchnorm_keys(_bn_net())) if policy == "local" else None
    arrays = ArrayRecord(model_fn().state_dict())
    ROWS.clear()
    for rnd in range(1, rounds + 1):
        res = federated_round(
            grid,
            runs,
            lambda: RelayRunner(settings_),
            arrays,
            rnd,
            local_bn=local,
            frozen=frozen_keys(model_fn()),
        )
        row, new = res.record, res.arrays
        assert new is not None, res.failure
        ROWS.append(row)
        arrays = new
    return arrays.to_torch_state_dict(), local


def _reference(
    policy: str, rounds: int, model_fn: Callable[[], nn.Module] = _bn_net
) -> tuple[dict, dict[str, dict]]:
    """Each owner trains the whole model alone (``reference_rounds``) from the global
    model, with (``local``) its own BatchNorm entries from its previous round; the
    global model is the equal-weight FedAvg (integers rounded)."""
    keys = batchnorm_keys(model_fn())
    weights = model_fn().state_dict()
    own: dict[str, dict] = {}
    for rnd in range(1, rounds + 1):
        trained = {}
        for name, data in OWNERS.items():
            start = {**weights, **own.get(name, {})} if policy == "local" else weights
            batches = [step_batch(data, B, rnd, SEED, s) for s in range(STEPS)]
            ((after, _),) = reference_rounds(
                model_fn, batches, 1, STEPS, LR, optimizer="sgd", weights=start
            )
            trained[name] = after
        weights = fedavg([_outcome(sd, STEPS * B) for sd in trained.values()]).to_torch_state_dict()
        own = {name: {k: sd[k] for k in keys} for name, sd in trained.items()}
    return weights, own


def _close(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():  # same order of operations up to FedAvg's
        torch.testing.assert_close(torch.as_tensor(got[key]), value, rtol=1e-5, atol=1e-6)


def test_bn_policy_local_keeps_each_owners_batchnorm(server_identity):
    """FedBN (``train.bn_policy=local``): two owners with shifted features; after two
    rounds each owner's own BatchNorm entries (parameters, running statistics, 6
    batches tracked) are what it trained from its own, not the average, and the global
    model equals the reference's (non-BN entries averaged from owners that started
    from their own BatchNorm; the BN entries the owners' average). ``average`` gives
    another model (the policy matters on this data)."""
    got, local = _sky_rounds("local", 2)
    expected, own = _reference("local", 2)
    _close(got, expected)
    assert local is not None and set(local.by_owner) == set(OWNERS)
    for name in OWNERS:
        kept = {k: torch.as_tensor(v.numpy()) for k, v in local.by_owner[name].items()}
        _close(kept, own[name])
        assert int(kept["1.num_batches_tracked"]) == 2 * STEPS
    assert not torch.allclose(own["owner-a"]["1.running_mean"], own["owner-b"]["1.running_mean"])
    averaged, _ = _reference("average", 2)
    assert not torch.allclose(averaged["0.weight"], expected["0.weight"], atol=1e-4)


def test_bn_policy_average_is_fedavg_of_every_entry(server_identity):
    """``average`` (the default): every entry, BatchNorm included, is averaged; each
    owner starts every round from the global model."""
    got, local = _sky_rounds("average", 2)
    assert local is None
    _close(got, _reference("average", 2)[0])


def test_bn_policy_local_without_batchnorm_and_unknown_policies_are_refused():
    with pytest.raises(ValueError, match="has none: use train.bn_policy=average"):
        LocalBatchNorm(batchnorm_keys(nn.Sequential(nn.Linear(2, 2))))
    with pytest.raises(ValueError, match="bn-policy"):
        SkySettings.from_run_config({"bn-policy": "fedbn"})
    assert batchnorm_keys(_bn_net()) == {
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    }


def test_a_frozen_layer_keeps_the_global_models_entries_across_owners(server_identity):
    """A model whose first Linear is frozen, two owners, two rounds: the global model's
    frozen entries are the initial ones bit for bit (neither sent back nor averaged),
    the rest equals the owners-alone reference's FedAvg, and each round's record
    counts the two stages' replies (the trainable entries and buffers) against the
    whole model twice."""
    got, _ = _sky_rounds("average", 2, _frozen_bn_net)
    start = _frozen_bn_net().state_dict()
    frozen = frozen_keys(_frozen_bn_net())
    assert frozen == {"0.weight", "0.bias"}
    assert all(torch.equal(got[k], start[k]) for k in frozen)
    _close(got, _reference("average", 2, _frozen_bn_net)[0])
    assert not torch.allclose(got["3.weight"], start["3.weight"])  # the rest trained
    trained = ArrayRecord({k: v for k, v in start.items() if k not in frozen})
    for row in ROWS:
        assert row.weights_sent_bytes == 2 * trained.count_bytes()
        assert row.full_weights_bytes == 2 * ArrayRecord(start).count_bytes()
