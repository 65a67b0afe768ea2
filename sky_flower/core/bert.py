"""BERT profiled for the planner without building or training it.

SkyComputing (Zhu, Li, You, arXiv 2202.11836, Sec. 4; their ``experiment/config.py``)
splits BERT-large for sequence classification into ``1 + 3 L + 2`` partitionable
entries:

* ``embeddings``: word + position + token-type embeddings, then LayerNorm;
* per encoder layer ``k`` three entries:

  - ``layer<k>.attention``: Q, K, V projections, scaled-dot-product attention over the
    heads, output dense, residual + LayerNorm;
  - ``layer<k>.intermediate``: dense ``hidden -> intermediate`` + GELU;
  - ``layer<k>.output``: dense ``intermediate -> hidden``, residual (the attention
    entry's output) + LayerNorm;

* ``pooler``: dense + tanh on the first token;
* ``classifier``: dense ``hidden -> num_classes``.

Because the output entry adds the attention entry's output back (the residual), the
intermediate entry passes that tensor on next to its own result (SkyComputing's
``BertLayer_Body`` returns both): a stage boundary after an intermediate entry carries
``seq_len x (intermediate + hidden)`` floats per sample, and that is what
``act_out_bytes`` of the intermediate entry (and ``act_in_bytes`` of the output entry)
says.

FLOPs come from :class:`torch.utils.flop_counter.FlopCounterMode` on real modules of each
entry type, built once per type on the meta device (no memory is allocated, so a
160-layer model profiles in milliseconds; every encoder layer reuses its type's counts).
Bytes come from shapes; each entry's ``stash_bytes`` (what autograd saves for the backward
pass) from the tensors the meta forward saves.

Simplifications, all standard for a planner:

* no attention mask (every token valid) and no dropout (neither does matrix products);
* FlopCounterMode counts matrix products only (``mm``, ``addmm``, ``bmm``, ...): softmax,
  GELU, tanh, LayerNorm, residual adds, bias adds and embedding look-ups count 0. The
  embeddings entry therefore has 0 FLOPs, and the matmul counts below are exact;
* attention is written as two explicit batched matrix products (``Q K^T`` and ``P V``)
  rather than ``F.scaled_dot_product_attention``: on CPU in this PyTorch the fused SDPA
  kernel is not counted by FlopCounterMode at all, so the same module would count
  differently on CPU and on meta.

Closed forms per sample (``s`` = seq_len, ``h`` = hidden, ``I`` = intermediate,
``C`` = num_classes; one multiply-add = 2 FLOPs): attention forward
``4 (2 s h^2) + 2 (2 s^2 h)``, intermediate and output forward ``2 s h I`` each, pooler
``2 h^2``, classifier ``2 h C``; backward is twice the forward (input and weight
gradients) except for the embeddings (no input gradient; the weight gradient of a
look-up is a scatter-add, not counted).

Example
-------
>>> layers = bert_layer_profiles(num_layers=2)
>>> [p.name for p in layers][:4]
['0:embeddings', '1:layer0.attention', '2:layer0.intermediate', '3:layer0.output']
>>> len(bert_layer_profiles(num_layers=160))
483
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from sky_flower.core.bert_modules import (
    ENTRY_TYPES,
    BertAttention,
    BertEmbeddings,
    BertIntermediate,
    BertOutput,
    BertPooler,
    _build,
    _inputs,
)
from sky_flower.core.profile import LayerProfile

META = torch.device("meta")
TOKEN_ID_BYTES = 8  # int64 token ids enter the embeddings entry
OPTIMIZER_STATE_COPIES = {"adam": 2, "sgd": 0, "sgd_momentum": 1}

__all__ = [
    "ENTRY_TYPES",
    "META",
    "OPTIMIZER_STATE_COPIES",
    "TOKEN_ID_BYTES",
    "BertAttention",
    "BertEmbeddings",
    "BertIntermediate",
    "BertOutput",
    "BertPooler",
    "EntryCost",
    "bert_entry_costs",
    "bert_layer_profiles",
]


@dataclass(frozen=True)
class EntryCost:
    """What one entry type costs, per sample (see :func:`bert_entry_costs`).

    Attributes
    ----------
    fwd_flops, bwd_flops : float
        Forward / backward FLOPs per sample as counted by FlopCounterMode.
    params : int
        Number of trainable parameters.
    in_elems, out_elems : int
        Elements per sample of the entry's input(s) and output(s) (for the embeddings,
        ``in_elems`` counts int64 token ids; for the intermediate entry ``out_elems``
        includes the residual it passes on).
    stash_bytes : float
        Bytes per sample autograd saves for the backward pass (parameters excluded).
    """

    fwd_flops: float
    bwd_flops: float
    params: int
    in_elems: int
    out_elems: int
    stash_bytes: float


def _measure(module: nn.Module, inputs: list[torch.Tensor]) -> tuple[float, float, int, int]:
    """Forward FLOPs, backward FLOPs, floating-point elements and other bytes saved for
    backward (parameters excluded) of one pass of ``module``."""
    params = {id(p) for p in module.parameters()}
    saved: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive, so ids stay unique)

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t  # a view holds its base's memory
        if id(base) not in params:
            saved[id(base)] = base
        return t

    fwd = FlopCounterMode(display=False)
    with fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    bwd_flops = 0.0
    if out.requires_grad:
        bwd = FlopCounterMode(display=False)
        with bwd:
            out.backward(torch.ones_like(out))
        bwd_flops = float(bwd.get_total_flops())
    float_elems = sum(t.numel() for t in saved.values() if t.is_floating_point())
    other_bytes = sum(
        t.numel() * t.element_size() for t in saved.values() if not t.is_floating_point()
    )
    return float(fwd.get_total_flops()), bwd_flops, float_elems, other_bytes


def bert_entry_costs(
    hidden: int = 1024,
    heads: int = 16,
    intermediate: int = 4096,
    seq_len: int = 128,
    num_classes: int = 3,
    vocab_size: int = 30522,
    max_position: int = 512,
    type_vocab: int = 2,
    dtype_bytes: int = 4,
) -> dict[str, EntryCost]:
    """Per-sample cost of each BERT entry type, measured once on the meta device.

    Parameters
    ----------
    hidden, heads, intermediate, seq_len, num_classes, vocab_size, max_position,
    type_vocab : int
        BERT shape (defaults: BERT-large, sequence length 128, 3 classes as in MNLI).
    dtype_bytes : int
        Bytes per activation element (4 = float32); scales ``stash_bytes``.

    Returns
    -------
    dict of str to EntryCost
        Keyed by ``ENTRY_TYPES``. Cached per shape: the first call in a process also
        pays PyTorch's one-time set-up of meta kernels (about 1 s), later ones take
        milliseconds.

    Raises
    ------
    ValueError
        On a non-positive size, ``hidden`` not a multiple of ``heads`` or
        ``seq_len > max_position``.
    """
    sizes = dict(
        hidden=hidden,
        heads=heads,
        intermediate=intermediate,
        seq_len=seq_len,
        num_classes=num_classes,
        vocab_size=vocab_size,
        max_position=max_position,
        type_vocab=type_vocab,
        dtype_bytes=dtype_bytes,
    )
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"BERT sizes must be positive integers, got {bad}")
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    if seq_len > max_position:
        raise ValueError(f"seq_len ({seq_len}) exceeds max_position ({max_position})")
    return dict(_entry_costs(**sizes))


@lru_cache(maxsize=64)
def _entry_costs(**sizes: int) -> dict[str, EntryCost]:
    """:func:`bert_entry_costs` of sizes it has checked, measured once per shape."""
    s, h, inter = sizes["seq_len"], sizes["hidden"], sizes["intermediate"]
    elems = {
        "embeddings": (s, s * h),
        "attention": (s * h, s * h),
        "intermediate": (s * h, s * (inter + h)),
        "output": (s * (inter + h), s * h),
        "pooler": (s * h, h),
        "classifier": (h, sizes["num_classes"]),
    }
    costs: dict[str, EntryCost] = {}
    for kind in ENTRY_TYPES:
        with torch.device(META):  # no memory: only shapes and FLOPs are needed
            module = _build(kind, sizes)
        inputs = _inputs(kind, 1, s, h, inter, META)
        fwd, bwd, saved_floats, saved_other = _measure(module, inputs)
        costs[kind] = EntryCost(
            fwd_flops=fwd,
            bwd_flops=bwd,
            params=sum(p.numel() for p in module.parameters()),
            in_elems=elems[kind][0],
            out_elems=elems[kind][1],
            stash_bytes=float(saved_floats * sizes["dtype_bytes"] + saved_other),
        )
    return costs


def _entry_kinds(num_layers: int) -> list[tuple[str, str]]:
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    kinds = [("embeddings", "embeddings")]
    for k in range(num_layers):
        kinds += [(f"layer{k}.{t}", t) for t in ("attention", "intermediate", "output")]
    return kinds + [("pooler", "pooler"), ("classifier", "classifier")]


def bert_layer_profiles(
    num_layers: int = 24,
    hidden: int = 1024,
    heads: int = 16,
    intermediate: int = 4096,
    seq_len: int = 128,
    num_classes: int = 3,
    vocab_size: int = 30522,
    max_position: int = 512,
    type_vocab: int = 2,
    optimizer: str = "adam",
    dtype_bytes: int = 4,
) -> list[LayerProfile]:
    """Per-entry profile of BERT split the SkyComputing way, without building the model.

    Parameters
    ----------
    num_layers : int
        Encoder layers ``L`` (24 for BERT-large; SkyComputing's largest run used 160).
    hidden, heads, intermediate : int
        Hidden size, attention heads, feed-forward size (BERT-large: 1024, 16, 4096).
    seq_len : int
        Tokens per sample (SkyComputing: 128).
    num_classes : int
        Classifier outputs (3 for MNLI, SkyComputing's task).
    vocab_size, max_position, type_vocab : int
        Embedding table sizes (BERT's uncased vocabulary: 30522, 512, 2).
    optimizer : {"adam", "sgd", "sgd_momentum"}
        Names as in :func:`sky_flower.core.profile.default_optimizer_factory`; state is 2, 0
        and 1 copies of the parameters (Adam's per-tensor ``step`` scalars are ignored).
    dtype_bytes : int
        Bytes per parameter and activation element (4 = float32).

    Returns
    -------
    list of LayerProfile
        ``1 + 3 num_layers + 2`` entries named ``"<index>:embeddings"``,
        ``"<index>:layer<k>.attention"``, ``"<index>:layer<k>.intermediate"``,
        ``"<index>:layer<k>.output"``, ``"<index>:pooler"``, ``"<index>:classifier"``.
        FLOPs are per sample (FlopCounterMode: matrix products only, see the module
        docstring); ``param_bytes = numel x dtype_bytes``; ``act_in_bytes`` /
        ``act_out_bytes`` are per sample (embedding input: ``seq_len`` int64 ids;
        intermediate output: ``seq_len x (intermediate + hidden)`` including the
        residual; pooler output ``hidden``; classifier output ``num_classes``);
        ``stash_bytes`` per sample: every distinct tensor autograd saves for the
        entry's backward (:func:`torch.autograd.graph.saved_tensors_hooks` on a meta
        forward), parameters excluded, its own input included when saved, views of one
        tensor once.

    Raises
    ------
    ValueError
        On a non-positive size, ``hidden`` not a multiple of ``heads``,
        ``seq_len > max_position`` or an unknown optimizer.
    """
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATE_COPIES)}"
        )
    kinds = _entry_kinds(num_layers)
    costs = bert_entry_costs(
        hidden,
        heads,
        intermediate,
        seq_len,
        num_classes,
        vocab_size,
        max_position,
        type_vocab,
        dtype_bytes,
    )
    copies = OPTIMIZER_STATE_COPIES[optimizer]
    profiles = []
    for index, (name, kind) in enumerate(kinds):
        c = costs[kind]
        in_bytes = TOKEN_ID_BYTES if kind == "embeddings" else dtype_bytes
        profiles.append(
            LayerProfile(
                index=index,
                name=f"{index}:{name}",
                fwd_flops=c.fwd_flops,
                bwd_flops=c.bwd_flops,
                param_bytes=c.params * dtype_bytes,
                optimizer_state_bytes=copies * c.params * dtype_bytes,
                act_in_bytes=float(c.in_elems * in_bytes),
                act_out_bytes=float(c.out_elems * dtype_bytes),
                stash_bytes=c.stash_bytes,
            )
        )
    return profiles
