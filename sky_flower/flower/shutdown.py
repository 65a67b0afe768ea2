"""Prompt shutdown of Flower's simulation engine when a strategy gives up.

Flower 1.42's simulation engine (``flwr.server.superlink.fleet.vce.vce_api.run_api``)
ends only when every message worker thread has returned, and a worker blocks in
``ray.get`` on its ClientApp actor until the message it is handling finishes. A
ServerApp that gives up (``max_failed_rounds``, every pipeline failed, a stop) while a
slow or stalled node still handles a message therefore left the process running until
that message ended (minutes, or never for a hung node), and the job's files were
written only then.

:class:`AbandonableEngine` records the engine's Ray backends while it runs (it wraps
``RayBackend.build``); :meth:`AbandonableEngine.abandon` kills the actors that are busy
with a message (``ray.kill``: their ``ray.get`` raises at once, the engine turns it
into an error reply nobody reads, sees its stop flag and shuts Ray down). Idle actors
are left to the engine's own shutdown. Nothing changes unless :meth:`abandon` is called.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from logging import WARNING
from typing import Any

from flwr.supercore import log


class AbandonableEngine:
    """The simulation engine's Ray backends of one run, and a way to abandon their
    in-flight messages (see the module docstring)."""

    def __init__(self) -> None:
        self.backends: list[Any] = []
        self.lock = threading.Lock()

    @contextmanager
    def tracking(self) -> Iterator[AbandonableEngine]:
        """Record every ``RayBackend`` built while inside (restored after)."""
        from flwr.server.superlink.fleet.vce.backend import raybackend

        original = raybackend.RayBackend.build
        engine = self

        def build(backend: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            with engine.lock:
                engine.backends.append(backend)
            return original(backend, *args, **kwargs)

        raybackend.RayBackend.build = build  # type: ignore[method-assign]
        try:
            yield self
        finally:
            raybackend.RayBackend.build = original  # type: ignore[method-assign]

    def busy_actors(self) -> list[Any]:
        """The Ray actors handling a message now, over every recorded backend."""
        with self.lock:
            backends = list(self.backends)
        actors = []
        for backend in backends:
            pool = getattr(backend, "pool", None)
            actors.extend(dict(getattr(pool, "_future_to_actor", {})).values())
        return actors

    def abandon(self) -> int:
        """Kill the actors busy with a message (their messages are abandoned, never
        answered); returns how many. Never raises. After the engine shut Ray down
        (an interrupt) nothing is in flight: Ray is left alone (a call would start a
        fresh local Ray instance, and wait a minute for a GCS that is gone)."""
        import ray

        if not ray.is_initialized():
            return 0
        busy = self.busy_actors()
        for actor in busy:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - best effort: already dead or Ray gone
                continue
        if busy:
            log(WARNING, "Abandoned %d in-flight message(s): their nodes were stopped", len(busy))
        return len(busy)


@contextmanager
def signals_interrupt(
    before: Callable[[], None] = lambda: None,
    signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
) -> Iterator[None]:
    """Inside, each of ``signals`` (Ctrl-C's SIGINT, a ``kill``'s SIGTERM) first calls
    ``before()`` (e.g. tell a strategy its run is stopped, so that it blames no node for
    the messages the shutdown breaks), then raises ``KeyboardInterrupt`` in the main
    thread, so that the ``finally`` blocks run (a job's ``results.json`` is written on
    SIGTERM too, which would otherwise end the process at once). Outside the main
    thread (where Python cannot set handlers) nothing changes; the previous handlers
    come back on exit.
    """

    def handler(signum: int, frame: object) -> None:
        before()
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
