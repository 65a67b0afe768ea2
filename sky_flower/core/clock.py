"""A timer around device work: CUDA runs asynchronously, so a timer around a kernel
launch must wait for the device's queued work first (profiles, stage steps).

Pure PyTorch (no Flower import).
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously: a timer around a
    kernel launch must synchronize); nothing on the CPU."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def clock(device: torch.device | str) -> float:
    """``time.perf_counter()`` once ``device``'s queued work is done (:func:`synchronize`):
    what a timer around GPU work must read."""
    synchronize(device)
    return time.perf_counter()
