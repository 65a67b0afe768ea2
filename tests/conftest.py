"""Shared fixtures."""

from __future__ import annotations

import os

import pytest
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from simhelpers import ray_processes, wait_no_ray

if os.environ.get("PYTEST_XDIST_WORKER"):
    # under pytest-xdist (`make test`, `make test-fast`: -n 2 on 2 cores) each worker,
    # and the processes it starts, computes on one thread: two workers with a thread
    # per core each would oversubscribe the cores
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture
def no_leftover_processes():
    """Fail if the test leaves a Ray process behind. Only processes this test session
    started count (``simhelpers.SESSION_MARK`` in their environment): another job's Ray
    on the same machine is ignored, whenever it starts."""
    before = {p.pid for p in ray_processes()}
    yield
    left = wait_no_ray(ignore=before)
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"


@pytest.fixture
def server_identity(monkeypatch):
    """This process has a ServerApp process's task identity (run 1, the SuperLink's
    node id), so a strategy can build messages outside Flower's runtime."""
    for attr, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
