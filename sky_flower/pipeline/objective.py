"""The training objective of a split model: its loss and metric functions, and how
they travel to the nodes (by reference: ``"module:qualname"``).

Classification is the default: ``torch.nn.functional.cross_entropy`` as the loss and
:func:`correct_count` as the metric. A user model with another objective passes its own
functions to :class:`sky_flower.strategies.sky.SkyStrategy` (``loss_fn``,
``metric_fn``), or names them in the Hydra job (``objective.loss``, ``objective.metric``,
the ``task`` group: ``classification``, ``regression``, ``lm``) or the run config
(``loss``, ``metric``); they must be module-level functions importable on every node.
:func:`check_objective` tries them on the model's output before any node is contacted.
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


def mse(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean squared error of a regression target, ``output`` reshaped to ``labels``'
    shape (a ``(n, 1)`` output against ``(n,)`` labels would otherwise broadcast to
    ``(n, n)``).

    Raises
    ------
    ValueError
        If ``output`` does not have as many elements as ``labels``.
    """
    if output.numel() != labels.numel():
        raise ValueError(
            f"a regression output of shape {tuple(output.shape)} does not match labels of "
            f"shape {tuple(labels.shape)}: the model's last layer needs one output per target"
        )
    return torch.nn.functional.mse_loss(output.reshape(labels.shape), labels.float())


def rounded_correct(output: torch.Tensor, labels: torch.Tensor) -> int:
    """Regression targets hit after rounding: ``round(output) == labels`` (e.g. a digit
    regressed as a number), counted per target."""
    return int((output.reshape(labels.shape).round() == labels.round()).sum())


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


def _shown(fn: Callable[..., Any]) -> str:
    try:
        return ref(fn)
    except ValueError:
        return repr(fn)


def check_objective(
    model: torch.nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor],
    metric_fn: Callable[..., Any],
    names: tuple[str, str] = ("objective.loss", "objective.metric"),
) -> None:
    """Try the loss and the metric on ``model``'s output for a few real samples ``x``
    (``(n, *input_shape)``, n >= 2) and their ``labels``, as the last stage will, so a
    mismatch (e.g. float labels with cross-entropy, a regression head against a
    classification loss) fails before any node is contacted. ``model`` is left as it was
    (the forward runs on a copy, in train mode).

    Raises
    ------
    ValueError
        Naming the key (``names``), the output's and the labels' shape and dtype, if the
        loss fails, is not a finite scalar with a gradient, or the metric fails or is not
        a number.
    """
    import copy
    import math

    probe = copy.deepcopy(model).train()
    out = probe(x)
    if not torch.is_tensor(out):
        raise ValueError(f"the model returns {type(out).__name__}, not one tensor")
    seen = (
        f"the model's output {tuple(out.shape)} {out.dtype} and the labels "
        f"{tuple(labels.shape)} {labels.dtype}"
    )
    try:
        loss = loss_fn(out, labels)
        ok = torch.is_tensor(loss) and loss.numel() == 1 and loss.requires_grad
        if not ok or not math.isfinite(float(loss.detach())):
            raise ValueError(f"it returned {loss!r}, not a finite scalar tensor with a gradient")
        loss.backward()
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise ValueError(f"{names[0]}={_shown(loss_fn)} fails on {seen}: {err}") from err
    try:
        float(metric_fn(out.detach(), labels))
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise ValueError(f"{names[1]}={_shown(metric_fn)} fails on {seen}: {err}") from err
