"""The one synthetic input built from a shape (profiles, shape probes, static stages).

Inputs may be integer tensors (token ids of a language model): an integer probe is
zeros (a valid id for any vocabulary), a floating one standard normal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """``dtype`` as a ``torch.dtype``; a name such as ``"int64"`` or ``"torch.int64"``,
    ``None`` for float32.

    Raises
    ------
    ValueError
        If the name is not a torch dtype.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown input dtype {dtype!r}: use a torch dtype name, e.g. int64")
    return found


def dtype_name(dtype: torch.dtype | str | None) -> str:
    """The name of ``dtype`` as it travels in a message or config (``"int64"``)."""
    return str(as_dtype(dtype)).removeprefix("torch.")


def example_input(
    batch: int, input_shape: Sequence[int], input_dtype: torch.dtype | str | None = None
) -> torch.Tensor:
    """A synthetic input of ``batch`` samples of shape ``input_shape``.

    Parameters
    ----------
    batch : int
        Samples (the leading dimension).
    input_shape : sequence of int
        One sample's shape, without the batch dimension.
    input_dtype : torch.dtype or str, optional
        Default float32. Integer (and bool) dtypes give zeros, floating ones ``randn``
        from a private generator seeded 0 (the global RNG is left untouched, so a probe
        does not shift the dropout masks of the training that follows), on the current
        default device (a ``meta`` context gives a meta tensor).

    Returns
    -------
    torch.Tensor, shape (batch, *input_shape)
    """
    dtype = as_dtype(input_dtype)
    shape = (int(batch), *[int(d) for d in input_shape])
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    return torch.zeros(shape, dtype=dtype)
