"""Shared fixtures."""

from __future__ import annotations

import pytest
from simhelpers import ray_processes, wait_no_ray


@pytest.fixture
def no_leftover_processes():
    """Fail if the test leaves a Ray process behind (processes that were already
    running before the test, e.g. another user's, are ignored)."""
    before = {p.pid for p in ray_processes()}
    yield
    left = wait_no_ray(ignore=before)
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
