"""Shared fixtures."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator

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


# The tiers (docs/development.md): `make test-fast` (-m "... and not processes") runs only
# in-process tests. A test that starts a process (a CLI subprocess, a stage from the
# forkserver, a wheel build) carries the `processes` mark (or `simulation` / `deployment`);
# in a run that deselects `processes`, this guard fails one that does not, naming what it
# started, so the fast tier cannot drift out of process unnoticed.
_STARTED: list[str] = []  # what the running unmarked test started
_WATCH = {"on": False}
_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _watched_popen_init(self, args, *rest, **kwargs):  # noqa: ANN001, ANN202
    # matplotlib asks fontconfig once per machine, building its font cache (a fresh
    # venv's first plot): not the test's own process
    first = args[0] if isinstance(args, (list, tuple)) and args else args
    if _WATCH["on"] and first != "fc-list":
        _STARTED.append(f"subprocess {args!r}"[:200])
    _popen_init(self, args, *rest, **kwargs)


def _watched_process_start(self):  # noqa: ANN001, ANN202
    if _WATCH["on"]:
        _STARTED.append(f"multiprocessing {self!r}"[:200])
    _process_start(self)


subprocess.Popen.__init__ = _watched_popen_init  # type: ignore[method-assign]
multiprocessing.process.BaseProcess.start = _watched_process_start  # type: ignore[method-assign]
OUT_OF_PROCESS = ("processes", "simulation", "deployment")


@pytest.fixture(autouse=True)
def _in_process_unless_marked(request) -> Iterator[None]:
    """In an in-process run, fail a test that starts a process without the
    ``processes`` mark."""
    in_process_run = "not processes" in (request.config.getoption("markexpr") or "")
    if not in_process_run or any(request.node.get_closest_marker(m) for m in OUT_OF_PROCESS):
        yield
        return
    _STARTED.clear()
    _WATCH["on"] = True
    try:
        yield
    finally:
        _WATCH["on"] = False
    if _STARTED:
        started = "; ".join(_STARTED[:3])
        pytest.fail(
            f"{request.node.nodeid} started a process ({started}) but is not marked "
            "`processes`: add @pytest.mark.processes (make test-fast runs in-process "
            "tests only; make test runs it)",
            pytrace=False,
        )


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
