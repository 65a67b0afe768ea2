"""The training objective of a split model: its loss and metric functions, and how
they travel to the nodes (by reference: ``"module:qualname"``).

Classification is the default: ``torch.nn.functional.cross_entropy`` as the loss and
:func:`correct_count` as the metric. A user model with another objective passes its own
functions to :class:`sky_flower.strategies.sky.SkyStrategy` (``loss_fn``,
``metric_fn``), or names them in the Hydra job (``objective.loss``, ``objective.metric``,
the ``task`` group: ``classification``, ``regression``, ``lm``) or the run config
(``loss``, ``metric``); they must be module-level functions importable on every node.
:func:`check_objective` tries them on the model's output before any node is contacted.

**The loss contract** (:class:`LossReduction`). A step of ``B`` samples is cut into
``M`` equal micro-batches and the loss is computed per micro-batch, on the last stage;
split training must equal unsplit training, i.e. the gradient of the user's loss on the
whole batch. How the micro-batches' values make the whole batch's depends on how the
loss reduces, so the objective declares it (``objective.reduction``):

* ``mean`` (default; ``cross_entropy``, ``mse_loss`` with ``reduction="mean"``): the
  loss is the mean over the micro-batch's samples; the batch's is the mean of the
  ``M`` equal micro-batches' (each scaled by ``1 / M``);
* ``sum`` (``reduction="sum"``): the batch's loss is the sum of the micro-batches'
  (scale 1);
* ``weighted`` (a mean over a label-dependent count: tokens with padding or
  ``ignore_index``, class weights): the loss is the mean over the weight
  ``objective.weight(labels)`` of its micro-batch (e.g. :func:`sky_flower.pipeline.lm.
  token_count`); the batch's is ``sum_m w_m loss_m / W``, ``W`` the weight of the whole
  step's labels (each micro-batch scaled by ``w_m / W``; one of weight 0 adds nothing,
  its loss, a mean over nothing, is not computed).

The scale is applied once, to each micro-batch's loss before its backward (as
``torch.distributed.pipelining``'s ``scale_grads`` does for ``mean`` after it), and
the reported loss is the sum of the scaled values: the whole batch's loss. A loss that
does not return one number is refused.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

REDUCTIONS = ("mean", "sum", "weighted")


@dataclass(frozen=True)
class LossReduction:
    """How the loss reduces over a micro-batch, hence how micro-batches make a batch
    (the module docstring's contract).

    Attributes
    ----------
    kind : {"mean", "sum", "weighted"}
        The loss's reduction (``objective.reduction``).
    weight_fn : callable, optional
        ``weighted`` only: ``labels (b, ...) -> number >= 0``, what the loss averages
        over (``objective.weight``; e.g. the tokens not ignored).

    Raises
    ------
    ValueError
        On another kind, ``weighted`` without ``weight_fn`` or another kind with one.
    """

    kind: str = "mean"
    weight_fn: Callable[[torch.Tensor], Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in REDUCTIONS:
            raise ValueError(
                f"objective.reduction={self.kind!r} is not one of {', '.join(REDUCTIONS)}"
            )
        if (self.kind == "weighted") != (self.weight_fn is not None):
            raise ValueError(
                "objective.reduction=weighted needs objective.weight (labels -> the count "
                "the loss averages over, e.g. sky_flower.pipeline.lm:token_count), and "
                f"only it takes one (got reduction={self.kind!r} with weight "
                f"{'set' if self.weight_fn is not None else 'unset'})"
            )

    def weight(self, labels: torch.Tensor) -> float:
        """``weight_fn(labels)`` as a float (``weighted``).

        Raises
        ------
        ValueError
            If it is negative or not finite.
        """
        w = float(self.weight_fn(labels))  # type: ignore[misc]
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(
                f"objective.weight={_shown(self.weight_fn)} returned {w} for labels of "
                f"shape {tuple(labels.shape)}: it must be a finite count >= 0"
            )
        return w

    def total(self, labels: torch.Tensor) -> float | None:
        """The weight ``W`` of a whole step's ``labels`` (``weighted``; None otherwise).

        Raises
        ------
        ValueError
            If ``W`` is 0 (every label ignored: the batch's mean loss is 0 / 0).
        """
        if self.kind != "weighted":
            return None
        w = self.weight(labels)
        if w <= 0:
            raise ValueError(
                f"the step's labels {tuple(labels.shape)} have weight 0 under "
                f"objective.weight={_shown(self.weight_fn)} (every label ignored?): the "
                "batch's mean loss would be 0 / 0; drop such batches from the data"
            )
        return w

    def micro_loss(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        output: torch.Tensor,
        labels: torch.Tensor,
        microbatches: int,
        total: float | None = None,
    ) -> torch.Tensor:
        """One micro-batch's share of the batch's loss: ``loss_fn(output, labels)``
        scaled by ``1 / M`` (``mean``), 1 (``sum``) or ``w_m / W`` (``weighted``;
        ``total`` is ``W``, :meth:`total` of the whole step's labels). Back-propagate it
        as is; the batch's loss is the sum of these.

        Raises
        ------
        ValueError
            If the loss is not one number (e.g. ``reduction="none"``), or ``weighted``
            without ``total``.
        """
        if self.kind == "weighted":
            if total is None:
                raise ValueError("objective.reduction=weighted needs the step's total weight")
            w = self.weight(labels)
            if w == 0:  # a mean over nothing (NaN) that adds nothing: zero, with a graph
                return output.sum() * 0.0
        loss = scalar_loss(loss_fn, loss_fn(output, labels))
        if self.kind == "mean":
            return loss / microbatches
        if self.kind == "sum":
            return loss
        return loss * (w / total)


def scalar_loss(loss_fn: Callable[..., Any], loss: Any) -> torch.Tensor:  # noqa: ANN401
    """``loss`` as a 0-d tensor.

    Raises
    ------
    ValueError
        Naming ``loss_fn`` if ``loss`` is not a tensor of one element.
    """
    if not torch.is_tensor(loss) or loss.numel() != 1:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(
            f"objective.loss={_shown(loss_fn)} returned {shape}, not one number: reduce "
            "it over the micro-batch (.mean() with objective.reduction=mean, .sum() with "
            "objective.reduction=sum)"
        )
    return loss.reshape(())


def loss_reduction(kind: str = "mean", weight: str = "") -> LossReduction:
    """The :class:`LossReduction` of the settings ``objective.reduction`` and
    ``objective.weight`` (``"module:qualname"`` or ``""``).

    Raises
    ------
    ValueError
        As :class:`LossReduction`, or if ``weight`` cannot be imported.
    """
    return LossReduction(kind, resolve(weight) if weight else None)


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
        If ``fn`` is a lambda or a nested function (not importable by name), a function
        of the script being run (``__main__``: the nodes cannot import it), or a
        ``"module:qualname"`` string (what a config takes; here the function itself).
    """
    if isinstance(fn, str):
        raise ValueError(
            f"{fn!r} is a reference string: pass the function object itself (e.g. "
            f'SkyModel(..., loss_fn=my_loss)); a "module:qualname" string is what the '
            "config's objective.loss / run config loss takes"
        )
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module == "__main__":
        raise ValueError(
            f"{fn!r} is defined in the script being run (__main__), which the nodes cannot "
            "import: define it in a module of your package and import it from there"
        )
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


def check_objective(  # noqa: PLR0913
    model: torch.nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor],
    metric_fn: Callable[..., Any],
    names: tuple[str, str] = ("objective.loss", "objective.metric"),
    reduction: LossReduction | None = None,
) -> None:
    """Try the loss and the metric on ``model``'s output for a few real samples ``x``
    (``(n, *input_shape)``, n >= 2) and their ``labels``, as the last stage will, so a
    mismatch (e.g. float labels with cross-entropy, a regression head against a
    classification loss) fails before any node is contacted. ``model`` is left as it was
    (the forward runs on a copy, in train mode).

    The declared ``reduction`` (default ``mean``) is checked too: the loss of the ``n``
    samples must equal its two halves' combined as declared (``mean``: the halves'
    means weighted by their sizes; ``sum``: their sum; ``weighted``: weighted by
    ``objective.weight``), to ``rtol = 1e-4`` (a float32 loss of a few samples rounds
    to about 1e-7 relative). A ``reduction="sum"`` loss declared ``mean`` (or the
    reverse) would train a model ``M`` times off; a loss that couples the samples of a
    batch cannot be split at all: both are refused here.

    Raises
    ------
    ValueError
        Naming the key (``names``), the output's and the labels' shape and dtype, if the
        loss fails, is not a finite scalar with a gradient, does not reduce as declared,
        or the metric fails or is not a number.
    """
    import copy

    reduction = reduction or LossReduction()
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
    check_reduction(out.detach(), labels, loss_fn, reduction, float(loss.detach()), names[0])
    try:
        float(metric_fn(out.detach(), labels))
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise ValueError(f"{names[1]}={_shown(metric_fn)} fails on {seen}: {err}") from err


def check_reduction(  # noqa: PLR0913
    out: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor],
    reduction: LossReduction,
    whole: float,
    name: str,
    setting: str = "objective.reduction",
) -> None:
    """Check that the loss of the two halves of ``out`` / ``labels`` (``(n, ...)``),
    combined as ``reduction`` declares, is the loss of the whole (``whole``), to rtol
    1e-4; ``n < 2`` is not checked.

    Raises
    ------
    ValueError
        When it is not, naming ``name`` (the loss), ``setting`` (the reduction's key in
        the caller's words, with its weight's key beside it) and what to set."""
    n = out.shape[0]
    if n < 2:
        return
    cut = n // 2
    halves = [(out[:cut], labels[:cut]), (out[cut:], labels[cut:])]
    if reduction.kind == "weighted":
        total = reduction.total(labels)
        weights = [reduction.weight(y) for _, y in halves]
        parts = [
            w / total * float(loss_fn(o, y))
            for (o, y), w in zip(halves, weights, strict=True)
            if w > 0
        ]
    else:
        scale = [cut / n, (n - cut) / n] if reduction.kind == "mean" else [1.0, 1.0]
        parts = [c * float(loss_fn(o, y)) for (o, y), c in zip(halves, scale, strict=True)]
    combined = sum(parts)
    if not math.isclose(combined, whole, rel_tol=1e-4, abs_tol=1e-6):
        weight = "objective.weight" if setting == "objective.reduction" else "loss-weight"
        hint = {
            "mean": f"a sum over the samples? set {setting}=sum; a mean over a count "
            "that depends on the labels (tokens not -100, class weights)? set "
            f"{setting}=weighted and {weight} (e.g. sky_flower.pipeline.lm:token_count)",
            "sum": f"a mean over the samples? set {setting}=mean",
            "weighted": f"{weight} must count what the loss averages over",
        }[reduction.kind]
        raise ValueError(
            f"{name}={_shown(loss_fn)} does not reduce as {setting}="
            f"{reduction.kind} declares: on {n} samples it is {whole:.6g}, but its two "
            f"halves combined as {reduction.kind!r} give {combined:.6g} ({hint}; a loss that "
            "couples the samples of a batch cannot be split into micro-batches)"
        )
