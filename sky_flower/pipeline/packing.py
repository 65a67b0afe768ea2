"""Several tensors across one cut, as one tensor: the packed format every transport and
schedule carries when a converted model's cut holds hidden states and an attention mask,
a skip connection, or a model's several inputs
(:func:`sky_flower.pipeline.graph.as_sequential`).

Each tensor is flattened per sample and cast to one dtype, side by side: ``(B, n)``.
Gradients flow back to every floating tensor; an integer tensor (a mask, token ids)
gets none (zeros in the packed gradient).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CutSpec:
    """What one cut carries when it carries several tensors: their trailing shapes
    (all but the batch dimension) and dtypes, in order, packed as one tensor of shape
    ``(B, sum of their sizes)`` and ``dtype`` (:func:`pack`)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> CutSpec:
        """The spec of ``tensors`` (one sample's shapes and the dtypes): packed in the
        widest floating dtype among them (at least float32 if an integer tensor rides
        along, whose values must then be exact in it), or the widest integer dtype if
        none is floating."""
        dtypes = tuple(t.dtype for t in tensors)
        floats = [d for d in dtypes if d.is_floating_point]
        if floats:
            dtype = functools.reduce(torch.promote_types, floats)
            if len(floats) < len(dtypes):
                dtype = torch.promote_types(dtype, torch.float32)
        else:
            dtype = torch.int64
        return cls(tuple(tuple(t.shape[1:]) for t in tensors), dtypes, dtype)

    @property
    def sizes(self) -> list[int]:
        """Elements per sample of each tensor."""
        return [math.prod(s) for s in self.shapes]


def pack(tensors: Sequence[torch.Tensor], spec: CutSpec) -> torch.Tensor:
    """The tensors that cross one cut as one tensor of shape ``(B, sum(spec.sizes))``:
    each flattened per sample and cast to ``spec.dtype``, side by side. Gradients flow
    back to every floating tensor; an integer tensor (an attention mask, position ids)
    gets none.

    Raises
    ------
    ValueError
        If an integer tensor holds a value that ``spec.dtype`` cannot hold exactly
        (beyond 2**24 in float32).
    """
    batch = tensors[0].shape[0]
    parts = []
    for t in tensors:
        if t.dtype != torch.bool and not t.dtype.is_floating_point and t.device.type != "meta":
            if spec.dtype.is_floating_point and t.numel():
                limit = 2 ** (round(-math.log2(torch.finfo(spec.dtype).eps)) + 1)
                biggest = int(t.abs().max())
                if biggest > limit:
                    raise ValueError(
                        f"an integer tensor of dtype {t.dtype} crossing a cut holds "
                        f"{biggest}, beyond what {spec.dtype} holds exactly ({limit}): "
                        "cut elsewhere (split_points) so that it does not cross"
                    )
        parts.append(t.reshape(batch, -1).to(spec.dtype))
    return torch.cat(parts, dim=1)


def unpack(packed: torch.Tensor, spec: CutSpec) -> list[torch.Tensor]:
    """The tensors :func:`pack` packed, in their own shapes and dtypes, each contiguous
    (as traced: a unit's graph may view one across its batch dimension)."""
    batch = packed.shape[0]
    out, start = [], 0
    for shape, dtype, size in zip(spec.shapes, spec.dtypes, spec.sizes, strict=True):
        part = packed[:, start : start + size].reshape(batch, *shape).contiguous()
        out.append(part if dtype == packed.dtype else part.to(dtype))
        start += size
    return out


def pack_inputs(tensors: Sequence[Any]) -> Any:  # noqa: ANN401 - tensors or arrays
    """A model's several inputs (``input_ids`` and ``attention_mask``, each ``(B,
    ...)``) as the one tensor a converted model's first unit takes (``seq.input_spec``
    describes it): what a data owner's ``load_data`` returns as ``x``. numpy arrays in,
    a numpy array out.

    Raises
    ------
    ValueError
        As :func:`pack`.
    """
    import numpy as np

    arrays = [isinstance(t, np.ndarray) for t in tensors]
    parts = [torch.from_numpy(t) if a else t for t, a in zip(tensors, arrays, strict=True)]
    packed = pack(parts, CutSpec.of(parts))
    return packed.numpy() if all(arrays) else packed
