"""Measured peak memory of one pipeline stage's training step (pure PyTorch, no Flower).

:meth:`sky_flower.core.cost.CostModel.stage_memory` predicts a stage's peak as parameters +
gradients + optimizer state + the activations autograd stashes for the micro-batches in
flight. This module measures the same quantity by running the step: the stage's layers
execute a schedule's order of micro-batch forwards and backwards (each forward keeps its
autograd graph until that micro-batch's backward), then the optimizer steps, and the
peak of the bytes held by live tensor storages is returned.

Measurement: :class:`LiveBytes`, a ``TorchDispatchMode`` that registers every tensor
storage an operator returns (and the parameters and optimizer state present at the
start) and subtracts it when the storage is freed (``weakref.finalize``); the peak of the
running sum is kept, with a breakdown by category at that moment. It counts bytes
exactly (no allocator rounding), needs no GPU and is deterministic, unlike the process's
resident set size. (PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker`` does
the same with more categories, but its module hooks keep every micro-batch input that
requires a gradient alive until the tracker exits, which inflates a multi-micro-batch
peak; it also refuses a second forward of the same module.)

What counts: the stage's parameters, their gradients, the optimizer state (after one
warm-up step, as in every step but the first of a training run), each micro-batch's
input from its arrival until its backward is done, everything the forward creates and
autograd keeps, the output (held for its backward, as a pipeline runtime holds it), the
output gradient that arrives, the backward's temporaries, the input gradient that
leaves, and the optimizer step's temporaries.

Example
-------
>>> import torch
>>> from torch import nn
>>> layers = [nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 4)]
>>> peak = measure_stage_memory(layers, torch.randn(2, 8), microbatches=2, kind="gpipe")
>>> peak.total > 0
True
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from sky_flower.core.profile import default_optimizer_factory
from sky_flower.core.simulate import stage_order


def schedule_order(kind: str, microbatches: int, inflight: int | None = None) -> list[str]:
    """Order of one stage's micro-batch passes: ``"F<m>"`` forward, ``"B<m>"`` backward.

    Parameters
    ----------
    kind : {"sequential", "gpipe", "1f1b"}
        ``sequential``: ``F0 B0 F1 B1 ...``; ``gpipe``: all forwards, then all backwards
        in the same order; ``1f1b``: ``inflight`` warm-up forwards, then alternately one
        backward and one forward, then the remaining backwards (PipeDream-Flush).
    microbatches : int
        M >= 1.
    inflight : int, optional
        ``1f1b`` only: forwards before the first backward (``min(S - k, M)`` for stage
        ``k`` of ``S``), clipped to ``1..M``; default M.

    Returns
    -------
    list of str
        ``2 M`` entries: stage 0's order of a pipeline of ``inflight`` stages
        (:func:`sky_flower.core.simulate.stage_order`).

    Raises
    ------
    ValueError
        On an unknown kind or ``microbatches < 1``.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    stages = max(1, min(microbatches, microbatches if inflight is None else inflight))
    return [f"{a.op}{a.microbatch}" for a in stage_order(kind, stages, microbatches)[0]]


class LiveBytes(TorchDispatchMode):
    """Running and peak bytes of live tensor storages, by category.

    Inside ``with LiveBytes() as lb:`` every storage an operator returns is counted
    once under the current :attr:`category` (views and in-place results add nothing)
    until it is freed. :meth:`add` registers tensors created before (parameters,
    optimizer state); :meth:`retag` moves a storage to another category.

    Attributes
    ----------
    category : str
        Category of the storages created from now on (e.g. ``"forward"``).
    current : int
        Live bytes now.
    peak : int
        Most live bytes seen.
    peak_breakdown : dict of str to int
        Live bytes per category at the peak.
    category_peaks : dict of str to int
        Most live bytes each category held at any moment (not necessarily together).
    """

    def __init__(self) -> None:
        super().__init__()
        self.category = "other"
        self.current = 0
        self.peak = 0
        self.peak_breakdown: dict[str, int] = {}
        self.category_peaks: dict[str, int] = {}
        self._by_category: dict[str, int] = {}
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes, cat]

    def _free(self, entry: list) -> None:
        nbytes, category = entry
        self.current -= nbytes
        self._by_category[category] -= nbytes

    def add(self, t: torch.Tensor, category: str | None = None) -> None:
        """Count ``t``'s storage (once) under ``category`` (default :attr:`category`)."""
        storage = t.untyped_storage()
        if storage in self._live or storage.device.type == "meta":
            return
        entry = [storage.nbytes(), category or self.category]
        self._live[storage] = entry
        weakref.finalize(storage, self._free, entry)
        self.current += entry[0]
        self._bump(entry[1], entry[0])
        if self.current > self.peak:
            self.peak = self.current
            self.peak_breakdown = {k: v for k, v in self._by_category.items() if v}

    def retag(self, t: torch.Tensor, category: str) -> None:
        """Move ``t``'s storage to ``category`` (registering it if it is new)."""
        entry = self._live.get(t.untyped_storage())
        if entry is None:
            self.add(t, category)
            return
        self._by_category[entry[1]] -= entry[0]
        entry[1] = category
        self._bump(category, entry[0])

    def _bump(self, category: str, nbytes: int) -> None:
        now = self._by_category.get(category, 0) + nbytes
        self._by_category[category] = now
        self.category_peaks[category] = max(self.category_peaks.get(category, 0), now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


@dataclass(frozen=True)
class StagePeak:
    """What :func:`measure_stage_memory` measured (bytes).

    Attributes
    ----------
    total : int
        Peak bytes of live tensors during the step.
    at_peak : dict of str to int
        Live bytes per category at that moment: ``parameters``, ``optimizer_state``,
        ``gradients``, ``forward`` (micro-batch inputs and what the forwards create and
        keep: the autograd stash and the outputs), ``backward`` (arriving output
        gradients, the backward's temporaries, input gradients), ``optimizer`` (the
        optimizer step's temporaries); empty categories are left out.
    category_peaks : dict of str to int
        Most bytes each category held at any moment; ``category_peaks["forward"]`` is
        the measured stash of the micro-batches in flight.
    """

    total: int
    at_peak: dict[str, int]
    category_peaks: dict[str, int]


def measure_stage_memory(
    layers: Sequence[nn.Module],
    microbatch: torch.Tensor,
    microbatches: int,
    kind: str = "gpipe",
    optimizer: str = "adam",
    input_grad: bool = True,
    inflight: int | None = None,
) -> StagePeak:
    """Peak bytes of one stage's training step, with a breakdown by category.

    The step runs ``microbatches`` forward and backward passes of ``layers`` in the
    schedule's order (see :func:`schedule_order`), then the optimizer step, after one
    untracked warm-up step.

    Parameters
    ----------
    layers : sequence of nn.Module
        The stage's layers in order (deep-copied: the caller's modules are not changed).
    microbatch : torch.Tensor
        One micro-batch of the stage's input, shape ``(B / M, ...)``; every micro-batch
        of the step is a fresh copy of it, created when it arrives.
    microbatches : int
        M, micro-batches per step.
    kind : {"sequential", "gpipe", "1f1b"}
        Order of the passes (see :func:`schedule_order`).
    optimizer : {"adam", "sgd", "sgd_momentum"}
        As :func:`sky_flower.core.profile.default_optimizer_factory`.
    input_grad : bool
        Whether the stage computes the gradient of its input (every stage but the first;
        needs a floating-point input).
    inflight : int, optional
        ``1f1b`` warm-up forwards (see :func:`schedule_order`).

    Returns
    -------
    StagePeak
        The peak, what was live at the peak, and each category's own peak.

    Raises
    ------
    ValueError
        On an unknown kind or optimizer, ``microbatches < 1``, no layers, or
        ``input_grad`` with a non-floating-point input.
    """
    if not layers:
        raise ValueError("a stage needs at least one layer")
    order = schedule_order(kind, microbatches, inflight)
    if input_grad and not microbatch.is_floating_point():
        raise ValueError(f"input_grad needs a floating-point input, got {microbatch.dtype}")
    stage = nn.Sequential(*copy.deepcopy(list(layers)))
    params = [p for p in stage.parameters() if p.requires_grad]
    opt = default_optimizer_factory(optimizer)(params)
    template = microbatch.detach().clone()
    tracker = LiveBytes()

    def step() -> None:
        pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for op in order:
            m = int(op[1:])
            if op[0] == "F":
                tracker.category = "forward"
                x = template.clone().requires_grad_(input_grad)  # the micro-batch arrives
                pending[m] = (x, stage(x))
            else:
                tracker.category = "backward"
                x, y = pending.pop(m)
                y.backward(torch.ones_like(y))  # the output gradient arrives
                del x, y  # input gradient sent, graph freed
        tracker.category = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: the optimizer state exists from the first step on
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: tracker.retag(p.grad, "gradients"))
        for p in params
    ]
    for t in (*stage.parameters(), *stage.buffers()):
        tracker.add(t, "parameters")
    for state in opt.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                tracker.add(value, "optimizer_state")
    try:
        with tracker:
            step()
    finally:
        for h in hooks:
            h.remove()
    return StagePeak(tracker.peak, dict(tracker.peak_breakdown), dict(tracker.category_peaks))
