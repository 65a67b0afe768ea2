"""Shared fixtures."""

from __future__ import annotations

import pytest
from simhelpers import ray_processes, wait_no_ray


@pytest.fixture
def no_leftover_processes():
    assert not ray_processes(), "Ray processes were running before the test"
    yield
    left = wait_no_ray()
    assert not left, f"processes left behind: {[p.pid for p in left]}"
