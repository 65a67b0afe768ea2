"""One pipeline stage: a contiguous block of layers, its optimizer, and its step logic.

Pure PyTorch (no Flower import). The relay transport keeps no autograd graph between
messages, so a stage stashes its input on the forward pass and re-runs its forward
when the output gradient comes back (activation recomputation, Chen et al. 2016,
arXiv 1604.06174); results equal those of keeping the graph for deterministic layers.

A batch of ``B`` samples is cut into ``M`` equal micro-batches; the last stage scales
each micro-batch's loss as the objective's reduction declares (``1 / M`` for a mean,
1 for a sum, ``w_m / W`` for a weighted mean:
:class:`sky_flower.pipeline.objective.LossReduction`), once, before its backward, so
that accumulated gradients equal those of the user's loss on the whole batch. Every
stage steps its own optimizer once per batch (a stage without trainable parameters has
none and skips the step).

Stateful layers are exact on every path (in-process, relay, direct):

* **Buffers** (BatchNorm running statistics, ``num_batches_tracked``): the graph-free
  forward leaves them untouched (:func:`buffers_kept`); the recomputation, run once per
  micro-batch in micro-batch order, is the one that updates them, as the whole model
  run on the same micro-batches in the same order does.
* **Randomness** (dropout): layer ``j``'s forward of micro-batch ``m`` of step ``s``
  of round ``r`` draws from the CPU generator seeded by ``(seed, r, s, m, j)``
  (:func:`forward_layers`, :func:`layer_seed`), the global generator being restored
  after it; on a GPU, from that GPU's generator seeded the same way (CUDA's Philox
  stream differs from the CPU's: a layer's masks depend on the kind of device it runs
  on, never on where the model is cut). The recomputation thus replays the forward's
  masks exactly (what ``torch.utils.checkpoint`` does with ``preserve_rng_state``), on
  any node and in any process. Stages on different nodes cannot share one generator
  stream, so this keyed stream *defines* the reference: the whole model run with
  :func:`forward_layers` on the same micro-batches (``tests/reference.py``'s
  ``reference_rounds``); it does not depend on where the model is cut.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sky_flower.core.clock import synchronize
from sky_flower.core.profile import as_layers, default_optimizer_factory
from sky_flower.core.ties import tied_parameters
from sky_flower.pipeline.data import Split, batch_indices
from sky_flower.pipeline.objective import LossReduction, correct_count
from sky_flower.pipeline.sources import DataSource, as_source, nonfinite_rows

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricFn = Callable[[torch.Tensor, torch.Tensor], Any]


def build_stage(
    model_fn: Callable[[], nn.Module],
    first: int,
    last: int,
    weights: Mapping | None = None,
    device: torch.device | str = "cpu",
) -> nn.Sequential:
    """Layers ``first..last`` (inclusive) of ``model_fn()`` as an ``nn.Sequential`` on
    ``device``.

    The model is built on the meta device (no weight memory, no init cost;
    :func:`meta_layers`), the stage's layers are then materialised on ``device`` and
    loaded from ``weights`` (a state dict keyed like the full model's, e.g.
    ``"3.0.weight"``, on any device). Without ``weights`` the stage keeps a fresh
    initialisation of its own layers (drawn on the CPU, then moved).

    Raises
    ------
    ValueError
        If the layer range is outside the model.
    """
    layers = as_layers(model_fn()) if weights is None else meta_layers(model_fn)
    if not 0 <= first <= last < len(layers):
        raise ValueError(f"layers {first}..{last} outside a model of {len(layers)} layers")
    stage = nn.Sequential(OrderedDict((str(j), layers[j]) for j in range(first, last + 1)))
    if weights is not None:
        ties = tied_parameters(stage)  # to_empty gives every module its own copy: re-tie
        stage = stage.to_empty(device=device)
        for names in ties:
            shared = stage.get_parameter(names[0])
            for name in names[1:]:
                parent, _, attr = name.rpartition(".")
                setattr(stage.get_submodule(parent), attr, shared)
        stage.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()}, strict=True)
    elif torch.device(device).type != "cpu":
        stage = stage.to(device)
    return stage


def meta_layers(model_fn: Callable[[], nn.Module]) -> list[nn.Module]:
    """``model_fn()``'s layers built on the meta device (no weight memory, no init
    cost), or on the CPU where the model cannot be built there: a converted model
    (:func:`sky_flower.pipeline.graph.sequential_of`) runs its forward to trace it, and
    a forward may need values (``transformers``' mask checks call ``.item()``)."""
    try:
        with torch.device("meta"):
            return as_layers(model_fn())
    except Exception:  # noqa: BLE001 - a real error raises again below, on the CPU
        return as_layers(model_fn())


def stage_optimizer(module: nn.Module, name: str, lr: float) -> torch.optim.Optimizer | None:
    """A fresh optimizer ``name`` (:func:`sky_flower.core.profile.default_optimizer_factory`)
    over the trainable parameters of ``module``; None for a stage without any (it only
    forwards activations and back-propagates gradients).

    Raises
    ------
    ValueError
        On an unknown optimizer name.
    """
    return make_stage_optimizer(module, default_optimizer_factory(name, lr))


def make_stage_optimizer(
    module: nn.Module, make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> torch.optim.Optimizer | None:
    """``make_opt`` over the trainable parameters of ``module``, or None if it has none."""
    params = [p for p in module.parameters() if p.requires_grad]
    return make_opt(params) if params else None


def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (else buffer); the CPU if it has none."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


@dataclass(frozen=True)
class RngKey:
    """The step a forward belongs to, for the keyed random stream of
    :func:`forward_layers`: the run's ``seed``, the server ``round``, the ``step``."""

    seed: int = 0
    round: int = 0
    step: int = 0


def layer_seed(key: RngKey, microbatch: int, layer: int) -> int:
    """The CPU generator's seed for layer ``layer``'s forward of micro-batch
    ``microbatch`` of step ``key``: 63 bits of BLAKE2b of the five integers (the same
    on every machine and process)."""
    data = struct.pack("<5q", key.seed, key.round, key.step, microbatch, layer)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def forward_layers(
    module: nn.Module, x: torch.Tensor, key: RngKey, microbatch: int
) -> torch.Tensor:
    """``module(x)`` with each layer's randomness keyed (see the module docstring).

    In training mode, each child ``j`` of an ``nn.Sequential`` runs with the CPU
    generator (and, when ``x`` is on a GPU, that GPU's generator) seeded by
    :func:`layer_seed` ``(key, microbatch, j)``; the generators' states are restored
    afterwards. ``j`` is the child's name when it is an
    integer (:func:`build_stage` names a stage's layers by their index in the whole
    model; an ``nn.Sequential``'s default names are positions), else its position.
    Another module is one layer, ``j = 0``. In eval mode this is ``module(x)``.

    Parameters
    ----------
    module : nn.Module
        A stage, or the whole model; ``(b, ...) -> (b, ...)``.
    x : torch.Tensor, shape (b, ...)
        One micro-batch.
    key : RngKey
        Seed, round and step.
    microbatch : int
        Index of the micro-batch within its step.
    """
    if not module.training:
        return module(x)
    children = list(module.named_children()) if isinstance(module, nn.Sequential) else []
    layers = [(int(n) if n.isdigit() else i, m) for i, (n, m) in enumerate(children)]
    outer = torch.get_rng_state()  # once per call: cheaper than fork_rng per layer
    gpu = _cuda_generator(x.device)
    gpu_outer = gpu.get_state() if gpu is not None else None
    try:
        for j, layer in layers or [(0, module)]:
            seed = layer_seed(key, microbatch, j)
            torch.default_generator.manual_seed(seed)
            if gpu is not None:
                gpu.manual_seed(seed)
            x = layer(x)
    finally:
        torch.set_rng_state(outer)
        if gpu is not None:
            gpu.set_state(gpu_outer)
    return x


def _cuda_generator(device: torch.device) -> torch.Generator | None:
    """The default generator of CUDA device ``device``; None on the CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


@contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Run the block without side effects on ``module``'s buffers (BatchNorm running
    statistics, ``num_batches_tracked``): they are copied before and written back
    after, in place."""
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                module.get_buffer(name).copy_(value)


def probe_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` without a graph and without side effects (buffers and the global
    random generator as before): for shapes only."""
    with torch.no_grad(), buffers_kept(module), torch.random.fork_rng(devices=[]):
        return module(x)


def step_batch(
    data: Split | DataSource, batch_size: int, server_round: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The data owner's batch of training step ``step`` of round ``server_round``.

    The owner's examples are shuffled once per epoch (1000 epochs per round at most,
    the order seeded by ``seed``); step ``step`` takes the next ``batch_size`` of them.
    ``data`` is a numpy :class:`Split` or any :mod:`sky_flower.pipeline.sources` source
    (a ``DataLoader``'s data set, a ``datasets.Dataset``): the same rows either way.

    Returns
    -------
    x : torch.Tensor, shape (batch_size, *input_shape)
    labels : torch.Tensor, shape (batch_size,), int64

    Raises
    ------
    ValueError
        If the owner holds fewer than ``batch_size`` examples, or the batch holds NaN or
        inf (naming the rows: training on it would make every stage's output
        non-finite and be blamed on divergence).
    """
    per_epoch = len(data) // batch_size
    if per_epoch < 1:
        raise ValueError(
            f"the data owner holds {len(data)} examples, fewer than a batch of "
            f"{batch_size}: lower schedule.batch_size (run config batch-size) to at most "
            f"{len(data)}, or give this owner more data"
        )
    epoch = server_round * 1000 + step // per_epoch
    idx = batch_indices(len(data), batch_size, epoch, seed)[step % per_epoch]
    x, y = as_source(data).batch(idx)  # an app's own (x, y) holder read as a Split
    for name, t in (("inputs", x), ("labels", y)):
        if len(bad := nonfinite_rows(t)):
            raise ValueError(
                f"the data owner's batch of round {server_round}, step {step} has non-finite "
                f"{name} (NaN or inf) in {len(bad)} of its {len(t)} samples (rows "
                f"{[int(idx[i]) for i in bad[:5]]} of its partition): clean or impute them in "
                "the data set (the up-front check reads a sample of a large data set only)"
            )
    return x, y


def slice_state(full: Mapping, first: int, last: int) -> dict:
    """The entries of a full-model state dict that belong to layers ``first..last``."""
    keep = {str(j) for j in range(first, last + 1)}
    return {k: v for k, v in full.items() if k.split(".", 1)[0] in keep}


def frozen_keys(model: nn.Module) -> frozenset[str]:
    """The state-dict keys of ``model``'s frozen parameters (``requires_grad=False``,
    e.g. the base weights under LoRA adapters), every name of a shared parameter
    included. Training never changes them, so a stage's reply after a round leaves them
    out and FedAvg keeps the global model's (:func:`trained_state`).

    Parameters
    ----------
    model : nn.Module
        A whole model (keys ``"<layer>.<name>"`` of an ``nn.Sequential``) or a stage
        built by :func:`build_stage` (the same keys).

    Returns
    -------
    frozenset of str
        Empty for a model whose parameters all train (full fine-tuning).
    """
    return frozenset(
        name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
    )


def model_frozen_keys(model_fn: Callable[[], nn.Module]) -> frozenset[str]:
    """:func:`frozen_keys` of ``model_fn()``'s layers, built where they cost nothing
    (:func:`meta_layers`), under the whole model's keys ``"<layer>.<name>"``."""
    layers = meta_layers(model_fn)
    return frozen_keys(nn.Sequential(OrderedDict((str(j), m) for j, m in enumerate(layers))))


def trained_state(
    state: Mapping[str, torch.Tensor], frozen: frozenset[str] | set[str]
) -> dict[str, torch.Tensor]:
    """What a stage sends back after a round: the entries of its state dict ``state``
    that training may change (trainable parameters and buffers such as BatchNorm
    statistics), detached, on the CPU; the ``frozen`` parameters' entries
    (:func:`frozen_keys`) are left out."""
    return {k: v.detach().cpu() for k, v in state.items() if k not in frozen}


def optimizer_to_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flatten an optimizer's per-parameter state into ``{"<param>.<name>": tensor}``, on
    the CPU (what travels and what the server keeps).

    Hyperparameters are not included: they come from the stage config each time."""
    flat = {}
    for pid, st in opt.state_dict()["state"].items():
        for name, value in st.items():
            flat[f"{pid}.{name}"] = value.cpu() if torch.is_tensor(value) else torch.tensor(value)
    return flat


def optimizer_from_tensors(opt: torch.optim.Optimizer, flat: Mapping) -> None:
    """Load state flattened by :func:`optimizer_to_tensors` into ``opt`` (which keeps its
    own hyperparameters; ``load_state_dict`` moves each tensor to its parameter's device)."""
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
        The stage's layers (as :func:`build_stage` names them).
    optimizer : torch.optim.Optimizer or None
        Over ``module``'s parameters; None for a stage without trainable parameters
        (the step is then skipped).
    microbatches : int
        Micro-batches in each input this executor is given; the batch dimension of every
        input must be divisible by it.
    loss_divisor : int, optional
        The step's ``M`` for the last stage's loss scaling (default ``microbatches``).
        The pipelined relay hands a stage ``c`` of a step's ``M`` micro-batches per
        message and sets it to ``M``, so gradients accumulated over the step equal those
        of the whole batch's loss.
    rng : RngKey, optional
        The step's key of the layers' random stream (:func:`forward_layers`). Default:
        seed 0, round 0, and the number of steps this executor has taken.
    first_microbatch : int
        Index within the step of the first micro-batch of the inputs given (the relay
        hands a stage one group of micro-batches per message).
    device : torch.device or str, optional
        Where the stage computes (its module must be there already,
        :func:`build_stage`); default: the device of the module's first parameter or
        buffer, else the CPU. Tensors cross at the stage's edges: every input (of any
        device) is moved there, every returned activation, gradient and state tensor
        comes back on the CPU.
    reduction : LossReduction, optional
        How the loss reduces (default ``mean``): how the last stage scales each
        micro-batch's loss (:meth:`LossReduction.micro_loss`).
    """

    def __init__(  # noqa: PLR0913
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        microbatches: int,
        loss_divisor: int | None = None,
        rng: RngKey | None = None,
        first_microbatch: int = 0,
        device: torch.device | str | None = None,
        reduction: LossReduction | None = None,
    ):
        self.module = module
        self.reduction = reduction or LossReduction()
        self.optimizer = optimizer
        self.microbatches = microbatches
        self.loss_divisor = loss_divisor or microbatches
        self.rng = rng
        self.first_microbatch = first_microbatch
        self.steps = 0
        self.device = torch.device(device) if device is not None else module_device(module)

    def grads(self) -> dict[str, torch.Tensor]:
        """The accumulated parameter gradients, keyed by parameter name (those that
        have one), on the CPU."""
        return {n: p.grad.cpu() for n, p in self.module.named_parameters() if p.grad is not None}

    def load_grads(self, grads: Mapping) -> None:
        """Set the parameters' ``.grad`` to ``grads`` (from :meth:`grads`), so the next
        backward adds to them."""
        for n, p in self.module.named_parameters():
            if n in grads:
                p.grad = torch.as_tensor(grads[n]).to(p.device, copy=True)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The stage's state-dict entries that are not parameters (BatchNorm running
        statistics and ``num_batches_tracked``), detached, on the CPU."""
        params = {n for n, _ in self.module.named_parameters()}
        state = self.module.state_dict()
        return {k: v.detach().cpu() for k, v in state.items() if k not in params}

    def apply_step(self) -> None:
        """Step the optimizer on the accumulated gradients and clear them (a stage
        without an optimizer only clears them)."""
        if self.optimizer is not None:
            self.optimizer.step()
        self.module.zero_grad(set_to_none=True)
        synchronize(self.device)  # a GPU's step has run when the handler's timer stops
        self.steps += 1

    def _chunks(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if t.shape[0] % self.microbatches:
            raise ValueError(
                f"batch of {t.shape[0]} is not divisible into {self.microbatches} micro-batches"
            )
        return torch.chunk(t, self.microbatches)

    def _run(self, xm: torch.Tensor, i: int) -> torch.Tensor:
        """The module on the ``i``-th micro-batch of the input, its randomness keyed."""
        key = self.rng or RngKey(step=self.steps)
        return forward_layers(self.module, xm, key, self.first_microbatch + i)

    def forward(self, x: torch.Tensor, input_grad: bool = True) -> torch.Tensor:
        """Forward of every micro-batch, keeping no graph; ``(B, ...) -> (B, ...)`` (on
        the CPU). Leaves the buffers as they were: the recomputation in :meth:`backward`
        updates them.

        In training mode each micro-batch runs as its recomputation will (autograd on,
        the input requiring a gradient as ``backward(..., input_grad)`` asks), and the
        graph is dropped at once: some kernels take another path without autograd
        (``nn.LSTM`` on the CPU: oneDNN's inference kernel) and would send an activation
        that differs in its last bits from the one the backward differentiates. In
        eval mode it runs under ``torch.no_grad``."""
        x = x.to(self.device)
        outs = []
        with torch.set_grad_enabled(self.module.training), buffers_kept(self.module):
            for i, xm in enumerate(self._chunks(x)):
                xm = xm.detach().requires_grad_(
                    self.module.training and input_grad and xm.is_floating_point()
                )
                outs.append(self._run(xm, i).detach())
        return torch.cat(outs).cpu()

    def backward(
        self, x: torch.Tensor, grad_out: torch.Tensor, input_grad: bool, step: bool = True
    ) -> torch.Tensor | None:
        """Recompute each micro-batch's forward from the stashed input ``x`` (same
        random masks as :meth:`forward`; buffers updated once per micro-batch),
        back-propagate ``grad_out``, step the optimizer (unless ``step=False``: gradients
        stay accumulated). Returns the input gradient ``(B, ...)`` if ``input_grad``
        else None (on the CPU)."""
        grads = []
        x, grad_out = x.to(self.device), grad_out.to(self.device)
        chunks = zip(self._chunks(x), self._chunks(grad_out), strict=True)
        for i, (xm, gm) in enumerate(chunks):
            # an integer input (token ids, indices) takes no gradient: zeros are sent back
            xm = xm.detach().requires_grad_(input_grad and xm.is_floating_point())
            out = self._run(xm, i)
            if out.requires_grad:  # a stage whose output needs no gradient has nothing to do
                out.backward(gm)
            if input_grad:
                grads.append(xm.grad if xm.grad is not None else torch.zeros_like(xm))
        if step:
            self.apply_step()
        return torch.cat(grads).cpu() if input_grad else None

    def forward_backward_loss(
        self,
        x: torch.Tensor,
        labels: torch.Tensor,
        input_grad: bool,
        loss_fn: LossFn | None = None,
        step: bool = True,
        metric_fn: MetricFn | None = None,
        total: float | None = None,
    ) -> tuple[torch.Tensor | None, float, int]:
        """Last stage: forward, loss (each micro-batch's scaled by the reduction,
        :meth:`LossReduction.micro_loss`), backward, optimizer step (unless
        ``step=False``).

        Parameters
        ----------
        x : torch.Tensor, shape (B, ...)
            The stage's input.
        labels : torch.Tensor, shape (B,)
            Targets.
        input_grad : bool
            Return the input's gradient (every stage but the first).
        loss_fn : callable, optional
            ``(output, labels) -> scalar`` loss of a micro-batch, reduced as
            ``reduction`` declares (default cross-entropy, a mean).
        step : bool
            Step the optimizer (else the gradients stay accumulated).
        metric_fn : callable, optional
            ``(output, labels) -> int`` summed over the micro-batches (default correct
            predictions, :func:`sky_flower.pipeline.objective.correct_count`).
        total : float, optional
            ``weighted`` reduction: the weight ``W`` of the whole step's labels
            (default: of ``labels``, right when they are the whole step's).

        Returns
        -------
        tuple
            ``(input gradient (B, ...) on the CPU or None, this input's share of the
            batch loss (the batch loss when given the whole step), metric total)``.

        Raises
        ------
        ValueError
            If the loss is not one number, or a ``weighted`` step's labels weigh 0.
        """
        loss_fn = loss_fn or nn.functional.cross_entropy
        metric_fn = metric_fn or correct_count
        x, labels = x.to(self.device), labels.to(self.device)
        if total is None:
            total = self.reduction.total(labels)
        grads, batch_loss, correct = [], 0.0, 0
        chunks = zip(self._chunks(x), self._chunks(labels), strict=True)
        for i, (xm, ym) in enumerate(chunks):
            xm = xm.detach().requires_grad_(input_grad and xm.is_floating_point())
            out = self._run(xm, i)
            loss = self.reduction.micro_loss(loss_fn, out, ym, self.loss_divisor, total)
            if loss.requires_grad:  # not when no stage before or here has parameters
                loss.backward()
            batch_loss += loss.detach().item()
            correct += int(metric_fn(out.detach(), ym))
            if input_grad:
                grads.append(xm.grad if xm.grad is not None else torch.zeros_like(xm))
        if step:
            self.apply_step()
        return (torch.cat(grads).cpu() if input_grad else None), batch_loss, correct


def run_split_step(
    stages: list[StageExecutor],
    x: torch.Tensor,
    labels: torch.Tensor,
    key: RngKey | None = None,
    loss_fn: LossFn | None = None,
    metric_fn: MetricFn | None = None,
    reduction: LossReduction | None = None,
) -> float:
    """One training step through a chain of stages in one process (the relay protocol's
    logic without the transport): forward through all, loss at the last (``loss_fn``,
    ``metric_fn`` as :meth:`StageExecutor.forward_backward_loss`; ``reduction``, if
    given, set on the last stage), backward.
    Returns the batch loss. Used by tests and as the reference for the transports.

    ``key`` (default: each stage's own, :class:`StageExecutor`) keys the step's random
    stream: with ``RngKey(seed, r, s)`` the result equals the whole model's step ``s``
    of round ``r`` in ``tests/reference.py``'s ``reference_rounds``, weights and buffers.
    """
    if key is not None:
        for st in stages:
            st.rng, st.first_microbatch = key, 0
    if reduction is not None:
        stages[-1].reduction = reduction
    inputs = []
    h = x
    for k, st in enumerate(stages[:-1]):
        inputs.append(h)
        h = st.forward(h, input_grad=k > 0)
    g, loss, _ = stages[-1].forward_backward_loss(
        h, labels, len(stages) > 1, loss_fn=loss_fn, metric_fn=metric_fn
    )
    for k in range(len(stages) - 2, -1, -1):
        g = stages[k].backward(inputs[k], g, input_grad=k > 0)
    return loss
