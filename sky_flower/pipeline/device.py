"""Where a node's stages compute: its device setting, resolved and described.

A node's ``device`` setting (fleet entry ``device``, SuperNode node config ``sky-device``)
is one of:

``auto`` (default)
    CUDA (the current GPU) when ``torch.cuda.is_available()``, else the CPU.
``cpu``
    The CPU, even on a machine with a GPU.
``cuda``, ``cuda:N``
    The current GPU, or GPU ``N``. Refused (a ``ValueError`` naming the setting) on a
    machine where CUDA is not available or has no GPU ``N``.

Pure PyTorch and psutil (no Flower import). Tensors cross to and from the device at a
stage's edges only (:mod:`sky_flower.pipeline.stage`, :mod:`sky_flower.pipeline.emulated`):
what travels between nodes, and what the server keeps, is on the CPU.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N (N a GPU index)"
_SYNTAX = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device(spec: object, where: str = "device") -> str:
    """``spec`` checked for syntax only (no CUDA query), stripped and lower-cased.

    Parameters
    ----------
    spec : object
        The setting's value (a string).
    where : str
        What to name in the error, e.g. ``"node 'gpu0': device"``.

    Raises
    ------
    ValueError
        Naming ``where``, if ``spec`` is not ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    """
    text = spec.strip().lower() if isinstance(spec, str) else None
    if text is None or not _SYNTAX.match(text):
        raise ValueError(f"{where} must be one of {DEVICE_CHOICES}, got {spec!r}")
    return text


def resolve_device(spec: object, where: str = "device") -> torch.device:
    """The ``torch.device`` a node's setting names on this machine.

    ``auto`` gives ``cuda:<current>`` when CUDA is available, else ``cpu``; ``cuda``
    gives ``cuda:<current>``; a CUDA device always carries its index.

    Raises
    ------
    ValueError
        Naming ``where``: on a malformed setting (:func:`check_device`), on ``cuda`` /
        ``cuda:N`` when this machine's torch has no usable CUDA, or on a GPU index at or
        past ``torch.cuda.device_count()``.
    """
    text = check_device(spec, where)
    if text == "cpu" or (text == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        raise ValueError(
            f"{where} is {text!r}, but CUDA is not available on this machine "
            f"(torch {torch.__version__}, CUDA build: {built}; torch.cuda.is_available() "
            "is False): set it to auto or cpu, or run this node on a machine with a GPU "
            "and a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    index = int(text.split(":", 1)[1]) if ":" in text else torch.cuda.current_device()
    if index >= count:
        raise ValueError(
            f"{where} is {text!r}, but this machine has {count} GPU(s) "
            f"(cuda:0 .. cuda:{count - 1}): choose one of them, or auto"
        )
    return torch.device("cuda", index)


@dataclass(frozen=True)
class DeviceInfo:
    """What the benchmark round reports of a node's device.

    Attributes
    ----------
    device : str
        ``"cpu"`` or ``"cuda:N"``.
    name : str
        The GPU's name (``torch.cuda.get_device_properties``), or the CPU's model.
    available_bytes : int
        Memory free for training now: ``torch.cuda.mem_get_info``'s free bytes on a GPU,
        psutil's available memory on the CPU.
    total_bytes : int
        The device's total memory.
    """

    device: str
    name: str
    available_bytes: int
    total_bytes: int


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``, else ``platform``), with
    its logical core count."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "CPU"
    return f"{name} ({psutil.cpu_count() or 1} logical cores)"


def device_info(device: torch.device) -> DeviceInfo:
    """Name and memory of ``device`` (a resolved device, :func:`resolve_device`)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(str(device), str(props.name), int(free), int(total))
    mem = psutil.virtual_memory()
    return DeviceInfo("cpu", cpu_name(), int(mem.available), int(mem.total))


def direct_backend(devices: Sequence[str], hosts: Sequence[str] = ()) -> str:
    """The ``direct`` round's process-group backend for stages on ``devices``
    (``"cpu"`` / ``"cuda:N"``, one per stage, on ``hosts``; a host not given or ``""``
    counts as one shared host): ``nccl`` when every stage is on a GPU and no two stages
    share one (NCCL refuses two ranks on one GPU), else ``gloo`` (tensors then cross to
    the CPU at each GPU stage's edges)."""
    hosts = list(hosts) or [""] * len(devices)
    gpus = [(h, d) for h, d in zip(hosts, devices, strict=True) if d.startswith("cuda")]
    if devices and len(gpus) == len(devices) and len(set(gpus)) == len(gpus):
        return "nccl"
    return "gloo"
