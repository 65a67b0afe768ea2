"""``sky_flower.threadsafe_ast``: ``ast.parse`` (hence numpy's ``.npy`` header parsing in
Flower's ``Array.numpy()``) runs one thread at a time on Python < 3.13
(python/cpython#106905)."""

import ast
import io
import sys
import threading

import numpy as np
import pytest

import sky_flower  # noqa: F401 - installs the lock
from sky_flower import threadsafe_ast


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="fixed in CPython 3.13")
def test_ast_parse_waits_while_another_thread_parses():
    assert threadsafe_ast.install() and ast.parse.__sky_locked__
    buf = io.BytesIO()
    np.save(buf, np.arange(6, dtype=np.float32).reshape(2, 3))
    done = threading.Event()

    def load() -> None:
        np.load(io.BytesIO(buf.getvalue()))  # ast.literal_eval -> ast.parse
        done.set()

    with threadsafe_ast._LOCK:  # another thread is inside ast.parse
        t = threading.Thread(target=load)
        t.start()
        assert not done.wait(0.3)  # blocked behind it
    assert done.wait(10)
    t.join()
    assert ast.literal_eval("{'shape': (2, 3)}") == {"shape": (2, 3)}  # still ast.parse
