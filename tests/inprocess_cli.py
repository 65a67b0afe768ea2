"""A Hydra entry point run in this process as ``python -m`` runs it: its ``main()`` with
``sys.argv`` set, then the process's logging put back as it was (Hydra points the root
logger at the job's console and ``.log`` file; a job may re-route Flower's logger).

A fresh interpreter imports torch and Flower again (several seconds a test); the tests
that are about the process itself (its exit status, its ``__main__`` block) still start
one: each entry point keeps one such test.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable


def _loggers() -> dict[str, logging.Logger]:
    manager = logging.Logger.manager
    named = {n: lg for n, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    return {"": logging.getLogger(), **named}


def hydra_main(main: Callable[[], None], argv: list[str], prog: str = "python") -> int:
    """Run the ``@hydra.main`` function ``main`` on the command line ``argv``; return its
    exit status (0 when it returned, else its ``SystemExit`` code). Whatever it printed
    or logged to the console is in the test's ``capsys``."""
    from hydra.core.global_hydra import GlobalHydra

    saved = {
        name: (lg.handlers[:], lg.level, lg.propagate, lg.disabled)
        for name, lg in _loggers().items()
    }
    argv_before = sys.argv
    sys.argv = [prog, *argv]
    try:
        main()
        return 0
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 1
    finally:
        sys.argv = argv_before
        GlobalHydra.instance().clear()
        for name, lg in _loggers().items():
            if name not in saved:  # a logger first made during the run: left as it is
                continue
            handlers, level, propagate, disabled = saved[name]
            for handler in lg.handlers:
                if handler not in handlers:  # Hydra's console and file handlers
                    handler.close()
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
