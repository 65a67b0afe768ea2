"""The gossip core of decentralized training: topologies, gossip matrices, gossip.

Pure numpy (no Flower), so the same code runs inside a Flower strategy (the server plays
the network), in the one-process benchmark (:mod:`sky_flower.bench.decentralized`), or
later on a real peer-to-peer transport.

Notation (Lu and De Sa, "Optimal Complexity in Decentralized Training", ICML 2021,
arXiv 2006.08085): ``n`` nodes, each holding a model ``x_i`` (a flat vector of ``d``
floats); ``X`` stacks them as an ``(n, d)`` array, row ``i`` being node ``i``. One
*gossip round* replaces ``X`` by ``W @ X``: every node averages its neighbours' vectors
with the weights of the *gossip matrix* ``W`` (``(n, n)``, symmetric, doubly
stochastic). Its eigenvalues are ``1 = lambda_1 > lambda_2 >= ... >= lambda_n > -1``;
the *mixing rate* is ``lambda = max(|lambda_2|, |lambda_n|)`` and the *spectral gap*
``1 - lambda``: plain gossip shrinks the distance to the average by ``lambda`` per
round. The *consensus distance* is ``(1/n) sum_i ||x_i - xbar||^2``. A *phase* (DeTAG)
is ``R`` gossip rounds between two model updates.

The algorithms that use them are in :mod:`sky_flower.gossip.algorithms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

TOPOLOGIES = ("ring", "torus", "complete", "exponential", "erdos_renyi", "star")


# ------------------------------------------------------------------------------------
# topologies and gossip matrices
# ------------------------------------------------------------------------------------
def _check_nodes(n: int) -> None:
    if int(n) != n or n < 2:
        raise ValueError(f"decentralized training needs at least 2 nodes, got {n}")


def torus_shape(n: int) -> tuple[int, int]:
    """``(rows, cols)`` of the most square ``rows x cols = n`` torus, ``rows <= cols``.

    Raises
    ------
    ValueError
        If ``n`` has no factorisation with both sides >= 2 (``n`` < 4 or prime).
    """
    rows = max((r for r in range(2, math.isqrt(n) + 1) if n % r == 0), default=0)
    if rows == 0:
        raise ValueError(
            f"a torus needs n = rows x cols with rows, cols >= 2; {n} nodes has none "
            "(use a composite number of nodes, e.g. 8 = 2x4 or 16 = 4x4)"
        )
    return rows, n // rows


def topology_graph(
    topology: str, n: int, *, edge_probability: float = 0.5, seed: int = 0
) -> nx.Graph:
    """The communication graph ``topology`` on nodes ``0..n-1``.

    ``ring`` (cycle), ``torus`` (2-D periodic grid, :func:`torus_shape`), ``complete``,
    ``exponential`` (``i`` linked to ``i +- 2^k mod n`` for ``2^k < n``), ``erdos_renyi``
    (each edge with ``edge_probability``, redrawn from ``seed`` until connected, at most
    100 draws), ``star`` (node 0 the hub).

    Raises
    ------
    ValueError
        Unknown topology, fewer than 2 nodes, a torus of a prime ``n``, an edge
        probability outside (0, 1], or no connected Erdos-Renyi draw.
    """
    _check_nodes(n)
    if topology == "ring":
        graph = nx.cycle_graph(n)
    elif topology == "torus":
        rows, cols = torus_shape(n)
        grid = nx.grid_2d_graph(rows, cols, periodic=True)
        graph = nx.convert_node_labels_to_integers(grid, ordering="sorted")
    elif topology == "complete":
        graph = nx.complete_graph(n)
    elif topology == "exponential":
        graph = nx.empty_graph(n)
        hop = 1
        while hop < n:
            graph.add_edges_from((i, (i + hop) % n) for i in range(n))
            hop *= 2
    elif topology == "erdos_renyi":
        if not 0.0 < edge_probability <= 1.0:
            raise ValueError(f"edge_probability must be in (0, 1], got {edge_probability}")
        rng = np.random.default_rng(seed)
        for _ in range(100):
            graph = nx.erdos_renyi_graph(n, edge_probability, seed=int(rng.integers(2**31)))
            if nx.is_connected(graph):
                break
        else:
            raise ValueError(
                f"no connected Erdos-Renyi graph on {n} nodes with edge probability "
                f"{edge_probability} in 100 draws: raise edge_probability"
            )
    elif topology == "star":
        graph = nx.star_graph(n - 1)
    else:
        raise ValueError(f"unknown topology {topology!r}: choose one of {', '.join(TOPOLOGIES)}")
    graph.remove_edges_from(nx.selfloop_edges(graph))
    return graph


def metropolis_hastings(graph: nx.Graph) -> np.ndarray:
    """Metropolis-Hastings weights: ``W_ij = 1 / (1 + max(deg_i, deg_j))`` on each edge,
    ``W_ii = 1 - sum_{j != i} W_ij``. Symmetric and doubly stochastic, shape ``(n, n)``."""
    n = graph.number_of_nodes()
    deg = dict(graph.degree())
    w = np.zeros((n, n))
    for i, j in graph.edges():
        w[i, j] = w[j, i] = 1.0 / (1.0 + max(deg[i], deg[j]))
    w[np.diag_indices(n)] = 1.0 - w.sum(axis=1)
    return w


def components(w: np.ndarray, atol: float = 1e-12) -> list[list[int]]:
    """Connected components of the graph whose edges are ``w``'s off-diagonal entries
    larger than ``atol`` in magnitude, each a sorted list of node indices, ordered by
    their smallest node. One component: gossip mixes every node (a positive spectral
    gap for a symmetric doubly stochastic ``w`` with a positive diagonal)."""
    graph = nx.from_numpy_array((np.abs(np.asarray(w)) > atol).astype(int))
    graph.remove_edges_from(nx.selfloop_edges(graph))
    return sorted(sorted(int(i) for i in c) for c in nx.connected_components(graph))


@dataclass(frozen=True)
class GossipMatrix:
    """A symmetric doubly stochastic gossip matrix and its spectrum.

    Attributes
    ----------
    W : np.ndarray
        ``(n, n)`` weights; ``W @ X`` is one gossip round of the ``(n, d)`` stack ``X``.
        Its nonzero off-diagonal weights must connect every node.
    topology : str
        What it was built from (``ring``, ..., with ``+gap`` when the gap was set).
    """

    W: np.ndarray
    topology: str
    eigenvalues: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Check the matrix.

        Raises
        ------
        ValueError
            Not square, fewer than 2 nodes, not symmetric with rows summing to 1,
            disconnected (naming the components, :func:`components`), or an eigenvalue
            ``-1`` (periodic gossip): the spectral gap would be 0.
        """
        w = np.asarray(self.W, dtype=float)
        if w.ndim != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"a gossip matrix is square, got shape {w.shape}")
        _check_nodes(w.shape[0])
        if not np.allclose(w, w.T, atol=1e-12) or not np.allclose(w.sum(1), 1.0, atol=1e-12):
            raise ValueError("a gossip matrix must be symmetric with rows summing to 1")
        parts = components(w)
        if len(parts) > 1:
            raise ValueError(
                f"a gossip matrix must connect every node (spectral gap 0 otherwise): its "
                f"nonzero weights split the {w.shape[0]} nodes into {len(parts)} components "
                f"{'; '.join(str(p) for p in parts)}"
            )
        object.__setattr__(self, "W", w)
        object.__setattr__(self, "eigenvalues", np.sort(np.linalg.eigvalsh(w))[::-1])
        if self.lambda_min <= -1.0 + 1e-12:
            raise ValueError(
                f"a gossip matrix must have every eigenvalue above -1 (got {self.lambda_min:.6g}: "
                "gossip oscillates and never reaches consensus; add self-weights, e.g. "
                "(I + W) / 2)"
            )

    @property
    def n(self) -> int:
        """Number of nodes."""
        return int(self.W.shape[0])

    @property
    def lambda_2(self) -> float:
        """Second largest eigenvalue."""
        return float(self.eigenvalues[1])

    @property
    def lambda_min(self) -> float:
        """Smallest eigenvalue."""
        return float(self.eigenvalues[-1])

    @property
    def mixing_rate(self) -> float:
        """``lambda = max(|lambda_2|, |lambda_min|)``: plain gossip's contraction per round."""
        return float(max(abs(self.lambda_2), abs(self.lambda_min)))

    @property
    def spectral_gap(self) -> float:
        """``1 - lambda`` in [0, 1]; 0 means a disconnected graph."""
        return float(min(1.0, max(0.0, 1.0 - self.mixing_rate)))

    def lazy(self) -> GossipMatrix:
        """The lazy gossip matrix ``W' = (I + W) / 2``: every node keeps half its own vector
        each round. Its eigenvalues are exactly ``(1 + lambda_i) / 2``, so
        ``lambda_min(W') >= 0`` (D2's ``lambda_min > -1/3`` always holds) and its gap is
        ``(1 - lambda_2) / 2`` once ``lambda_2 >= |lambda_min|``. Same graph, same sparsity.

        Source: the lazy chain ``(I + P) / 2`` of a Markov chain (Levin and Peres, "Markov
        Chains and Mixing Times", recalled, not re-read); the DeTAG paper's "slack matrix"
        ``W_k = k W + (1 - k) I`` (Lu and De Sa, JMLR 24(93) 2023, Sec. 7.1, read) with
        ``k = 1/2``. Topology name gets ``+lazy``.
        """
        n = self.n
        return GossipMatrix(0.5 * (np.eye(n) + self.W), f"{self.topology}+lazy")

    def describe(self) -> dict[str, float | int | str]:
        """A JSON-able summary: topology, n, lambda_2, lambda_min, spectral gap."""
        return {
            "topology": self.topology,
            "nodes": self.n,
            "lambda_2": self.lambda_2,
            "lambda_min": self.lambda_min,
            "spectral_gap": self.spectral_gap,
        }


def gossip_matrix(
    topology: str,
    n: int,
    spectral_gap: float | None = None,
    *,
    edge_probability: float = 0.5,
    seed: int = 0,
    lazy: bool = False,
) -> GossipMatrix:
    """Metropolis-Hastings gossip matrix of ``topology`` on ``n`` nodes.

    With ``lazy``, the Metropolis-Hastings ``W`` is first replaced by ``(I + W) / 2``
    (:meth:`GossipMatrix.lazy`: eigenvalues ``(1 + lambda) / 2 >= 0``, what D2 needs on
    even rings and tori); ``spectral_gap``, if set, then applies to that matrix.

    With ``spectral_gap`` set, the gap is made exactly that by lazy mixing
    ``W' = (1 - c) I + c W`` with ``c = gap / (1 - lambda_2(W))``: on ``complete``
    (``W = 11^T / n``) this is ``gap 11^T / n + (1 - gap) I``, the experiments' knob of the
    DeTAG paper; on a sparse topology it keeps the sparsity. Only gaps up to the
    topology's own ``1 - lambda_2`` can be reached this way.

    Raises
    ------
    ValueError
        As :func:`topology_graph`; ``spectral_gap`` outside (0, 1]; a gap the topology
        cannot reach; a disconnected graph.
    """
    if spectral_gap is not None and not 0.0 < spectral_gap <= 1.0:
        raise ValueError(f"spectral_gap must be in (0, 1], got {spectral_gap}")
    graph = topology_graph(topology, n, edge_probability=edge_probability, seed=seed)
    base = GossipMatrix(metropolis_hastings(graph), topology)
    if base.spectral_gap <= 1e-12:
        raise ValueError(f"the {topology} graph on {n} nodes is not connected")
    if lazy:
        base = base.lazy()
    if spectral_gap is None:
        return base
    reach = 1.0 - base.lambda_2
    c = spectral_gap / reach
    if c > 1.0 + 1e-12 or c * (1.0 - base.lambda_min) > 2.0 - spectral_gap + 1e-12:
        raise ValueError(
            f"spectral_gap={spectral_gap:g} is out of reach of the {topology} topology on "
            f"{n} nodes (largest exact gap there: {reach:.4g}); use topology=complete for "
            "any gap in (0, 1]"
        )
    c = min(c, 1.0)
    w = (1.0 - c) * np.eye(n) + c * base.W
    return GossipMatrix(w, f"{base.topology}+gap")


# ------------------------------------------------------------------------------------
# gossip
# ------------------------------------------------------------------------------------
def consensus_distance(X: np.ndarray) -> float:
    """``(1/n) sum_i ||x_i - xbar||^2`` of the ``(n, d)`` stack ``X`` (squared units of x)."""
    X = np.asarray(X)
    return float(np.mean(np.sum((X - X.mean(axis=0)) ** 2, axis=1)))


def acceleration_eta(mixing_rate: float) -> float:
    """Momentum of accelerated gossip: ``eta = (1 - sqrt(1 - l^2)) / (1 + sqrt(1 - l^2))``
    for mixing rate ``l`` = ``max(|lambda_2|, |lambda_min|)`` (DeTAG paper, Algorithm 3)."""
    if not 0.0 <= mixing_rate < 1.0:
        raise ValueError(f"mixing rate must be in [0, 1), got {mixing_rate}")
    root = math.sqrt(1.0 - mixing_rate**2)
    return (1.0 - root) / (1.0 + root)


def accelerated_gossip(X: np.ndarray, W: np.ndarray, rounds: int, eta: float) -> np.ndarray:
    """Accelerated (Chebyshev-style, heavy-ball) gossip over ``rounds`` rounds.

    ``X_{-1} = X_0 = X``; ``X_{k+1} = (1 + eta) W X_k - eta X_{k-1}`` (Lu and De Sa 2021,
    Algorithm 3, after Liu and Morse 2011). Keeps the average and constant vectors;
    shrinks disagreement roughly by ``sqrt(eta) ~ 1 - sqrt(gap)`` per round instead of
    ``1 - gap``. ``X``: ``(n, d)``; returns ``(n, d)``.
    """
    prev, cur = X, X
    for _ in range(rounds):
        prev, cur = cur, (1.0 + eta) * (W @ cur) - eta * prev
    return cur
