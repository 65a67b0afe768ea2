"""A stage's state as Flower records: what every stage message rebuilds and saves.

Every relay stage message rebuilds its stage from the ``context.state`` records (weights
and buffers, optimizer state; records only, so this also works where each message runs
in a fresh process) and the messages that step the optimizer save them back
(:class:`sky_flower.sky.client.SkyClient`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from flwr.app import ArrayRecord
from torch import nn

from sky_flower.core.profile import as_layers
from sky_flower.pipeline.stage import (
    build_stage,
    make_stage_optimizer,
    optimizer_from_tensors,
    optimizer_to_tensors,
)


def save_stage(
    module: nn.Module, opt: torch.optim.Optimizer | None
) -> tuple[ArrayRecord, ArrayRecord]:
    """A stage as records: its weights and its optimizer's state tensors (none for a
    stage without parameters)."""
    weights = ArrayRecord({k: v.detach() for k, v in module.state_dict().items()})
    return weights, ArrayRecord(optimizer_to_tensors(opt) if opt is not None else {})


def load_stage(
    model_fn: Callable[[], nn.Module],
    first: int,
    last: int,
    records: tuple[ArrayRecord, ArrayRecord | None],
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
) -> tuple[nn.Sequential, torch.optim.Optimizer | None]:
    """Layers ``first..last`` rebuilt from ``records`` (weights, optimizer state or None
    for a fresh optimizer) as :func:`save_stage` wrote them; no optimizer for layers
    without trainable parameters."""
    weights, optim = records
    module = build_stage(model_fn, first, last, weights.to_torch_state_dict())
    opt = make_stage_optimizer(module, make_opt)
    if optim is not None and opt is not None:
        optimizer_from_tensors(opt, optim.to_torch_state_dict())
    return module, opt


def time_state_roundtrip(
    model_fn: Callable[[], nn.Module],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    repeats: int = 3,
) -> tuple[float, float]:
    """What a stage message spends on its own state, per byte of weights + optimizer
    state: ``(rebuild, save)`` seconds per byte. Every stage message rebuilds its stage
    from the ``context.state`` records (weights, optimizer tensors); messages that
    step the optimizer save them back as records. Timed on the
    whole model, median of ``repeats``."""
    import statistics

    last = len(as_layers(model_fn())) - 1
    stage = build_stage(model_fn, 0, last)
    opt = optimizer_factory([p for p in stage.parameters() if p.requires_grad])
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # populate the optimizer state
    weights, state = save_stage(stage, opt)
    nbytes = max(weights.count_bytes() + state.count_bytes(), 1)
    rebuild, save = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        module, opt2 = load_stage(model_fn, 0, last, (weights, state), optimizer_factory)
        t1 = time.perf_counter()
        weights, state = save_stage(module, opt2)
        save.append(time.perf_counter() - t1)
        rebuild.append(t1 - t0)
    return statistics.median(rebuild) / nbytes, statistics.median(save) / nbytes
