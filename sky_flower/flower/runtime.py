"""Which Flower runtime a ClientApp runs in, as the ClientApp itself can see it."""

from __future__ import annotations

import sys


def simulation_workers() -> int:
    """How many ClientApps Flower's simulation runtime runs at once, seen from a
    ClientApp it runs: its Ray actor pool's size, computed as Flower sizes that pool
    (``flwr.simulation.ray_transport.ray_actor.pool_size_from_resources`` over this
    actor's own CPUs and GPUs, i.e. the federation's
    ``options.backend.client-resources``). ``0`` outside a Ray actor (a SuperNode's
    ClientApp process, a test's in-process grid): no bound known.

    A Sky stage session holds one ClientApp for the whole run, so the server bounds
    its sessions by this (:meth:`sky_flower.sky.rounds.executor.RoundExecutor.bound_by_runtime`).
    """
    ray = sys.modules.get("ray")  # a Ray actor has imported it (importing it costs seconds)
    if ray is None or not ray.is_initialized():
        return 0
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:  # the driver (the ServerApp's process), not an actor
        return 0
    from flwr.simulation.ray_transport.ray_actor import pool_size_from_resources

    resources = context.get_assigned_resources()
    return pool_size_from_resources(
        {"num_cpus": resources.get("CPU", 1.0), "num_gpus": resources.get("GPU", 0.0)}
    )
