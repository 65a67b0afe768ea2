"""One pipeline stage: a contiguous block of layers, its optimizer, and its step logic.

Pure PyTorch (no Flower import). The relay transport keeps no autograd graph between
messages, so a stage stashes its input on the forward pass and re-runs its forward
when the output gradient comes back (activation recomputation, Chen et al. 2016,
arXiv 1604.06174); results equal those of keeping the graph for deterministic layers.

A batch of ``B`` samples is cut into ``M`` equal micro-batches; the last stage scales
each micro-batch's mean loss by ``1 / M`` so that accumulated gradients equal those of
the whole batch's mean loss. Every stage steps its own optimizer once per batch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from sky_flower.core.profile import as_layers, default_optimizer_factory
from sky_flower.pipeline.data import Split, batch_indices
from sky_flower.pipeline.objective import correct_count

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricFn = Callable[[torch.Tensor, torch.Tensor], Any]


def build_stage(
    model_fn: Callable[[], nn.Module], first: int, last: int, weights: Mapping | None = None
) -> nn.Sequential:
    """Layers ``first..last`` (inclusive) of ``model_fn()`` as an ``nn.Sequential``.

    The model is built on the meta device (no weight memory, no init cost), the stage's
    layers are then materialised and loaded from ``weights`` (a state dict keyed like
    the full model's, e.g. ``"3.0.weight"``). Without ``weights`` the stage keeps a
    fresh initialisation of its own layers.

    Raises
    ------
    ValueError
        If the layer range is outside the model.
    """
    if weights is None:
        layers = as_layers(model_fn())
    else:
        with torch.device("meta"):
            layers = as_layers(model_fn())
    if not 0 <= first <= last < len(layers):
        raise ValueError(f"layers {first}..{last} outside a model of {len(layers)} layers")
    stage = nn.Sequential(OrderedDict((str(j), layers[j]) for j in range(first, last + 1)))
    if weights is not None:
        stage = stage.to_empty(device="cpu")
        stage.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()}, strict=True)
    return stage


def stage_optimizer(module: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    """A fresh optimizer ``name`` (:func:`sky_flower.core.profile.default_optimizer_factory`)
    over the trainable parameters of ``module``.

    Raises
    ------
    ValueError
        On an unknown optimizer name.
    """
    return default_optimizer_factory(name, lr)([p for p in module.parameters() if p.requires_grad])


def step_batch(
    data: Split, batch_size: int, server_round: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The data owner's batch of training step ``step`` of round ``server_round``.

    The owner's examples are shuffled once per epoch (1000 epochs per round at most,
    the order seeded by ``seed``); step ``step`` takes the next ``batch_size`` of them.

    Returns
    -------
    x : torch.Tensor, shape (batch_size, *input_shape)
    labels : torch.Tensor, shape (batch_size,), int64

    Raises
    ------
    ValueError
        If the owner holds fewer than ``batch_size`` examples.
    """
    per_epoch = len(data) // batch_size
    if per_epoch < 1:
        raise ValueError(f"the data owner holds {len(data)} examples, fewer than a batch")
    epoch = server_round * 1000 + step // per_epoch
    idx = batch_indices(len(data), batch_size, epoch, seed)[step % per_epoch]
    return torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])


def slice_state(full: Mapping, first: int, last: int) -> dict:
    """The entries of a full-model state dict that belong to layers ``first..last``."""
    keep = {str(j) for j in range(first, last + 1)}
    return {k: v for k, v in full.items() if k.split(".", 1)[0] in keep}


def optimizer_to_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flatten an optimizer's per-parameter state into ``{"<param>.<name>": tensor}``.

    Hyperparameters are not included: they come from the stage config each time."""
    flat = {}
    for pid, st in opt.state_dict()["state"].items():
        for name, value in st.items():
            flat[f"{pid}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return flat


def optimizer_from_tensors(opt: torch.optim.Optimizer, flat: Mapping) -> None:
    """Load state flattened by :func:`optimizer_to_tensors` into ``opt`` (which keeps its
    own hyperparameters)."""
    state: dict[int, dict] = {}
    for key, value in flat.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = torch.as_tensor(value).clone()
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


class StageExecutor:
    """Runs one stage's share of a training step.

    Parameters
    ----------
    module : nn.Module
        The stage's layers.
    optimizer : torch.optim.Optimizer
        Over ``module``'s parameters.
    microbatches : int
        Micro-batches in each input this executor is given; the batch dimension of every
        input must be divisible by it.
    loss_divisor : int, optional
        The last stage divides each micro-batch's mean loss by this (default
        ``microbatches``). The pipelined relay hands a stage ``c`` of a step's ``M``
        micro-batches per message and sets it to ``M``, so gradients accumulated over
        the step equal those of the whole batch's mean loss.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        microbatches: int,
        loss_divisor: int | None = None,
    ):
        self.module = module
        self.optimizer = optimizer
        self.microbatches = microbatches
        self.loss_divisor = loss_divisor or microbatches

    def grads(self) -> dict[str, torch.Tensor]:
        """The accumulated parameter gradients, keyed by parameter name (those that have one)."""
        return {n: p.grad for n, p in self.module.named_parameters() if p.grad is not None}

    def load_grads(self, grads: Mapping) -> None:
        """Set the parameters' ``.grad`` to ``grads`` (from :meth:`grads`), so the next
        backward adds to them."""
        for n, p in self.module.named_parameters():
            if n in grads:
                p.grad = torch.as_tensor(grads[n]).clone()

    def apply_step(self) -> None:
        """Step the optimizer on the accumulated gradients and clear them."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _chunks(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if t.shape[0] % self.microbatches:
            raise ValueError(
                f"batch of {t.shape[0]} is not divisible into {self.microbatches} micro-batches"
            )
        return torch.chunk(t, self.microbatches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Forward of every micro-batch without a graph; ``(B, ...) -> (B, ...)``."""
        with torch.no_grad():
            return torch.cat([self.module(xm) for xm in self._chunks(x)])

    def backward(
        self, x: torch.Tensor, grad_out: torch.Tensor, input_grad: bool, step: bool = True
    ) -> torch.Tensor | None:
        """Recompute each micro-batch's forward from the stashed input ``x``, back-propagate
        ``grad_out``, step the optimizer (unless ``step=False``: gradients stay
        accumulated). Returns the input gradient ``(B, ...)`` if ``input_grad`` else None."""
        grads = []
        for xm, gm in zip(self._chunks(x), self._chunks(grad_out), strict=True):
            xm = xm.detach().requires_grad_(input_grad)
            self.module(xm).backward(gm)
            if input_grad:
                grads.append(xm.grad)
        if step:
            self.apply_step()
        return torch.cat(grads) if input_grad else None

    def forward_backward_loss(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        input_grad: bool,
        loss_fn: LossFn | None = None,
        step: bool = True,
        metric_fn: MetricFn | None = None,
    ) -> tuple[torch.Tensor | None, float, int]:
        """Last stage: forward, loss (mean per micro-batch / ``loss_divisor``), backward,
        optimizer step (unless ``step=False``).

        Parameters
        ----------
        x : torch.Tensor, shape (B, ...)
            The stage's input.
        labels : torch.Tensor, shape (B,)
            Targets.
        input_grad : bool
            Return the input's gradient (every stage but the first).
        loss_fn : callable, optional
            ``(output, labels) -> scalar`` mean loss of a micro-batch (default
            cross-entropy).
        step : bool
            Step the optimizer (else the gradients stay accumulated).
        metric_fn : callable, optional
            ``(output, labels) -> int`` summed over the micro-batches (default correct
            predictions, :func:`sky_flower.pipeline.objective.correct_count`).

        Returns
        -------
        tuple
            ``(input gradient (B, ...) or None, batch loss, metric total)``.
        """
        loss_fn = loss_fn or nn.functional.cross_entropy
        metric_fn = metric_fn or correct_count
        grads, total, correct = [], 0.0, 0
        for xm, ym in zip(self._chunks(x), self._chunks(labels), strict=True):
            xm = xm.detach().requires_grad_(input_grad)
            out = self.module(xm)
            loss = loss_fn(out, ym) / self.loss_divisor
            loss.backward()
            total += loss.detach().item()
            correct += int(metric_fn(out.detach(), ym))
            if input_grad:
                grads.append(xm.grad)
        if step:
            self.apply_step()
        return (torch.cat(grads) if input_grad else None), total, correct


def run_split_step(
    stages: list[StageExecutor],
    x: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: LossFn | None = None,
    metric_fn: MetricFn | None = None,
) -> float:
    """One training step through a chain of stages in one process (the relay protocol's
    logic without the transport): forward through all, loss at the last (``loss_fn``,
    ``metric_fn`` as :meth:`StageExecutor.forward_backward_loss`), backward.
    Returns the batch loss. Used by tests and as the reference for the transports."""
    inputs = []
    h = x
    for st in stages[:-1]:
        inputs.append(h)
        h = st.forward(h)
    g, loss, _ = stages[-1].forward_backward_loss(
        h, labels, len(stages) > 1, loss_fn=loss_fn, metric_fn=metric_fn
    )
    for k in range(len(stages) - 2, -1, -1):
        g = stages[k].backward(inputs[k], g, input_grad=k > 0)
    return loss
