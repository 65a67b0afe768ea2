"""Node-side calibration measurements of the benchmark round (pure torch).

What a ``direct`` step pays besides its layers' compute, measured on the node in well
under a second:

* :func:`time_microbatch_overhead`: ``torch.distributed.pipelining``'s fixed cost per
  micro-batch (schedule and autograd bookkeeping) on a one-stage GPipe schedule of a
  tiny layer, at two micro-batch counts;
* :func:`time_peer_echo`: one gloo message between two ranks on this node (two threads,
  loopback): what every peer message pays on the node's own stack under the host's
  load, whatever the network adds;
* :func:`time_host_parallelism`: how many single-threaded compute workers the host runs
  at full speed at once (``max_k k t_1 / t_k``), for stages that share its cores.

The cost model's use of them: :mod:`sky_flower.core.calibration`.
"""

from __future__ import annotations

import datetime
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class NodeCalibration:
    """A node's calibration (seconds; see :class:`sky_flower.core.profile.NodeProfile`)."""

    microbatch_overhead_s: float = 0.0
    peer_latency_s: float = 0.0
    host: str = ""
    host_parallelism: float = 0.0


class _Crossing(nn.Module):
    """``inner`` on ``device``, its input moved there and its output back to the CPU: a
    ``direct`` stage on a GPU whose peers talk over gloo
    (:class:`sky_flower.pipeline.emulated.EmulatedStage`)."""

    def __init__(self, inner: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.inner, self.device = inner.to(device), device

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.inner(x.to(self.device)).cpu()


def _gpipe_step_s(
    microbatches: int, microbatch_size: int, steps: int, device: torch.device | str = "cpu"
) -> float:
    """Median seconds of one step of a one-stage GPipe schedule over a tiny layer on
    ``device`` (needs an initialised default process group of one rank)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    width = 8
    module: nn.Module = nn.Linear(width, width)
    if torch.device(device).type != "cpu":
        module = _Crossing(module, torch.device(device))
    example = torch.zeros(microbatch_size, width)
    stage = PipelineStage(
        module,
        0,
        1,
        torch.device("cpu"),
        input_args=example,
        output_args=torch.zeros(microbatch_size, width, requires_grad=True),
    )
    schedule = ScheduleGPipe(
        stage, n_microbatches=microbatches, loss_fn=lambda out, tgt: out.sum(), scale_grads=True
    )
    x = torch.randn(microbatches * microbatch_size, width)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        schedule.step(x, target=torch.zeros_like(x), losses=[])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def time_microbatch_overhead(
    microbatch_size: int = 8, steps: int = 5, device: torch.device | str = "cpu"
) -> float:
    """Fixed seconds per micro-batch of ``torch.distributed.pipelining``'s schedule on
    this node: ``(t(8) - t(1)) / 7`` for a one-stage GPipe step of a tiny layer with
    8 and 1 micro-batches (its compute is negligible), the layer on ``device`` (on a
    GPU: its kernel launches and the copies to and from it included). 0 if a process
    group is already initialised in this process (a stage is running: not measured)."""
    if dist.is_initialized():
        return 0.0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        one = _gpipe_step_s(1, microbatch_size, steps, device)
        eight = _gpipe_step_s(8, microbatch_size, steps, device)
    finally:
        dist.destroy_process_group()
    return max(eight - one, 0.0) / 7.0


def time_peer_echo(nbytes: int = 1024, repeats: int = 21) -> float:
    """One-way seconds of a gloo message of ``nbytes`` between two ranks of this node
    (two threads, loopback; median half round trip after two warm-up echoes)."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=30)
    result: list[float] = []
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, r, 2, timeout)
            buf = [torch.zeros(max(nbytes // 4, 1))]
            for rep in range(repeats + 2):
                t0 = time.perf_counter()
                if r == 0:
                    pg.send(buf, 1, 0).wait()
                    pg.recv(buf, 1, 0).wait()
                    if rep >= 2:
                        result.append((time.perf_counter() - t0) / 2.0)
                else:
                    pg.recv(buf, 0, 0).wait()
                    pg.send(buf, 0, 0).wait()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60.0)
    if errors:
        raise RuntimeError(f"gloo echo failed: {errors[0]}") from errors[0]
    return statistics.median(result)


def time_host_parallelism(workers: tuple[int, ...] = (2, 4), work: int = 24) -> float:
    """How many single-threaded compute workers this host runs at full speed at once:
    ``max_k k t_1 / t_k`` over ``k`` in ``workers`` (``t_k``: the slowest worker's
    seconds among ``k`` threads each multiplying 128 x 128 matrices ``work`` times;
    torch releases the GIL in the kernel). At least 1."""
    a = torch.randn(128, 128)

    def job() -> None:
        b = a
        for _ in range(work):
            b = torch.tanh(a @ b)

    def timed(k: int) -> float:
        threads = [threading.Thread(target=job) for _ in range(k)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t0

    job()  # warm-up
    t1 = statistics.median(timed(1) for _ in range(3))
    best = 1.0
    for k in workers:
        tk = statistics.median(timed(k) for _ in range(3))
        best = max(best, k * t1 / tk if tk > 0 else 1.0)
    return best


def calibrate_node(microbatch_size: int = 8, device: torch.device | str = "cpu") -> NodeCalibration:
    """All three measurements (the micro-batch overhead on the stage's ``device``) and
    the host name (:func:`socket.gethostname`)."""
    return NodeCalibration(
        microbatch_overhead_s=time_microbatch_overhead(microbatch_size, device=device),
        peer_latency_s=time_peer_echo(),
        host=socket.gethostname(),
        host_parallelism=time_host_parallelism(),
    )
