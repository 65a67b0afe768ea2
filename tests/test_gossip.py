"""The pure gossip core: gossip matrices, gossip, and the four algorithms on quadratics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from sky_flower.gossip.algorithms import (
    ALGORITHMS,
    D2,
    DeTAG,
    default_phase_rounds,
    make_algorithm,
)
from sky_flower.gossip.matrices import (
    TOPOLOGIES,
    GossipMatrix,
    accelerated_gossip,
    acceleration_eta,
    components,
    consensus_distance,
    gossip_matrix,
    torus_shape,
)


def plain_gossip(X, W, rounds=1):
    """``W^rounds @ X``: ``rounds`` plain gossip rounds (the baseline)."""
    for _ in range(rounds):
        X = W @ X
    return X


def _valid(topology, n):
    return topology != "torus" or any(n % r == 0 for r in range(2, math.isqrt(n) + 1))


topo_n = st.tuples(st.sampled_from(TOPOLOGIES), st.integers(2, 24)).filter(lambda t: _valid(*t))


@settings(max_examples=examples(60), deadline=None)
@given(topo_n, st.integers(0, 2**16))
def test_gossip_matrix_is_symmetric_doubly_stochastic_with_graph_support(tn, seed):
    topology, n = tn
    g = gossip_matrix(topology, n, seed=seed)
    W = g.W
    assert W.shape == (n, n)
    np.testing.assert_allclose(W, W.T, atol=1e-12)
    np.testing.assert_allclose(W.sum(0), 1.0, atol=1e-12)
    assert (W >= -1e-12).all()
    assert 0.0 < g.spectral_gap <= 1.0
    assert g.eigenvalues[0] == pytest.approx(1.0)
    if topology == "ring" and n > 3:
        assert ((W > 0).sum(1) == 3).all()  # self + two neighbours
    if topology == "complete":
        assert g.spectral_gap == pytest.approx(1.0)


@settings(max_examples=examples(60), deadline=None)
@given(topo_n, st.integers(1, 30), st.floats(-5, 5), st.integers(0, 2**16))
def test_gossip_keeps_constants_and_preserves_the_average(tn, rounds, c, seed):
    topology, n = tn
    g = gossip_matrix(topology, n, seed=seed)
    eta = acceleration_eta(g.mixing_rate)
    const = np.full((n, 3), c)
    X = np.random.default_rng(seed).normal(size=(n, 3))
    for op in (
        lambda A: plain_gossip(A, g.W, rounds),
        lambda A: accelerated_gossip(A, g.W, rounds, eta),
    ):
        np.testing.assert_allclose(op(const), const, atol=1e-9)
        np.testing.assert_allclose(op(X).mean(0), X.mean(0), atol=1e-9)


@pytest.mark.parametrize(("topology", "n"), [("ring", 10), ("torus", 16), ("star", 9)])
def test_consensus_error_decays_at_the_rate_the_spectral_gap_predicts(topology, n):
    g = gossip_matrix(topology, n)
    lam = 1.0 - g.spectral_gap
    X = np.random.default_rng(1).normal(size=(n, 4))
    d0, dists = consensus_distance(X), []
    for _ in range(60):
        X = g.W @ X
        dists.append(consensus_distance(X))
    # never slower than the bound lambda^(2k) (the distance is squared)...
    for k, d in enumerate(dists, start=1):
        assert d <= lam ** (2 * k) * d0 * (1 + 1e-9)
    # ...and asymptotically exactly that rate
    rate = (dists[-1] / dists[-21]) ** (1 / 20)
    assert rate == pytest.approx(lam**2, rel=0.02)


@pytest.mark.parametrize("gap", [1.0, 0.3, 0.1, 0.05, 0.01])
def test_spectral_gap_set_exactly(gap):
    g = gossip_matrix("complete", 8, spectral_gap=gap)
    assert g.spectral_gap == pytest.approx(gap, abs=1e-12)
    np.testing.assert_allclose(g.W, gap * np.ones((8, 8)) / 8 + (1 - gap) * np.eye(8), atol=1e-12)
    ring = gossip_matrix("ring", 8, spectral_gap=gap / 10)  # sparse, same exact gap
    assert ring.spectral_gap == pytest.approx(gap / 10, abs=1e-12)
    assert ((ring.W > 0).sum(1) == 3).all()


def test_accelerated_gossip_beats_plain_gossip_on_a_ring():
    g = gossip_matrix("ring", 32)
    eta = acceleration_eta(g.mixing_rate)
    X0 = np.random.default_rng(0).normal(size=(32, 2))
    d0 = consensus_distance(X0)

    def rounds_to(op, target=1e-6):
        X_prev = X = X0
        for k in range(1, 5000):
            X_prev, X = X, op(X, X_prev)
            if consensus_distance(X) < target * d0:
                return k
        return 5000

    plain = rounds_to(lambda X, _: g.W @ X)
    accel = rounds_to(lambda X, P: (1 + eta) * (g.W @ X) - eta * P)
    assert accel * 3 < plain, (accel, plain)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"topology": "hypercube", "n": 8}, "unknown topology 'hypercube'"),
        ({"topology": "ring", "n": 1}, "at least 2 nodes"),
        ({"topology": "ring", "n": 8, "spectral_gap": 0.0}, r"spectral_gap must be in \(0, 1\]"),
        ({"topology": "ring", "n": 8, "spectral_gap": 1.5}, r"spectral_gap must be in \(0, 1\]"),
        ({"topology": "ring", "n": 8, "spectral_gap": 0.5}, "out of reach of the ring"),
        ({"topology": "torus", "n": 7}, "7 nodes has none"),
        ({"topology": "erdos_renyi", "n": 8, "edge_probability": 0}, "edge_probability"),
    ],
)
def test_bad_network_refused(kwargs, message):
    kw = dict(kwargs)
    with pytest.raises(ValueError, match=message):
        gossip_matrix(kw.pop("topology"), kw.pop("n"), **kw)


def test_torus_shape_is_most_square():
    assert torus_shape(16) == (4, 4) and torus_shape(8) == (2, 4) and torus_shape(12) == (3, 4)


def test_d2_refuses_lambda_min_at_or_below_minus_a_third_naming_lazy_mixing():
    ring = gossip_matrix("ring", 8)  # Metropolis-Hastings ring of even n: lambda_min = -1/3
    assert ring.lambda_min == pytest.approx(-1 / 3)
    with pytest.raises(
        ValueError,
        match=r"D2 needs lambda_min\(W\) > -1/3.*-0\.3333: set strategy\.lazy_mixing=true "
        r"\(lazy gossip W' = \(I \+ W\) / 2, lambda_min 0\.3333\)",
    ):
        D2(ring, lr=0.1)
    D2(gossip_matrix("ring", 9), lr=0.1)  # odd ring: lambda_min = -0.29, accepted


@pytest.mark.parametrize(("topology", "n"), [("ring", 8), ("ring", 16), ("torus", 16), ("star", 5)])
def test_lazy_gossip_matrix_has_eigenvalues_one_plus_lambda_over_two(topology, n):
    g = gossip_matrix(topology, n)
    lazy = gossip_matrix(topology, n, lazy=True)
    np.testing.assert_array_equal(lazy.W, 0.5 * (np.eye(n) + g.W))
    np.testing.assert_allclose(lazy.eigenvalues, (1.0 + g.eigenvalues) / 2.0, atol=1e-13)
    assert lazy.lambda_min >= 0.0 and lazy.topology == f"{topology}+lazy"
    assert np.array_equal(lazy.W != 0, (g.W != 0) | np.eye(n, dtype=bool))  # same graph
    if topology == "torus":  # 4x4 torus: lambda_min -0.6 -> 0.2; lambda_2 0.6 -> 0.8
        assert g.lambda_min == pytest.approx(-0.6) and lazy.spectral_gap == pytest.approx(0.2)


def test_lazy_mixing_then_an_exact_gap():
    lazy = gossip_matrix("ring", 8, spectral_gap=0.05, lazy=True)
    assert lazy.spectral_gap == pytest.approx(0.05) and lazy.topology == "ring+lazy+gap"
    with pytest.raises(ValueError, match="out of reach"):  # lazy 8-ring: gap 0.146 at most
        gossip_matrix("ring", 8, spectral_gap=0.2, lazy=True)


def test_d2_on_the_lazy_even_ring_is_accepted_and_converges_exactly():
    lazy = gossip_matrix("ring", N, lazy=True)
    assert D2(lazy, lr=0.05).gossip is lazy
    err, alg = _run("d2", lazy, lr=0.05, rounds=6000)
    assert err < 1e-8
    assert alg.consensus_distance() < 1e-16


# --- convergence on a quadratic with heterogeneous local optima ------------------------
N, D = 8, 6


def _quadratic(seed=0):
    """f_i(x) = 1/2 (x - c_i)^T H_i (x - c_i); optimum of the average: (sum H)^-1 sum H c."""
    rng = np.random.default_rng(seed)
    H = np.stack([np.diag(rng.uniform(0.5, 2.0, D)) for _ in range(N)])
    C = rng.normal(0.0, 3.0, (N, D))  # local optima far apart: heterogeneous
    x_star = np.linalg.solve(H.sum(0), np.einsum("nij,nj->i", H, C))
    return (lambda X: np.einsum("nij,nj->ni", H, X - C)), x_star


def _run(name, g, lr, rounds=4000):
    grad, x_star = _quadratic()
    alg = make_algorithm(name, g, lr)
    alg.reset(np.zeros(D))
    for _ in range(rounds // alg.rounds_per_step):
        alg.step(grad(alg.x))
    return np.abs(alg.x - x_star).max(), alg


@pytest.mark.parametrize("name", ["d2", "dsgt", "detag"])
@pytest.mark.parametrize(("topology", "gap"), [("exponential", None), ("complete", 0.05)])
def test_tracking_methods_converge_exactly(name, topology, gap):
    err, alg = _run(name, gossip_matrix(topology, N, spectral_gap=gap), lr=0.05)
    assert err < 1e-8
    assert alg.consensus_distance() < 1e-16


def test_dsgt_and_detag_converge_exactly_on_a_ring():
    g = gossip_matrix("ring", N)
    for name in ("dsgt", "detag"):
        err, _ = _run(name, g, lr=0.05)
        assert err < 1e-8, name


def test_dpsgd_with_a_constant_step_reaches_only_a_neighbourhood_shrinking_with_the_step():
    g = gossip_matrix("ring", N)
    errs = [_run("dpsgd", g, lr)[0] for lr in (0.04, 0.02, 0.01)]
    assert errs[0] > 1e-2  # biased: heterogeneous local optima pull the nodes apart
    assert errs[0] < 5.0  # but bounded
    for big, small in zip(errs, errs[1:], strict=False):
        assert small == pytest.approx(big / 2, rel=0.25)  # the bias is O(alpha)


def test_detag_phase_length_and_momentum():
    g = gossip_matrix("complete", N, spectral_gap=0.01)
    alg = DeTAG(g, lr=0.1)
    assert alg.rounds_per_step == 10 and alg.batches_per_step == 10
    lam = 0.99
    assert alg.eta == pytest.approx((1 - math.sqrt(1 - lam**2)) / (1 + math.sqrt(1 - lam**2)))
    assert DeTAG(g, lr=0.1, phase_rounds=3, accumulate=False).batches_per_step == 1
    assert (
        DeTAG(g, lr=0.1, eta=0.2).eta == 0.2 and make_algorithm("detag", g, 0.1, eta=0.0).eta == 0
    )
    with pytest.raises(ValueError, match=r"eta must be in \[0, 1\)"):
        DeTAG(g, lr=0.1, eta=1.0)


def test_bad_algorithm_settings_refused():
    g = gossip_matrix("ring", N)
    with pytest.raises(ValueError, match="unknown algorithm 'adam'"):
        make_algorithm("adam", g, 0.1)
    with pytest.raises(ValueError, match="lr must be > 0"):
        make_algorithm("dpsgd", g, 0.0)
    alg = make_algorithm("dsgt", g, 0.1)
    alg.reset(np.zeros(3))
    with pytest.raises(ValueError, match=r"gradients have shape \(8, 2\), expected \(8, 3\)"):
        alg.step(np.zeros((8, 2)))
    assert set(ALGORITHMS) == {"dpsgd", "d2", "dsgt", "detag"}


def test_a_hand_built_disconnected_matrix_is_refused_naming_its_components():
    """Two blocks {0, 1} and {2, 3} (each a valid gossip matrix): once accepted with
    spectral gap 0, gossip never mixing the blocks. A periodic one (eigenvalue -1) too."""
    block = np.array([[0.5, 0.5], [0.5, 0.5]])
    w = np.block([[block, np.zeros((2, 2))], [np.zeros((2, 2)), block]])
    with pytest.raises(ValueError, match=r"into 2 components \[0, 1\]; \[2, 3\]"):
        GossipMatrix(w, "hand-built")
    with pytest.raises(ValueError, match="every eigenvalue above -1"):
        GossipMatrix(np.array([[0.0, 1.0], [1.0, 0.0]]), "swap")
    assert components(gossip_matrix("ring", 5).W) == [[0, 1, 2, 3, 4]]


# --- DeTAG's two variants and its phase rule (issue 18) --------------------------------
def test_detag_variants_on_a_hand_computed_two_node_example():
    """W = 11^T / 2 (gap 1, eta 0, R 1), x0 = (1, 3), lr 0.1, G0 = (2, 4), G1 = (1, 1).

    paper (Algorithm 2): x1 = W x0 - 0.1 W 0 = (2, 2); y1 = W 0 + G0 - 0 = (2, 4);
                         x2 = W (2, 2) - 0.1 W (2, 4) = (1.7, 1.7); y2 = (3, 3) + G1 - G0
                         = (2, 0).
    atc:   y_half = (2, 4); x1 = W (0.8, 2.6) = (1.7, 1.7); y1 = (3, 3);
           y_half = (3, 3) + (1, 1) - (2, 4) = (2, 0); x2 = W (1.5, 1.7) = (1.6, 1.6).
    """
    g = GossipMatrix(np.full((2, 2), 0.5), "hand-built")
    G0, G1 = np.array([[2.0], [4.0]]), np.array([[1.0], [1.0]])
    expected = {
        "paper": ([2.0, 2.0], [2.0, 4.0], [1.7, 1.7], [2.0, 0.0]),
        "atc": ([1.7, 1.7], [3.0, 3.0], [1.6, 1.6], [1.0, 1.0]),
    }
    for variant, (x1, y1, x2, y2) in expected.items():
        alg = DeTAG(g, lr=0.1, variant=variant)
        assert alg.rounds_per_step == 1 and alg.eta == 0.0
        alg.reset(np.array([[1.0], [3.0]]))
        alg.step(G0)
        np.testing.assert_allclose(alg.x[:, 0], x1, err_msg=variant)
        np.testing.assert_allclose(alg.y[:, 0], y1, err_msg=variant)
        alg.step(G1)
        np.testing.assert_allclose(alg.x[:, 0], x2, err_msg=variant)
        np.testing.assert_allclose(alg.y[:, 0], y2, err_msg=variant)
    assert DeTAG(g, lr=0.1).variant == "paper"


def test_detag_atc_at_one_round_without_momentum_is_dsgt():
    """``atc`` with R = 1 on the complete graph (mixing rate 0, so eta = 0) gives DSGT's
    iterates step for step (the paper, Sec. 6.1, calls DSGT DeTAG's R = 1, eta = 0 case;
    exactly, with our DSGT, that holds for ``atc``)."""
    g = gossip_matrix("complete", N)
    grad, _ = _quadratic()
    a, b = DeTAG(g, lr=0.05, phase_rounds=1, variant="atc"), make_algorithm("dsgt", g, 0.05)
    assert a.eta == 0.0
    for alg in (a, b):
        alg.reset(np.zeros(D))
    for _ in range(20):
        a.step(grad(a.x))
        b.step(grad(b.x))
        np.testing.assert_allclose(a.x, b.x, rtol=1e-12, atol=1e-12)


def test_detag_atc_variant_converges_exactly_on_a_ring():
    grad, x_star = _quadratic()
    alg = DeTAG(gossip_matrix("ring", N), lr=0.03, variant="atc")
    alg.reset(np.zeros(D))
    for _ in range(4000 // alg.rounds_per_step):
        alg.step(grad(alg.x))
    assert np.abs(alg.x - x_star).max() < 1e-8


def test_detag_phase_rule_with_the_log_factor():
    # ring of 16: gap 0.0507 -> 1/sqrt(gap) = 4.44 -> sqrt rule 4;
    # log rule (Corollary 6's first term) ceil(ln(16) / 2 * 4.44) = ceil(6.16) = 7
    g = gossip_matrix("ring", 16)
    root = 1 / math.sqrt(g.spectral_gap)
    assert default_phase_rounds(g.spectral_gap, 16, "sqrt") == round(root)
    assert default_phase_rounds(g.spectral_gap, 16, "log") == math.ceil(math.log(16) / 2 * root)
    alg = make_algorithm("detag", g, 0.1, phase_rule="log")
    assert alg.rounds_per_step == alg.batches_per_step == 7
    assert make_algorithm("detag", g, 0.1, phase_rounds=4, phase_rule="log").rounds_per_step == 4
    assert default_phase_rounds(1.0, 2, "log") == 1
    with pytest.raises(ValueError, match="unknown phase rule 'cube'"):
        default_phase_rounds(0.5, 4, "cube")
    with pytest.raises(ValueError, match="unknown DeTAG variant 'late'"):
        make_algorithm("detag", g, 0.1, variant="late")
    with pytest.raises(ValueError, match="'overlap' is now 'paper'"):
        make_algorithm("detag", g, 0.1, variant="overlap")
