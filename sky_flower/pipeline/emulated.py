"""Fleet emulation inside a ``direct`` stage: slowdown and link delay (pure torch).

SkyComputing's emulation (Zhu, Li, You, arXiv 2202.11836): a node ``slowdown`` times
slower sleeps that multiple of its measured compute, and a link's delay is slept by the
sender. :class:`EmulatedStage` wraps a stage module with identity autograd functions
that time its forward and its backward (from the output's gradient arriving to the
input's gradient computed), numerically the identity. It also keys the stage's
randomness per micro-batch (:func:`sky_flower.pipeline.stage.forward_layers`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sky_flower.core.clock import synchronize
from sky_flower.pipeline.stage import RngKey, forward_layers


@dataclass
class Emulated:
    """What the fleet's emulation does inside a ``direct`` stage.

    Attributes
    ----------
    slowdown : float
        Sleep ``slowdown x`` each forward's and each backward's measured compute time of
        the stage module, per micro-batch (SkyComputing's emulation).
    send_next_s : Callable[[int], float]
        Seconds of link delay to send ``bytes`` to the next stage (activations).
    send_prev_s : Callable[[int], float]
        Seconds of link delay to send ``bytes`` to the previous stage (gradients).

    The link delay is slept by the sender right after it computes the tensor, before the
    schedule sends it: it blocks the sending stage (a real NIC would overlap it with the
    next micro-batch's compute), so it is an upper bound on the link's effect.
    """

    slowdown: float = 0.0
    send_next_s: Callable[[int], float] = lambda nbytes: 0.0
    send_prev_s: Callable[[int], float] = lambda nbytes: 0.0
    compute_s: float = field(default=0.0, init=False)

    def slow_down(self, elapsed: float, compute: bool = True) -> None:
        """Sleep ``slowdown x elapsed`` seconds after work that took ``elapsed``;
        ``compute``: count it in :attr:`compute_s` (the stage's forward and backward)."""
        if compute:
            self.compute_s += elapsed
        if self.slowdown > 0:
            time.sleep(self.slowdown * elapsed)


class _BackwardEnd(torch.autograd.Function):
    """Identity whose backward ends the stage's backward timing (input side)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list) -> torch.Tensor:  # noqa: D102
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        wrapper = ctx.box[0]
        wrapper._end_backward(g)
        return g, None


class _BackwardStart(torch.autograd.Function):
    """Identity whose backward starts the stage's backward timing (output side)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list) -> torch.Tensor:  # noqa: D102
        ctx.box = box
        # zero bubble detaches the stage's output in place after the input-gradient pass,
        # which a view refuses: a copy there (the same values)
        return x.clone() if box[0].plain_output else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        ctx.box[0]._t_backward = time.perf_counter()
        return g, None


class EmulatedStage(nn.Module):
    """A stage module with the fleet's emulation around it (numerically the identity).

    Forward: run ``inner``, sleep ``slowdown x`` its time, then the link delay to send
    the output to the next stage (not on the last stage). Backward: from the output's
    gradient arriving to the input's gradient computed, then the same sleep, then the
    link delay to send the input gradient back (not on the first stage).

    Parameters
    ----------
    inner : nn.Module
        The stage's layers; ``(B/M, ...) -> (B/M, ...)``.
    emulated : Emulated
        What to emulate; ``emulated.compute_s`` accumulates the measured compute (s).
    is_first, is_last : bool
        Position of the stage in the pipeline.
    device : torch.device, optional
        Where ``inner`` computes (default the CPU): the input is moved there.
    comm_device : torch.device, optional
        Where the schedule's tensors live (default the CPU: gloo peers): the output is
        moved there. Autograd carries each gradient back across both moves; a CUDA
        device is synchronized before the forward's timer stops.

    The ``i``-th forward since :meth:`start_step` is micro-batch ``i`` of that step
    (GPipe and 1F1B run a step's forwards in micro-batch order); its layers' randomness
    is keyed accordingly.
    """

    def __init__(  # noqa: PLR0913
        self,
        inner: nn.Module,
        emulated: Emulated,
        is_first: bool,
        is_last: bool,
        device: torch.device | None = None,
        comm_device: torch.device | None = None,
    ):
        super().__init__()
        self.inner = inner
        self.device = device or torch.device("cpu")
        self.comm_device = comm_device or torch.device("cpu")
        self.emulated = emulated
        self.is_first, self.is_last = is_first, is_last
        self._t_backward = 0.0
        self.plain_output = False  # zero bubble: the output is not a view (see above)
        self._box = [self]
        self._key, self._microbatch = RngKey(), 0
        self._waiting = 0  # integer input: micro-batches whose backward has not ended

    def start_step(self, key: RngKey) -> None:
        """The next forward is micro-batch 0 of step ``key``."""
        self._key, self._microbatch = key, 0

    def _end_backward(self, g: torch.Tensor | None) -> None:
        self.emulated.slow_down(time.perf_counter() - self._t_backward)
        if not self.is_first and g is not None:
            time.sleep(self.emulated.send_prev_s(g.numel() * g.element_size()))

    def _end_on_parameter_grads(self) -> None:
        """An integer input (token ids) has no gradient: the backward ends when every
        parameter's gradient of this micro-batch is computed.

        One hook at a time: a hook on the parameters fires at the end of the next
        backward that computes their gradients, so hooks registered by several forwards
        would all fire in the first micro-batch's backward (each timing the sleeps of
        the ones before it). The next micro-batch's hook is registered when the
        previous one has fired."""
        params = [p for p in self.inner.parameters() if p.requires_grad]
        if not params or not torch.is_grad_enabled():
            return
        self._waiting += 1
        if self._waiting > 1:  # a hook is pending: this micro-batch's comes after it
            return

        def done(_grads: Any) -> None:  # noqa: ANN401 - autograd's gradients
            handle.pop().remove()
            self._end_backward(None)
            self._waiting -= 1
            if self._waiting:
                handle.append(torch.autograd.graph.register_multi_grad_hook(params, done))

        handle: list = [torch.autograd.graph.register_multi_grad_hook(params, done)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B/M, ...) -> (B/M, ...)``, as ``inner``."""
        if not x.is_floating_point():
            self._end_on_parameter_grads()
        elif not x.requires_grad:  # stage 0: a leaf, so that the backward timing ends here
            x = x.detach().requires_grad_(torch.is_grad_enabled())
        if x.requires_grad:
            x = _BackwardEnd.apply(x, self._box)
        t0 = time.perf_counter()
        y = forward_layers(self.inner, x.to(self.device), self._key, self._microbatch)
        synchronize(self.device)
        self._microbatch += 1
        elapsed = time.perf_counter() - t0
        y = y.to(self.comm_device)
        self.emulated.slow_down(elapsed)
        if not self.is_last:
            time.sleep(self.emulated.send_next_s(y.numel() * y.element_size()))
        return _BackwardStart.apply(y, self._box) if y.requires_grad else y


class EmulatedOptimizer:
    """An optimizer whose ``step`` the emulated device runs ``1 + slowdown`` times as
    slowly (it sleeps ``slowdown x`` the step's measured time), as the benchmark round
    predicts (its per-layer optimizer step is scaled by the node's slowdown) and as the
    relay's stage handlers already do (their step is inside the timed backward).

    Parameters
    ----------
    inner : torch.optim.Optimizer
        The stage's optimizer.
    emulated : Emulated
        Its ``slowdown``; the step's time is not added to ``compute_s`` (the stage's
        forward and backward only).
    """

    def __init__(self, inner: torch.optim.Optimizer, emulated: Emulated) -> None:
        self.inner, self.emulated = inner, emulated

    def step(self) -> None:
        """``inner.step()``, then the emulated slowdown's sleep."""
        t0 = time.perf_counter()
        self.inner.step()
        self.emulated.slow_down(time.perf_counter() - t0, compute=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``inner.zero_grad``."""
        self.inner.zero_grad(set_to_none=set_to_none)


def emulate_weight_pass(stage: Any, emulated: Emulated) -> None:  # noqa: ANN401 - a PipelineStage
    """Time (and slow down, ``emulated.slowdown x``) a zero-bubble stage's deferred
    weight-gradient pass, which runs outside the autograd functions of
    :class:`EmulatedStage` (``PipelineStage.backward_weight_one_chunk``, wrapped on the
    instance; numerically the identity)."""
    inner = stage.backward_weight_one_chunk

    def timed(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - torch's signature
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        emulated.slow_down(time.perf_counter() - t0)
        return out

    stage.backward_weight_one_chunk = timed
