"""The fleet emulation around a direct stage (sky_flower/pipeline/emulated.py): its
backward timing per micro-batch on a stage whose input is token ids (no input
gradient ends the backward; the parameters' gradients do)."""

from __future__ import annotations

import torch
from torch import nn

from sky_flower.pipeline.emulated import Emulated, EmulatedStage
from sky_flower.pipeline.stage import RngKey


def test_an_integer_input_stage_ends_each_micro_batch_backward_once():
    """Four forwards (GPipe's micro-batches) then four backwards: each backward ends
    exactly once, in its own pass. (Hooks registered by every forward all fired in
    micro-batch 0's backward, each timing the slowdown sleeps of those before it: a
    x6 slowdown slept (1+6)^4 times a backward.)"""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16))
    stage = EmulatedStage(inner, Emulated(slowdown=0.0), is_first=True, is_last=False)
    ended: list[int | None] = []
    current: list[int | None] = [None]
    real_end = stage._end_backward

    def end(g):
        ended.append(current[0])
        real_end(g)

    stage._end_backward = end
    stage.start_step(RngKey())
    outputs = [stage(torch.randint(0, 64, (4, 8))) for _ in range(4)]
    for m, y in enumerate(outputs):
        current[0] = m
        y.backward(torch.ones_like(y))
    assert ended == [0, 1, 2, 3]
    assert stage._waiting == 0
