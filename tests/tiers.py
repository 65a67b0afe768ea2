"""How much of each test a tier runs.

``make test`` and ``make test-fast`` run every test with a share of the examples a
property test would draw in ``make test-all`` (which sets ``SKY_TEST_ALL=1``): Hypothesis
draws new random examples on every run, so the landings between two ``make test-all``
runs still cover the space, each in seconds rather than minutes."""

from __future__ import annotations

import os

ALL = os.environ.get("SKY_TEST_ALL", "") == "1"


def examples(n: int, floor: int = 10) -> int:
    """``n`` examples in ``make test-all``; a quarter of them (at least ``floor``, at
    most ``n``) otherwise."""
    return n if ALL else min(n, max(floor, n // 4))
