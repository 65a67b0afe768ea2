"""Bad data found before Flower starts (before Ray, the benchmark round and planning):
whole-data-set checks that cost one pass of ``min`` / ``max`` / ``isfinite`` over the
arrays already in memory.

- Labels outside the model's output: :func:`probe_rows` adds the samples that hold the
  smallest and the largest label (and input token id) of the *whole* training set to
  the samples the objective is tried on, so the probe fails whatever the seed, and
  :func:`label_range_error` words the failure against the model's output width.
- ``NaN`` / ``inf`` features, which would make the data owner's stage-0 output
  non-finite and be blamed on "stage 0 on <node>": :func:`check_finite_data` refuses
  them naming the data set, the split, how many samples and the first one.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _rows_bad(a: np.ndarray) -> np.ndarray:
    """Indices of the rows (first axis) of float array ``a`` holding ``NaN``/``inf``."""
    flat = a.reshape(len(a), -1) if a.ndim > 1 else a.reshape(len(a), 1)
    return np.flatnonzero(~np.isfinite(flat).all(axis=1))


def check_finite_data(split: Any, dataset: str, which: str) -> None:  # noqa: ANN401 - a Split
    """Refuse a split whose float features or float labels hold ``NaN`` or ``inf``.

    Parameters
    ----------
    split : Split
        ``x`` ``(n, *input_shape)`` and ``y`` ``(n, ...)`` arrays; integer arrays are
        always finite.
    dataset : str
        The data set's name, for the message (``dataset.name``).
    which : str
        ``"training"`` or ``"test"``.

    Raises
    ------
    ValueError
        Naming the data set, the split, the array (features or labels), how many samples
        are non-finite and the first of them.
    """
    for what, arr in (("features", split.x), ("labels", split.y)):
        a = np.asarray(arr)
        if a.dtype.kind not in "fc" or len(a) == 0:
            continue
        bad = _rows_bad(a)
        if len(bad):
            raise ValueError(
                f"dataset {dataset!r} has non-finite {what} (NaN or inf) in {len(bad)} of "
                f"{len(a)} {which} samples (the first: sample {int(bad[0])}); training on "
                f"them makes every stage's output non-finite. Clean or impute them in the "
                f"data set's loader (dataset._target_) before training"
            )


def _extreme_rows(a: np.ndarray) -> list[int]:
    """The rows holding the smallest and the largest value of integer array ``a``."""
    if a.dtype.kind not in "iu" or len(a) == 0:
        return []
    flat = a.reshape(len(a), -1)
    return [int(flat.min(axis=1).argmin()), int(flat.max(axis=1).argmax())]


def probe_rows(split: Any, first: int = 2) -> list[int]:  # noqa: ANN401 - a Split
    """The training samples the objective is tried on before Flower starts: the first
    ``first`` and, for integer labels (class indices, token ids) and integer inputs
    (token ids), the samples holding the smallest and the largest value of the whole
    split, so that a label or token out of the model's range fails the probe whatever
    the seed. Duplicates removed, order kept.

    Returns
    -------
    list of int
        Row indices into ``split.x`` / ``split.y`` (at most ``first + 4``).
    """
    rows = list(range(min(first, len(split))))
    rows += _extreme_rows(np.asarray(split.y)) + _extreme_rows(np.asarray(split.x))
    return list(dict.fromkeys(rows))


def label_range(y: np.ndarray) -> tuple[int, int] | None:
    """``(min, max)`` of integer labels over the whole split (PyTorch's ignore index
    ``-100``, a padding label, left out), else None (float labels, or none but padding).
    """
    a = np.asarray(y)
    if a.dtype.kind not in "iu" or a.size == 0:
        return None
    a = a[a != -100]
    return (int(a.min()), int(a.max())) if a.size else None


def label_range_error(y: np.ndarray, width: int, dataset: str, model: str) -> str:
    """The message for integer labels outside ``[0, width)``, the model's output width
    (its last dimension: the number of classes, a language model's vocabulary), or ``""``
    when they are inside it (or not integers)."""
    span = label_range(y)
    if span is None or (0 <= span[0] and span[1] < width):
        return ""
    return (
        f"dataset {dataset!r} has labels in [{span[0]}, {span[1]}] (over all "
        f"{len(y)} training samples) but model {model!r} outputs {width} values per "
        f"sample (its last dimension), so labels must lie in [0, {width - 1}]: give the "
        f"model {span[1] + 1} outputs (e.g. model.num_classes={span[1] + 1}) or remap the "
        f"labels in the data set's loader"
    )
