"""A small Llama-style decoder-only language model, written as a user writes one: a plain
``nn.Module`` whose root holds state every block reads.

Token embedding, ``n_layers`` pre-norm blocks (RMSNorm, Zhang and Sennrich 2019, arXiv
1910.07467; causal multi-head self-attention, Vaswani et al. 2017, arXiv 1706.03762,
with rotary position embeddings, RoPE, Su et al. 2021, arXiv 2104.09864; a SwiGLU MLP,
Shazeer 2020, arXiv 2002.05202), a final RMSNorm and a head, optionally tied to the
embedding (Press and Wolf 2017, arXiv 1608.05859), as in Llama (Touvron et al. 2023,
arXiv 2302.13971).

The rotary tables (``cos``, ``sin``: ``(seq_len, head_dim / 2)``) are non-persistent
buffers of the *root* module; the root slices them to the input's length and hands them
to every block. It is no ``nn.Sequential``: split training takes it through
:func:`sky_flower.pipeline.graph.sequential_of` (``conf/model/llama_lm.yaml``), which
copies the tables into every stage that reads them, so the model may be cut between
any two blocks. A tied head shares one trainable parameter between the first and the
last unit; split training keeps no two copies of a trainable parameter, so a tied head
makes the whole model one unit (``tie_head=False``, the config's default, can be cut).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from sky_flower.pipeline.lm import split_heads


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension: ``(..., d) -> (..., d)``."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d) -> (..., d)``."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Rotation angles ``t / base^(2i / head_dim)``: shape ``(seq_len, head_dim / 2)``."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``(B, H, T, D)``: pairs ``(x[2i], x[2i+1])`` rotated by the angle of
    position ``t`` (``cos``, ``sin``: ``(T, D / 2)``)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` (causal, RoPE), then ``x + mlp(norm(x))``.

    Raises
    ------
    ValueError
        If ``d_model`` is not divisible by ``n_heads`` or the head width is odd.
    """

    def __init__(self, d_model: int, n_heads: int, hidden: int):
        super().__init__()
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(
                f"d_model={d_model} must be divisible by n_heads={n_heads} into an even head "
                "width (rotary embeddings rotate pairs)"
            )
        self.n_heads = n_heads
        self.attn_norm = RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.mlp_norm = RMSNorm(d_model)
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``(B, T, d)`` and the tables ``(T, d / (2 n_heads))`` -> ``(B, T, d)``."""
        B, T, d = x.shape
        q, k, v = split_heads(self.qkv(self.attn_norm(x)), self.n_heads)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaLM(nn.Module):
    """Decoder-only LM: ``(B, T)`` int64 token ids -> ``(B, T, vocab_size)`` logits.

    Parameters
    ----------
    vocab_size, seq_len, d_model, n_heads, n_layers : int
        As :func:`sky_flower.pipeline.lm.build_transformer_lm`; ``seq_len`` is the
        rotary tables' length, ``d_model / n_heads`` must be even.
    mlp_ratio : float
        SwiGLU hidden width over ``d_model``.
    tie_head : bool
        The head's weight is the embedding's (one parameter).

    Raises
    ------
    ValueError
        On a non-positive size, or a head width that is not an even integer.
    """

    def __init__(  # noqa: PLR0913
        self,
        vocab_size: int = 256,
        seq_len: int = 64,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 4,
        mlp_ratio: float = 8 / 3,
        tie_head: bool = False,
    ):
        super().__init__()
        if min(vocab_size, seq_len, d_model, n_heads, n_layers) < 1:
            raise ValueError("vocab_size, seq_len, d_model, n_heads, n_layers must be >= 1")
        self.embed = nn.Embedding(vocab_size, d_model)
        hidden = max(1, round(mlp_ratio * d_model))
        self.blocks = nn.ModuleList(LlamaBlock(d_model, n_heads, hidden) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        for m in self.modules():  # Llama's initialisation: N(0, 0.02)
            if isinstance(m, nn.Linear | nn.Embedding) and m.weight.device.type != "meta":
                nn.init.normal_(m.weight, std=0.02)
        if tie_head:
            self.head.weight = self.embed.weight
        angles = rotary_tables(seq_len, d_model // n_heads)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids, ``T <= seq_len`` -> ``(B, T, vocab_size)`` logits."""
        T = ids.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]  # root state every block reads
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))
