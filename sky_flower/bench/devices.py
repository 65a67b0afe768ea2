"""Per-device layer times and a plan for a fleet mixing an accelerator with slow CPU nodes:
``python -m sky_flower.bench.devices [--width W] [--layers L] [--batch B] [--micro M]``.

Issue 31. Times every layer of the job's MLP (forward + backward per micro-batch, median
after warm-up, :func:`sky_flower.core.profile.time_layers`) on each device this machine
has (the CPU, and every CUDA GPU), the optimizer step per layer too, then plans with
the measured figures unchanged (a GPU node is a fast node with its own memory cap,
:class:`~sky_flower.core.profile.NodeProfile`) for a fleet of:

* ``owner``: the data owner, this CPU emulated 4x slower (``slowdown`` 3, memory cap
  ``--cpu-memory-mb``);
* ``accel``: the fastest device here (a GPU if there is one, its free memory as its cap;
  on a CPU-only machine this CPU at native speed, and the output says so);
* ``edge``: this CPU emulated 2x slower (``slowdown`` 1, the same cap).

Emulated slowdowns multiply the measured CPU times, as the fleet's emulation does
(:mod:`sky_flower.emulation.devices`). Links: ``--latency-ms`` and ``--bandwidth-mb-s``
on every node, ``direct`` transport, GPipe over ``M`` micro-batches. Prints one table
per part, with the machine, torch version and date; no GPU figure is printed unless one
was measured here.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
from collections.abc import Sequence

import torch

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.partition import InfeasibleMemoryError, partition
from sky_flower.core.profile import (
    NodeProfile,
    default_optimizer_factory,
    profile_layers,
    time_layers,
    time_optimizer_steps,
)
from sky_flower.pipeline.device import DeviceInfo, device_info
from sky_flower.pipeline.models import build_mlp

MIB = 2**20


def available_devices() -> list[torch.device]:
    """The CPU, then every CUDA GPU of this machine."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.device("cpu"), *(torch.device("cuda", i) for i in range(gpus))]


def measure(
    device: torch.device, args: argparse.Namespace
) -> tuple[list[float], list[float], list[float]]:
    """Seconds per micro-batch of each layer's forward and backward on ``device``, and
    of its optimizer step (a fresh model, seeded)."""
    torch.manual_seed(0)
    mb = args.batch // args.micro
    fwd, bwd = time_layers(
        build_mlp(64, args.width, args.layers),
        [64],
        mb,
        warmup=args.warmup,
        repeats=args.repeats,
        device=device,
    )
    steps = time_optimizer_steps(
        build_mlp(64, args.width, args.layers),
        default_optimizer_factory("adam", 1e-3),
        device=device,
    )
    return fwd, bwd, steps


def node(  # noqa: PLR0913
    name: str,
    times: tuple[list[float], list[float], list[float]],
    slowdown: float,
    memory_bytes: int,
    info: DeviceInfo,
    args: argparse.Namespace,
    holds_data: bool = False,
) -> NodeProfile:
    """A node profile from measured times (``x (1 + slowdown)``; the optimizer step
    spread over the step's micro-batches, as the benchmark round does)."""
    fwd, bwd, steps = times
    f = 1.0 + slowdown
    return NodeProfile(
        name=name,
        layer_fwd_s=tuple(t * f for t in fwd),
        layer_bwd_s=tuple((b + s / args.micro) * f for b, s in zip(bwd, steps, strict=True)),
        memory_bytes=memory_bytes,
        latency_s=args.latency_ms / 1000.0,
        bandwidth_bps=args.bandwidth_mb_s * 1e6 if args.bandwidth_mb_s > 0 else math.inf,
        holds_data=holds_data,
        slowdown=slowdown,
        device=info.device,
        device_name=info.name,
    )


def layer_table(
    names: Sequence[str], measured: dict[str, tuple[list[float], list[float], list[float]]]
) -> str:
    """Per-layer fwd + bwd milliseconds per micro-batch on each device (and the first
    GPU's speed-up over the CPU), totals, and the optimizer step over every layer."""
    devs = list(measured)
    ms = {d: [(f + b) * 1e3 for f, b in zip(*measured[d][:2], strict=True)] for d in devs}
    gpu = devs[1] if len(devs) > 1 else None

    def row(label: str, values: dict[str, float]) -> list[str]:
        cells = [label, *(f"{values[d]:.3f}" for d in devs)]
        if gpu is None:
            return cells
        return [*cells, f"{values['cpu'] / values[gpu]:.1f}x" if values[gpu] > 0 else "-"]

    rows = [row(name, {d: ms[d][j] for d in devs}) for j, name in enumerate(names)]
    rows.append(row("total", {d: sum(ms[d]) for d in devs}))
    rows.append(row("optimizer step", {d: sum(measured[d][2]) * 1e3 for d in devs}))
    head = ["layer", *devs] + (["speed-up"] if gpu is not None else [])
    return tables.text(head, rows, align="l", sep="  ", rule=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the per-device layer table and the mixed fleet's plans."""
    ap = cli.parser("devices", __doc__, out=False)
    ap.add_argument("--width", type=int, default=512, help="MLP hidden width")
    ap.add_argument("--layers", type=int, default=8, help="MLP hidden blocks")
    ap.add_argument("--batch", type=int, default=64, help="samples per step")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step (M)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--cpu-memory-mb", type=float, default=16.0, help="CPU nodes' memory cap")
    ap.add_argument("--latency-ms", type=float, default=1.0)
    ap.add_argument("--bandwidth-mb-s", type=float, default=1000.0)
    args = cli.parse(ap, argv)
    if args.batch % args.micro:
        ap.error(f"--batch {args.batch} is not divisible into --micro {args.micro}")
    torch.set_num_threads(1)  # as every Sky stage handler runs

    devices = available_devices()
    infos = {str(d): device_info(d) for d in devices}
    print(
        f"sky_flower.bench.devices  {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
        f"  commit {cli.commit()}  torch {torch.__version__}  host {platform.node()}"
    )
    for info in infos.values():
        total = f" of {info.total_bytes / MIB:.0f}" if info.device != "cpu" else ""
        print(f"  {info.device}: {info.name}, {info.available_bytes / MIB:.0f}{total} MiB free")
    gpu = len(devices) > 1
    if not gpu:
        print(
            "  No CUDA device on this machine (torch.cuda.is_available() is False, torch "
            f"CUDA build: {torch.version.cuda or 'none'}): only the CPU is timed, and the "
            "fleet's accelerator node below is this CPU at native speed. No GPU figures "
            "were measured."
        )
    mb = args.batch // args.micro
    print(
        f"\nPer-layer forward + backward, ms per micro-batch of {mb} samples (median of "
        f"{args.repeats}, 1 CPU thread), MLP 64 -> {args.layers} x {args.width} -> 10, Adam:"
    )
    model = build_mlp(64, args.width, args.layers)
    layers = profile_layers(model, [64], mb)
    measured = {str(d): measure(d, args) for d in devices}
    print(layer_table([lp.name for lp in layers], measured))

    fast = str(devices[1]) if gpu else "cpu"
    cap = int(args.cpu_memory_mb * MIB)
    fleet = [
        node("owner", measured["cpu"], 3.0, cap, infos["cpu"], args, holds_data=True),
        node("accel", measured[fast], 0.0, infos[fast].available_bytes, infos[fast], args),
        node("edge", measured["cpu"], 1.0, cap, infos["cpu"], args),
    ]
    print(
        f"\nFleet: owner (CPU x4 slower, {args.cpu_memory_mb:g} MiB), accel ({fast}"
        f"{'' if gpu else ' at native speed: no GPU here'}, "
        f"{infos[fast].available_bytes / MIB:.0f} MiB), edge (CPU x2 slower, "
        f"{args.cpu_memory_mb:g} MiB); {args.latency_ms:g} ms, {args.bandwidth_mb_s:g} MB/s "
        f"links; direct, GPipe, M = {args.micro}"
    )
    schedule = Schedule(
        batch_size=args.batch, microbatches=args.micro, kind="gpipe", transport="direct"
    )
    cost = CostModel(layers, fleet, schedule)
    for method in ("even", "optimal"):
        try:
            plan = partition(cost, method)
        except InfeasibleMemoryError as err:
            print(f"\n{method}: infeasible: {err}")
            continue
        print(f"\n{plan.table()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
