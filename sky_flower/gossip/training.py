"""Data and model side of decentralized training (no Flower).

- :func:`sorted_shuffle_partition`: the DeTAG paper's data heterogeneity. Sort the
  training examples by label, shuffle the first ``X`` % of that order among themselves,
  cut it into ``n`` equal contiguous parts (``X = 100``: IID; ``X = 0``: every node
  sees only one or two labels).
- :class:`FlatModel`: a small MLP whose parameters are one flat vector (what the gossip
  core of :mod:`sky_flower.gossip.algorithms` averages), with the loss and gradient on a batch for
  one node (the Flower client) or for all ``n`` nodes at once (the one-process
  benchmark, ``torch.func.vmap``); both compute the same numbers.
- :func:`minibatch_indices`: the seeded mini-batch of a node at a step, shared by both
  paths so they draw the same samples.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from sky_flower.pipeline.data import Split
from sky_flower.pipeline.models import build_mlp


def sorted_shuffle_partition(
    labels: np.ndarray, num_nodes: int, homogeneity: float, seed: int = 0
) -> list[np.ndarray]:
    """Split example indices over ``num_nodes`` nodes with ``homogeneity`` X in [0, 100].

    Sort indices by label (stable), shuffle the first ``round(X / 100 * N)`` of them
    among themselves (seeded), cut the order into ``num_nodes`` contiguous parts of
    ``N // num_nodes`` examples each (the last ``N % num_nodes`` of the order are
    dropped, so every node's loss weighs the same in the average).

    Returns a list of ``num_nodes`` int64 index arrays, each of length ``N // num_nodes``.

    Raises
    ------
    ValueError
        ``num_nodes < 2``, more nodes than examples, or X outside [0, 100].
    """
    labels = np.asarray(labels)
    if num_nodes < 2:
        raise ValueError(f"decentralized training needs at least 2 nodes, got {num_nodes}")
    if not 0.0 <= homogeneity <= 100.0:
        raise ValueError(f"homogeneity must be in [0, 100] (percent shuffled), got {homogeneity}")
    size = len(labels) // num_nodes
    if size < 1:
        raise ValueError(f"{num_nodes} nodes but only {len(labels)} training examples")
    order = np.argsort(labels, kind="stable")
    shuffled = int(round(homogeneity / 100.0 * len(order)))
    order[:shuffled] = np.random.default_rng(seed).permutation(order[:shuffled])
    return [order[i * size : (i + 1) * size].astype(np.int64) for i in range(num_nodes)]


def node_splits(train: Split, num_nodes: int, homogeneity: float, seed: int = 0) -> list[Split]:
    """Each node's local training data (see :func:`sorted_shuffle_partition`)."""
    parts = sorted_shuffle_partition(train.y, num_nodes, homogeneity, seed)
    return [Split(train.x[p], train.y[p]) for p in parts]


def minibatch_indices(
    n_local: int, batch_size: int, seed: int, node: int, step: int, k: int = 0
) -> np.ndarray:
    """Indices of mini-batch ``k`` of ``node`` at ``step``: ``batch_size`` distinct draws
    from ``range(n_local)``, seeded by ``(seed, node, step, k)``.

    Raises
    ------
    ValueError
        ``batch_size`` not in ``[1, n_local]``.
    """
    if not 1 <= batch_size <= n_local:
        raise ValueError(f"batch_size {batch_size} must be in [1, {n_local}] (local examples)")
    return np.random.default_rng([seed, node, step, k]).choice(n_local, batch_size, replace=False)


class FlatModel:
    """An MLP ``64 -> hidden_width -> 10`` (ReLU; ``hidden_width = 0``: logistic
    regression) whose parameters live in one flat float vector of length :attr:`dim`.

    Parameters
    ----------
    hidden_width : int (default: 32)
    in_features, num_classes : int (default: 64, 10)
    """

    def __init__(
        self, hidden_width: int = 32, in_features: int = 64, num_classes: int = 10
    ) -> None:
        if hidden_width < 0:
            raise ValueError(f"hidden_width must be >= 0, got {hidden_width}")
        self.sizes = (in_features, hidden_width, num_classes)
        self.module = self._build()
        self.hidden_width = hidden_width
        self._names = [name for name, _ in self.module.named_parameters()]
        self._shapes = [tuple(p.shape) for p in self.module.parameters()]
        self._sizes = [int(np.prod(s)) for s in self._shapes]
        self.dim = int(sum(self._sizes))
        self._grad = grad_and_value(self._loss)
        self._batched = vmap(self._grad)

    def _build(self) -> nn.Module:
        in_features, hidden, classes = self.sizes
        if hidden == 0:
            return nn.Sequential(nn.Linear(in_features, classes))
        return build_mlp(in_features, hidden, 1, classes)

    def initial(self, seed: int = 0) -> np.ndarray:
        """A seeded initial model (He initialisation), shape ``(dim,)``, float64."""
        torch.manual_seed(seed)
        params = self._build().parameters()
        return torch.cat([p.detach().reshape(-1) for p in params]).double().numpy()

    def params(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        """The flat ``(dim,)`` tensor as the module's named parameters (views)."""
        chunks = torch.split(vec, self._sizes)
        return {n: c.reshape(s) for n, c, s in zip(self._names, chunks, self._shapes, strict=True)}

    def _loss(self, vec: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(self.module, self.params(vec), (x,))
        return nn.functional.cross_entropy(logits, y)

    def loss_and_grad(
        self, vec: np.ndarray, x: np.ndarray, y: np.ndarray
    ) -> tuple[float, np.ndarray]:
        """Mean cross-entropy of model ``vec`` (``(dim,)``) on ``x`` (``(B, 64)``),
        ``y`` (``(B,)`` int64) and its gradient (``(dim,)``, float64)."""
        g, loss = self._grad(_t(vec), torch.as_tensor(x), torch.as_tensor(y))
        return float(loss), g.double().numpy()

    def batched_loss_and_grad(
        self, vecs: np.ndarray, x: np.ndarray, y: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`loss_and_grad` for ``n`` nodes at once: ``vecs`` ``(n, dim)``, ``x``
        ``(n, B, 64)``, ``y`` ``(n, B)``; returns losses ``(n,)`` and gradients
        ``(n, dim)``."""
        g, loss = self._batched(_t(vecs), torch.as_tensor(x), torch.as_tensor(y))
        return loss.double().numpy(), g.double().numpy()

    def evaluate(self, vec: np.ndarray, data: Split) -> dict[str, float]:
        """``{"loss", "accuracy"}`` of model ``vec`` on all of ``data``."""
        with torch.no_grad():
            logits = functional_call(self.module, self.params(_t(vec)), (torch.as_tensor(data.x),))
            y = torch.as_tensor(data.y)
            return {
                "loss": float(nn.functional.cross_entropy(logits, y)),
                "accuracy": float((logits.argmax(1) == y).double().mean()),
            }


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float32))
