"""``ast.parse`` serialised across threads on Python < 3.13 (a CPython bug workaround).

CPython 3.11 and 3.12 keep the AST constructor's recursion depth in per-interpreter
state, so two threads that build ASTs at once can corrupt each other's count and one of
them fails with ``SystemError: AST constructor recursion depth mismatch``
(python/cpython#106905; fixed in 3.13). Sky's server runs one thread per pipeline and
per stream, and every Flower ``Array.numpy()`` parses its ``.npy`` header with
``ast.literal_eval`` (numpy's ``_read_array_header``), so two pipelines reading replies
at once hit it (seen here: 1 in a few hundred stream rounds). :func:`install` wraps
``ast.parse`` (which ``literal_eval`` calls) in one process-wide lock; ``compile``
itself and the AST objects are untouched. It is installed when ``sky_flower`` is
imported, once, and only on Python < 3.13.
"""

from __future__ import annotations

import ast
import functools
import sys
import threading
from typing import Any

_LOCK = threading.RLock()


def install() -> bool:
    """Wrap ``ast.parse`` in a process-wide lock (idempotent). Returns whether it is
    wrapped (False on Python >= 3.13, where the bug is fixed)."""
    if sys.version_info >= (3, 13):
        return False
    if getattr(ast.parse, "__sky_locked__", False):
        return True
    original = ast.parse

    @functools.wraps(original)
    def parse(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - ast.parse's own types
        with _LOCK:
            return original(*args, **kwargs)

    parse.__sky_locked__ = True  # type: ignore[attr-defined]
    ast.parse = parse
    return True
