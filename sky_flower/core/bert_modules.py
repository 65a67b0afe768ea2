"""The BERT entry modules SkyComputing partitions (also instantiable on CPU).

SkyComputing (Zhu, Li, You, arXiv 2202.11836, Sec. 4) splits BERT for sequence
classification into ``1 + 3 L + 2`` entries: embeddings; per encoder layer attention,
intermediate and output; pooler; classifier. These are those entries as ``nn.Module``s
(BERT: Devlin et al. 2019, arXiv 1810.04805), written so that FlopCounterMode counts
them the same on CPU and on the meta device (attention as two explicit batched matrix
products; see :mod:`sky_flower.core.bert`). :func:`_build` and :func:`_inputs` make one
entry of a type and its example inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

ENTRY_TYPES = ("embeddings", "attention", "intermediate", "output", "pooler", "classifier")


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm.

    Shapes: input token ids ``(B, s)`` int64, output ``(B, s, hidden)``. Token types
    are all 0 (single-segment input).
    """

    def __init__(self, vocab_size: int, hidden: int, max_position: int, type_vocab: int) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab_size, hidden)
        self.position = nn.Embedding(max_position, hidden)
        self.token_type = nn.Embedding(type_vocab, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, s)`` token ids -> ``(B, s, hidden)``."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        types = torch.zeros_like(ids)
        x = self.word(ids) + self.position(positions) + self.token_type(types)
        return self.norm(x)


class BertAttention(nn.Module):
    """Self-attention with output projection, residual and LayerNorm (no mask).

    Shapes: ``(B, s, hidden)`` -> ``(B, s, hidden)``.
    """

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return x.reshape(b, s, self.heads, h // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, s, hidden)`` -> ``(B, s, hidden)``."""
        b, s, h = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(h // self.heads)
        context = torch.matmul(F.softmax(scores, dim=-1), v)
        context = context.transpose(1, 2).reshape(b, s, h)
        return self.norm(self.dense(context) + x)


class BertIntermediate(nn.Module):
    """Dense ``hidden -> intermediate`` + GELU: ``(B, s, hidden)`` -> ``(B, s, inter)``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, s, hidden)`` -> ``(B, s, intermediate)``."""
        return F.gelu(self.dense(x))


class BertOutput(nn.Module):
    """Dense ``intermediate -> hidden``, residual + LayerNorm.

    Shapes: ``(B, s, intermediate)`` and the residual ``(B, s, hidden)`` ->
    ``(B, s, hidden)``.
    """

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(intermediate, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``(B, s, intermediate)``, ``(B, s, hidden)`` -> ``(B, s, hidden)``."""
        return self.norm(self.dense(x) + residual)


class BertPooler(nn.Module):
    """Dense + tanh on the first token: ``(B, s, hidden)`` -> ``(B, hidden)``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, s, hidden)`` -> ``(B, hidden)``."""
        return torch.tanh(self.dense(x[:, 0]))


def _build(kind: str, sizes: Mapping[str, int]) -> nn.Module:
    """One entry of type ``kind`` of the BERT of ``sizes`` (``hidden``, ``heads``,
    ``intermediate``, ``num_classes``, ``vocab_size``, ``max_position``,
    ``type_vocab``)."""
    hidden, intermediate = sizes["hidden"], sizes["intermediate"]
    if kind == "embeddings":
        return BertEmbeddings(
            sizes["vocab_size"], hidden, sizes["max_position"], sizes["type_vocab"]
        )
    if kind == "attention":
        return BertAttention(hidden, sizes["heads"])
    if kind == "intermediate":
        return BertIntermediate(hidden, intermediate)
    if kind == "output":
        return BertOutput(hidden, intermediate)
    if kind == "pooler":
        return BertPooler(hidden)
    if kind == "classifier":
        return nn.Linear(hidden, sizes["num_classes"])
    raise ValueError(f"unknown BERT entry type {kind!r}: choose one of {', '.join(ENTRY_TYPES)}")


def _inputs(
    kind: str, batch: int, seq_len: int, hidden: int, intermediate: int, device: torch.device
) -> list[torch.Tensor]:
    if kind == "embeddings":
        return [torch.zeros(batch, seq_len, dtype=torch.long, device=device)]
    if kind == "output":
        return [
            torch.randn(batch, seq_len, intermediate, device=device, requires_grad=True),
            torch.randn(batch, seq_len, hidden, device=device, requires_grad=True),
        ]
    if kind == "classifier":
        return [torch.randn(batch, hidden, device=device, requires_grad=True)]
    return [torch.randn(batch, seq_len, hidden, device=device, requires_grad=True)]
