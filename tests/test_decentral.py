"""Data heterogeneity split and the flat-vector model of the decentralized strategies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from sky_flower.gossip.training import FlatModel, minibatch_indices, sorted_shuffle_partition
from sky_flower.pipeline.data import load_split

TRAIN, TEST = load_split("digits", 0.2, 0)


@settings(max_examples=examples(50), deadline=None)
@given(
    st.integers(2, 40),
    st.floats(0, 100),
    st.integers(0, 2**16),
    st.lists(st.integers(0, 9), min_size=40, max_size=300),
)
def test_partition_is_disjoint_equal_and_keeps_the_sorted_tail(nodes, homogeneity, seed, labels):
    labels = np.array(labels)
    parts = sorted_shuffle_partition(labels, nodes, homogeneity, seed)
    size = len(labels) // nodes
    assert len(parts) == nodes and all(len(p) == size for p in parts)
    flat = np.concatenate(parts)
    assert len(np.unique(flat)) == len(flat)  # disjoint
    # everything past the shuffled prefix stays in label order
    shuffled = int(round(homogeneity / 100 * len(labels)))
    tail = labels[flat[shuffled:]]
    assert (np.diff(tail) >= 0).all()


def test_homogeneity_zero_is_sorted_and_hundred_is_iid():
    nodes = 8
    sorted_parts = sorted_shuffle_partition(TRAIN.y, nodes, 0.0)
    labels_per_node = [len(np.unique(TRAIN.y[p])) for p in sorted_parts]
    assert max(labels_per_node) <= 3  # ~180 examples per node, ~144 per label
    iid = sorted_shuffle_partition(TRAIN.y, nodes, 100.0)
    assert all(len(np.unique(TRAIN.y[p])) == 10 for p in iid)
    counts = np.stack([np.bincount(TRAIN.y[p], minlength=10) for p in iid])
    assert counts.min() > 5  # every label well represented on every node
    half = sorted_shuffle_partition(TRAIN.y, nodes, 50.0)
    n_labels = [len(np.unique(TRAIN.y[p])) for p in half]
    assert n_labels[0] >= 5 and n_labels[-1] <= 3  # front: the shuffled first half of labels


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, 50.0), "at least 2 nodes"),
        ((8, -1.0), r"homogeneity must be in \[0, 100\]"),
        ((8, 101.0), r"homogeneity must be in \[0, 100\]"),
        ((5000, 50.0), "5000 nodes but only"),
    ],
)
def test_bad_split_refused(args, message):
    with pytest.raises(ValueError, match=message):
        sorted_shuffle_partition(TRAIN.y, *args)


@pytest.mark.parametrize("hidden", [0, 16])
def test_batched_gradients_equal_single_node_gradients_and_autograd(hidden):
    model = FlatModel(hidden)
    rng = np.random.default_rng(0)
    X = np.stack([model.initial(s) for s in range(3)])
    idx = np.stack([rng.choice(len(TRAIN), 8, replace=False) for _ in range(3)])
    losses, grads = model.batched_loss_and_grad(X, TRAIN.x[idx], TRAIN.y[idx])
    for i in range(3):
        loss, g = model.loss_and_grad(X[i], TRAIN.x[idx[i]], TRAIN.y[idx[i]])
        assert loss == pytest.approx(losses[i], rel=1e-5)
        np.testing.assert_allclose(g, grads[i], rtol=1e-4, atol=1e-6)
    # finite difference along a random direction
    v = rng.normal(size=model.dim)
    eps = 1e-3
    xb, yb = TRAIN.x[idx[0]], TRAIN.y[idx[0]]
    up = model.loss_and_grad(X[0] + eps * v, xb, yb)[0]
    down = model.loss_and_grad(X[0] - eps * v, xb, yb)[0]
    assert (up - down) / (2 * eps) == pytest.approx(grads[0] @ v, rel=2e-2)


def test_minibatches_are_seeded_and_distinct():
    a = minibatch_indices(100, 16, 0, node=1, step=2, k=0)
    assert len(np.unique(a)) == 16
    np.testing.assert_array_equal(a, minibatch_indices(100, 16, 0, node=1, step=2, k=0))
    assert not np.array_equal(a, minibatch_indices(100, 16, 0, node=1, step=2, k=1))
    with pytest.raises(ValueError, match=r"batch_size 200 must be in \[1, 100\]"):
        minibatch_indices(100, 200, 0, 0, 0)


def test_initial_model_is_seeded_and_untrained():
    model = FlatModel(32)
    np.testing.assert_array_equal(model.initial(3), model.initial(3))
    assert model.dim == 64 * 32 + 32 + 32 * 10 + 10
    assert model.evaluate(model.initial(0), TEST)["accuracy"] < 0.4


def test_detag_strategy_passes_its_variant_and_phase_rule_to_the_gossip_core():
    from sky_flower.strategies.decentralized import DeTAGStrategy

    from sky_flower.gossip.matrices import gossip_matrix

    g = gossip_matrix("ring", 16)
    s = DeTAGStrategy(gossip=g, lr=0.1, variant="atc", phase_rule="log")
    assert s.algorithm.variant == "atc" and s.algorithm.rounds_per_step == 7
    assert DeTAGStrategy(gossip=g, lr=0.1).algorithm.rounds_per_step == 4
