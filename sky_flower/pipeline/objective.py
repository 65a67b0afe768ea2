"""The training objective of a split model: its loss and metric functions, and how
they travel to the nodes (by reference: ``"module:qualname"``).

Classification is the default: ``torch.nn.functional.cross_entropy`` as the loss and
:func:`correct_count` as the metric. A user model with another objective passes its own
functions to :class:`sky_flower.strategies.sky.SkyStrategy` (``loss_fn``,
``metric_fn``); they must be module-level functions importable on every node.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch


def correct_count(output: torch.Tensor, labels: torch.Tensor) -> int:
    """Correct predictions of a classifier.

    Parameters
    ----------
    output : torch.Tensor, shape (n, classes)
        Logits (or scores) per sample.
    labels : torch.Tensor, shape (n,)
        Class indices.

    Returns
    -------
    int
        Samples whose arg-max class is the label.
    """
    return int((output.argmax(dim=1) == labels).sum())


def ref(fn: Callable[..., Any]) -> str:
    """``"module:qualname"`` of a module-level function (what :func:`resolve` imports).

    Raises
    ------
    ValueError
        If ``fn`` is a lambda or a nested function (not importable by name).
    """
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not name or "<" in name:
        raise ValueError(
            f"{fn!r} cannot travel to the nodes: pass a module-level function "
            "(the nodes import it by name)"
        )
    return f"{module}:{name}"


def resolve(reference: str) -> Callable[..., Any]:
    """The function named by ``reference`` (``"module:qualname"``, see :func:`ref`).

    Raises
    ------
    ValueError
        If ``reference`` is not of that form or names nothing importable.
    """
    module, _, name = reference.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"cannot import {reference!r}: {err}") from err
    if not callable(obj):
        raise ValueError(f"{reference!r} is not callable")
    return obj
