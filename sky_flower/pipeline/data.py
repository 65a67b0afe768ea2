"""The embedded default data set: scikit-learn's digits (1,797 8x8 images, 10 classes).

Nothing is downloaded: ``load_digits`` ships with scikit-learn. The split into train
and test is seeded, so the server (which keeps the held-out test split) and every data
owner (which keeps its partition of the train split) agree without exchanging data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DATASETS = ("digits",)


@dataclass(frozen=True)
class Split:
    """Features ``x`` (float32, ``(n, 64)``, scaled to [0, 1]) and labels ``y`` (int64)."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


def load_split(
    name: str = "digits", test_fraction: float = 0.2, seed: int = 0
) -> tuple[Split, Split]:
    """Return ``(train, test)``, stratified and seeded.

    Raises
    ------
    ValueError
        On an unknown data set name or a test fraction outside (0, 1).
    """
    if name != "digits":
        raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    # imported here: a ClientApp process (one per message in deployment) starts faster
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return Split(xtr, ytr), Split(xte, yte)


def owner_partition(train: Split, owner_index: int, num_owners: int, seed: int = 0) -> Split:
    """IID partition ``owner_index`` of ``num_owners`` of the train split.

    Raises
    ------
    ValueError
        If ``owner_index`` is not in ``[0, num_owners)``.
    """
    if not 0 <= owner_index < num_owners:
        raise ValueError(f"owner_index {owner_index} not in [0, {num_owners})")
    order = np.random.default_rng(seed).permutation(len(train))
    part = np.array_split(order, num_owners)[owner_index]
    return Split(train.x[part], train.y[part])


def batch_indices(n: int, batch_size: int, epoch: int, seed: int = 0) -> np.ndarray:
    """Shuffled indices of epoch ``epoch`` as ``(n // batch_size, batch_size)`` (last
    incomplete batch dropped, so every step has ``batch_size`` samples)."""
    steps = n // batch_size
    if steps < 1:
        raise ValueError(f"batch_size {batch_size} is larger than the {n} local examples")
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[: steps * batch_size].reshape(steps, batch_size)
