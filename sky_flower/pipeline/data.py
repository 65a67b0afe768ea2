"""Data sets as ``(train, test)`` splits, loaded by ``_target_``; the embedded default is
scikit-learn's digits (1,797 8x8 images, 10 classes).

Nothing is downloaded: ``load_digits`` ships with scikit-learn. The split into train
and test is seeded, so the server (which keeps the held-out test split) and every data
owner (which keeps its partition of the train split) agree without exchanging data.

A data set config (``conf/dataset/<name>.yaml``) names its loader by ``_target_``: any
importable ``loader(test_fraction: float, seed: int, **kwargs) -> (train Split, test
Split)``, deterministic in ``seed`` (every node calls it and must get the same split);
:func:`load_dataset` calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sky_flower.pipeline.sources import Split

DATASETS = ("digits",)
LOADERS = {"digits": "sky_flower.pipeline.data.load_digits"}


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
    return load_digits(test_fraction, seed)


def load_digits(
    test_fraction: float = 0.2, seed: int = 0, float_labels: bool = False
) -> tuple[Split, Split]:
    """scikit-learn's digits as ``(train, test)``, stratified and seeded: ``x`` float32
    ``(n, 64)`` in [0, 1], ``y`` the digit (int64 ``(n,)``; float32 with
    ``float_labels``, a regression target).

    Raises
    ------
    ValueError
        On a test fraction outside (0, 1).
    """
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
    if float_labels:
        ytr, yte = ytr.astype(np.float32), yte.astype(np.float32)
    return Split(xtr, ytr), Split(xte, yte)


def load_dataset(cfg: Mapping, seed: int = 0) -> tuple[Any, Any]:
    """``(train, test)`` of data set config ``cfg``: ``cfg["_target_"](test_fraction,
    seed, **other keys)`` (``name`` is a label; ``test_fraction`` defaults to 0.2). The
    old spelling ``{"name": "digits"}`` (no ``_target_``) still loads digits. Each split
    may be a :class:`Split` or any :mod:`sky_flower.pipeline.sources` source (a
    ``DataLoader``, a map-style ``Dataset``, a ``datasets.Dataset``), returned as one.

    Raises
    ------
    ValueError
        Naming ``dataset._target_``: on a config without one whose ``name`` is not a
        known data set, a loader that cannot be imported or called, or one that does not
        return two splits (``x`` and ``y`` arrays of equal length, the train split at
        least one sample).
    """
    from sky_flower.pipeline.models import call_target

    cfg = dict(cfg)
    name, target = cfg.pop("name", None), cfg.pop("_target_", None)
    if target is None:
        if name not in LOADERS:
            raise ValueError(
                f"unknown dataset {name!r}: choose one with dataset=<name> (one of "
                f"{', '.join(DATASETS)}) or give your own loader as dataset._target_="
                "<module.function>"
            )
        target = LOADERS[name]
    cfg.setdefault("test_fraction", 0.2)
    out = call_target("dataset", target, {**cfg, "seed": seed})
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise ValueError(
            f"dataset._target_={target} must return (train, test) Splits, got {type(out).__name__}"
        )
    from sky_flower.pipeline.sources import as_source

    parts = []
    for part, split in zip(("train", "test"), out, strict=True):
        try:
            parts.append(as_source(split))
        except ValueError as err:
            raise ValueError(
                f"dataset._target_={target}: its {part} split must be a Split (arrays x and "
                "y of equal length), a map-style torch Dataset, a DataLoader or a "
                f"datasets.Dataset ({err})"
            ) from err
    if len(parts[0]) < 1:
        raise ValueError(f"dataset._target_={target} returned an empty train split")
    return parts[0], parts[1]


def owner_partition(train: Any, owner_index: int, num_owners: int, seed: int = 0) -> Any:  # noqa: ANN401
    """IID partition ``owner_index`` of ``num_owners`` of the train split (a
    :class:`Split` or a source: its ``subset`` of those rows).

    Raises
    ------
    ValueError
        If ``owner_index`` is not in ``[0, num_owners)``.
    """
    if not 0 <= owner_index < num_owners:
        raise ValueError(f"owner_index {owner_index} not in [0, {num_owners})")
    order = np.random.default_rng(seed).permutation(len(train))
    part = np.array_split(order, num_owners)[owner_index]
    return train.subset(part)


def owner_split(
    dataset: str | Mapping,
    owner_index: int,
    num_owners: int,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> Split:
    """Data owner ``owner_index``'s IID partition (of ``num_owners``) of the train split of
    ``dataset``: a data set config (``conf/dataset/*.yaml``, loaded by
    :func:`load_dataset`, the server's call, so every node gets the same split) or, the
    old spelling, a name (``"digits"``) with ``test_fraction``.

    Raises
    ------
    ValueError
        As :func:`load_dataset` and :func:`owner_partition`.
    """
    spec = dict(dataset) if isinstance(dataset, Mapping) else {"name": dataset}
    if not isinstance(dataset, Mapping):
        spec["test_fraction"] = test_fraction
    train, _ = load_dataset(spec, seed)
    return owner_partition(train, owner_index, num_owners, seed)


def batch_indices(n: int, batch_size: int, epoch: int, seed: int = 0) -> np.ndarray:
    """Shuffled indices of epoch ``epoch`` as ``(n // batch_size, batch_size)`` (last
    incomplete batch dropped, so every step has ``batch_size`` samples)."""
    steps = n // batch_size
    if steps < 1:
        raise ValueError(f"batch_size {batch_size} is larger than the {n} local examples")
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[: steps * batch_size].reshape(steps, batch_size)
