"""A small decoder-only transformer language model as an ``nn.Sequential`` of blocks.

GPT-style (Radford et al. 2019): token plus learned position embedding, ``n_layers``
pre-norm blocks (causal multi-head self-attention, Vaswani et al. 2017, arXiv
1706.03762, then a GELU MLP, each with a residual connection), a final LayerNorm and a
linear head. Every block takes and returns one tensor ``(B, T, d_model)``, so the
partitioner may cut between any two entries. The causal mask is built inside each
attention call (``scaled_dot_product_attention(is_causal=True)``): no buffer to split.

The head is untied from the token embedding: a tied head would share one parameter
between the first and the last entry, which no cut between them can keep (each stage
owns its own parameters).

The objective: :func:`lm_cross_entropy` (mean over tokens) and :func:`token_correct`
(correct next-token predictions, counted in tokens: accuracy = correct / tokens, where
tokens = samples x ``T``). Perplexity = ``exp(mean loss)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` int64 ids -> ``(B, T, d_model)``.

    Parameters
    ----------
    vocab_size, seq_len, d_model : int
        Vocabulary, longest sequence, width.
    dropout : float
        Dropout on the sum.
    """

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids, ``T <= seq_len`` -> ``(B, T, d_model)``."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.tok(ids) + self.pos(positions))


def split_heads(qkv: torch.Tensor, n_heads: int) -> list[torch.Tensor]:
    """A fused projection ``(B, T, 3 d)`` as ``[q, k, v]``, each ``(B, n_heads, T, d /
    n_heads)``."""
    B, T, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    return [t.view(B, T, n_heads, d // n_heads).transpose(1, 2) for t in qkv.split(d, dim=2)]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(B, T, d) -> (B, T, d)``.

    Raises
    ------
    ValueError
        If ``d_model`` is not divisible by ``n_heads``.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, d) -> (B, T, d)``; position ``t`` attends to positions ``<= t``."""
        B, T, d = x.shape
        q, k, v = split_heads(self.qkv(x), self.n_heads)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, d)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, mlp_ratio: int = 4):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, d) -> (B, T, d)``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def build_transformer_lm(
    vocab_size: int = 256,
    seq_len: int = 64,
    d_model: int = 64,
    n_heads: int = 4,
    n_layers: int = 2,
    dropout: float = 0.1,
) -> nn.Sequential:
    """A decoder-only transformer LM whose entries the partitioner may split.

    Parameters
    ----------
    vocab_size : int
        Tokens (256 for the byte-level corpus of
        :func:`sky_flower.pipeline.text.load_python_source`).
    seq_len : int
        Longest input sequence ``T``.
    d_model, n_heads, n_layers : int
        Width, attention heads (must divide ``d_model``), blocks.
    dropout : float
        Dropout after the embedding, in attention, after each residual branch.

    Returns
    -------
    nn.Sequential
        ``[Embedding, Block x n_layers, LayerNorm, Linear head]``; maps ``(B, T)``
        int64 ids to ``(B, T, vocab_size)`` logits (``n_layers + 3`` entries).

    Raises
    ------
    ValueError
        On a non-positive size or ``d_model`` not divisible by ``n_heads``.
    """
    if min(vocab_size, seq_len, d_model, n_heads) < 1 or n_layers < 0:
        raise ValueError("vocab_size, seq_len, d_model, n_heads must be >= 1, n_layers >= 0")
    return nn.Sequential(
        Embedding(vocab_size, seq_len, d_model, dropout),
        *[Block(d_model, n_heads, dropout) for _ in range(n_layers)],
        nn.LayerNorm(d_model),
        nn.Linear(d_model, vocab_size, bias=False),
    )


IGNORE_INDEX = -100  # a label position that is padding: no loss, no token counted


def lm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token) over the positions whose label is
    not :data:`IGNORE_INDEX` (padding). A token-weighted mean: under Sky its reduction
    is ``weighted`` by :func:`token_count` (``conf/task/lm.yaml``), so that a split
    batch whose micro-batches hold different numbers of real tokens trains exactly as
    the whole batch does.

    Parameters
    ----------
    logits : torch.Tensor, shape (B, T, V)
    labels : torch.Tensor, shape (B, T), int64

    Returns
    -------
    torch.Tensor
        Scalar; ``exp`` of it is the perplexity.
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


def token_count(labels: torch.Tensor) -> int:
    """Positions :func:`lm_cross_entropy` averages over: labels not :data:`IGNORE_INDEX`
    (``objective.weight`` of the ``lm`` task).

    Parameters
    ----------
    labels : torch.Tensor, shape (B, T), int64

    Returns
    -------
    int
    """
    return int((labels != IGNORE_INDEX).sum())


def token_correct(logits: torch.Tensor, labels: torch.Tensor) -> int:
    """Correct next-token predictions, counted in tokens.

    Parameters
    ----------
    logits : torch.Tensor, shape (B, T, V)
    labels : torch.Tensor, shape (B, T)

    Returns
    -------
    int
        Positions whose arg-max token is the label (at most ``B * T``: token accuracy is
        this over ``labels.numel()``, not over the ``B`` samples).
    """
    return int((logits.argmax(dim=-1) == labels).sum())


def perplexity(mean_loss: float) -> float:
    """``exp(mean_loss)``: the perplexity of a mean cross-entropy in nats (inf on overflow)."""
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return float("inf")
