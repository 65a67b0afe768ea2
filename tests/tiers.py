"""How much of each test a tier runs.

``make test`` and ``make test-fast`` run every test with a share of the examples a
property test would draw in ``make test-all`` (which sets ``SKY_TEST_ALL=1``): Hypothesis
draws new random examples on every run, so the landings between two ``make test-all``
runs still cover the space, each in seconds rather than minutes. A property test with
``derandomize=True`` (tests/test_chain.py, tests/test_feasibility.py) draws the same
examples every run: its share is always the same first ones, the rest only in
``make test-all``, as for the seeded loops that take their count from :data:`ALL`."""

from __future__ import annotations

import os

ALL = os.environ.get("SKY_TEST_ALL", "") == "1"


def examples(n: int, floor: int = 10) -> int:
    """``n`` examples in ``make test-all``; a quarter of them (at least ``floor``, at
    most ``n``) otherwise."""
    return n if ALL else min(n, max(floor, n // 4))
