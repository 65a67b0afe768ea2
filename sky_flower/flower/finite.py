"""Finite or rejected: one check for every tensor, record and metric that crosses a node.

Every strategy checks what arrives (stage activations and gradients, stage weights, async
updates, gossip gradients, metrics) with these helpers, so a ``NaN`` or ``inf`` from one node
fails that node's contribution by name instead of turning the global model non-finite.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord


class NonFiniteError(ValueError):
    """A tensor, record or metric holds ``NaN`` or ``inf``.

    Attributes
    ----------
    what:
        What was checked, as the message names it (e.g. ``"stage 1's activations"``).
    names:
        The array or metric names that hold non-finite values (empty for a bare tensor).
    """

    def __init__(self, what: str, names: Iterable[str] = ()) -> None:
        self.what = what
        self.names = tuple(names)
        where = f" in {', '.join(self.names[:8])}" if self.names else ""
        more = f" (+{len(self.names) - 8} more)" if len(self.names) > 8 else ""
        super().__init__(f"{what} holds non-finite values (NaN or inf){where}{more}")


def _array_finite(value: Any) -> bool:  # noqa: ANN401 - tensor, ndarray or number
    if isinstance(value, torch.Tensor):
        if not (value.is_floating_point() or value.is_complex()):
            return True
        return bool(torch.isfinite(value).all())
    arr = np.asarray(value)
    if arr.dtype.kind not in "fc":
        return True
    return bool(np.isfinite(arr).all())


def nonfinite_names(values: Any) -> list[str]:  # noqa: ANN401 - see below
    """Names of the non-finite entries of ``values``.

    Parameters
    ----------
    values:
        An ``ArrayRecord``, a ``MetricRecord``, a mapping of names to tensors / arrays /
        numbers (a state dict), or a single tensor, array or number (named ``""``).

    Returns
    -------
    list[str]
        Names (keys) whose values hold ``NaN`` or ``inf``; integer and boolean arrays are
        always finite. Empty when everything is finite.
    """
    if isinstance(values, ArrayRecord):
        return [k for k, a in values.items() if not _array_finite(a.numpy())]
    if isinstance(values, MetricRecord | Mapping):
        out = []
        for k, v in values.items():
            items = v if isinstance(v, list | tuple) else [v]
            if not all(_array_finite(x) for x in items):
                out.append(str(k))
        return out
    return [] if _array_finite(values) else [""]


def check_finite(values: Any, what: str) -> None:  # noqa: ANN401 - as nonfinite_names
    """Raise :class:`NonFiniteError` naming ``what`` if ``values`` holds ``NaN``/``inf``.

    Parameters
    ----------
    values:
        Anything :func:`nonfinite_names` accepts.
    what:
        What the values are, for the message (``"node 'phone''s stage weights"``).

    Raises
    ------
    NonFiniteError
        If any entry is non-finite.
    """
    bad = nonfinite_names(values)
    if bad:
        raise NonFiniteError(what, [b for b in bad if b])


def json_safe(payload: Any) -> tuple[Any, list[str]]:  # noqa: ANN401 - a JSON-bound payload
    """``payload`` with every non-finite float replaced by ``None``, and where they were.

    Parameters
    ----------
    payload:
        Nested dicts / lists / tuples of JSON values (numpy scalars allowed).

    Returns
    -------
    tuple[Any, list[str]]
        The cleaned payload (dicts and lists copied, tuples as lists) and the JSON paths
        (``"rows[3].test_loss"``) of the values replaced; ``json.dumps(..., allow_nan=False)``
        accepts the payload.
    """
    where: list[str] = []

    def clean(v: Any, path: str) -> Any:  # noqa: ANN401
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            where.append(path or "$")
            return None
        if isinstance(v, Mapping):
            return {k: clean(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return v

    return clean(payload, ""), where
