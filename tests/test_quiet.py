"""The third-party notices a run silences (sky_flower/flower/quiet.py): only those."""

from __future__ import annotations

import logging
from logging import WARNING

from flwr.supercore import log

from sky_flower.flower.quiet import (
    ACTOR_TERMINATING,
    RUN_SIMULATION_DEPRECATED,
    _DropMessage,
    quiet_actor_exit,
    quiet_third_party,
)


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_an_actors_shutdown_notice_is_dropped_and_every_other_flower_record_shows():
    flwr_logger = logging.getLogger("flwr")
    before = list(flwr_logger.filters)
    keep = _Keep()
    flwr_logger.addHandler(keep)
    try:
        quiet_actor_exit()
        quiet_actor_exit()  # idempotent: one filter
        added = [f for f in flwr_logger.filters if f not in before]
        assert len(added) <= 1 and all(isinstance(f, _DropMessage) for f in added)
        # what flwr.simulation.ray_transport.ray_actor logs when the engine ends an actor
        log(WARNING, "Manually terminating %s", "ClientAppActor")
        log(WARNING, "Manually terminated nothing: %s", "a notice of another kind")
        log(WARNING, "node 3 failed: %s", "Manually terminating is only a prefix match")
    finally:
        flwr_logger.removeHandler(keep)
        for f in [f for f in flwr_logger.filters if f not in before]:
            flwr_logger.removeFilter(f)
    assert not any(m.startswith(ACTOR_TERMINATING) for m in keep.messages), keep.messages
    assert keep.messages == [
        "Manually terminated nothing: a notice of another kind",
        "node 3 failed: Manually terminating is only a prefix match",
    ]


def test_each_notice_is_dropped_whichever_is_silenced_first():
    """An in-process grid runs Sky's node handlers (``quiet_actor_exit``) in the driver,
    before or after the entry point's ``quiet_third_party``: each keeps its own filter."""
    flwr_logger = logging.getLogger("flwr")
    before = list(flwr_logger.filters)
    keep = _Keep()
    flwr_logger.addHandler(keep)
    try:
        for f in [f for f in flwr_logger.filters if isinstance(f, _DropMessage)]:
            flwr_logger.removeFilter(f)
        quiet_actor_exit()
        quiet_third_party()
        quiet_third_party()
        log(WARNING, "%s. Use flwr run", RUN_SIMULATION_DEPRECATED)
        log(WARNING, "Manually terminating %s", "ClientAppActor")
        log(WARNING, "a notice that shows")
        prefixes = sorted(f.prefix for f in flwr_logger.filters if isinstance(f, _DropMessage))
    finally:
        flwr_logger.removeHandler(keep)
        for f in list(flwr_logger.filters):
            flwr_logger.removeFilter(f)
        for f in before:
            flwr_logger.addFilter(f)
    assert prefixes == sorted([ACTOR_TERMINATING, RUN_SIMULATION_DEPRECATED])
    assert keep.messages == ["a notice that shows"]
