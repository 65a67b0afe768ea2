"""FedAvg of a model's non-float state (``sky_flower.sky.federation.fedavg``): integer
and boolean arrays (BatchNorm's ``num_batches_tracked``) are averaged exactly and
rounded, never truncated; every array keeps the dtype and shape of the model's state
dict."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch
from flwr.app import ArrayRecord
from hypothesis import given, settings
from hypothesis import strategies as hs
from torch import nn

from sky_flower.sky.federation import fedavg, integer_mean
from sky_flower.sky.runner import RoundOutcome

BATCH = 8
STEPS = 7


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


@settings(max_examples=300, deadline=None)
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


@settings(max_examples=200, deadline=None)
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
