"""A text corpus on every machine without a download: the Python standard library's source.

The corpus is the byte stream of the standard library's top-level ``*.py`` files
(``sysconfig.get_paths()["stdlib"]``), read in sorted file-name order and cut at
``max_chars`` bytes, so every machine with the same Python version reads the same text.
Tokens are bytes (vocabulary 256): no stored vocabulary, any file decodes.

The stream is cut into non-overlapping windows of ``seq_len + 1`` bytes; a window's
first ``seq_len`` bytes are the input and its last ``seq_len`` the next-token labels.
Train and test are split by contiguous blocks of windows (a seeded choice of blocks),
never by single windows, so the test text is text the model has not seen.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from sky_flower.pipeline.data import Split

VOCAB_SIZE = 256
BLOCK_WINDOWS = 64  # windows per contiguous train/test block


def python_source_files(stdlib: str | None = None) -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name.

    Parameters
    ----------
    stdlib : str, optional
        The standard library directory (default ``sysconfig.get_paths()["stdlib"]``).

    Raises
    ------
    FileNotFoundError
        If the directory holds no ``*.py`` file (a Python installed without its source).
    """
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no *.py files in the standard library directory {root}")
    return files


def python_source_bytes(max_chars: int, stdlib: str | None = None) -> np.ndarray:
    """The first ``max_chars`` bytes of the concatenated standard library source.

    Returns
    -------
    np.ndarray, shape (n,), uint8
        ``n = min(max_chars, total size)``.
    """
    chunks, size = [], 0
    for path in python_source_files(stdlib):
        if size >= max_chars:
            break
        data = path.read_bytes()[: max_chars - size]
        chunks.append(data)
        size += len(data)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def load_python_source(
    test_fraction: float = 0.1,
    seed: int = 0,
    seq_len: int = 64,
    max_chars: int = 1_000_000,
) -> tuple[Split, Split]:
    """Byte-level next-token data from the Python standard library's source.

    Parameters
    ----------
    test_fraction : float
        Fraction of the blocks of windows held out as test, in (0, 1).
    seed : int
        Seeds which blocks are test blocks.
    seq_len : int
        Tokens per sample ``T``.
    max_chars : int
        Bytes of source read (1,000,000 by default: about 15,000 windows of 64, read in
        well under a second).

    Returns
    -------
    (Split, Split)
        ``(train, test)``; ``x`` int64 token ids ``(N, T)`` in ``[0, 256)``, ``y`` int64
        next-token labels ``(N, T)`` (``y[i, t] = x[i, t + 1]``, and ``y[i, T - 1]`` the
        byte that follows the window).

    Raises
    ------
    ValueError
        On a test fraction outside (0, 1), ``seq_len < 1``, or a text too short for one
        train and one test block.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    data = python_source_bytes(int(max_chars)).astype(np.int64)
    windows = (len(data) - 1) // seq_len
    blocks = windows // BLOCK_WINDOWS
    if blocks < 2:
        raise ValueError(
            f"max_chars={max_chars} gives {windows} windows of {seq_len} tokens: need at "
            f"least {2 * BLOCK_WINDOWS} (two blocks of {BLOCK_WINDOWS}); raise max_chars"
        )
    n = blocks * BLOCK_WINDOWS
    starts = np.arange(n) * seq_len
    offsets = starts[:, None] + np.arange(seq_len)[None, :]
    x, y = data[offsets], data[offsets + 1]
    n_test = min(blocks - 1, max(1, round(test_fraction * blocks)))
    test_blocks = np.zeros(blocks, dtype=bool)
    test_blocks[np.random.default_rng(seed).permutation(blocks)[:n_test]] = True
    is_test = np.repeat(test_blocks, BLOCK_WINDOWS)
    return Split(x[~is_test], y[~is_test]), Split(x[is_test], y[is_test])
