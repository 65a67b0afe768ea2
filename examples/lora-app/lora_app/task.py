"""The model, the data and the server's evaluation.

The model: a small Llama-family causal LM (``transformers`` ``LlamaConfig``, random
weights drawn once under a fixed seed, written once with ``save_pretrained`` by
:func:`model_path`: nothing is downloaded) as the frozen base, with ``peft`` LoRA
adapters (rank :data:`LORA_R`, on the attention projections ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``, ``lora_dropout`` :data:`LORA_DROPOUT`). Only the adapters train;
``lora_r=0`` gives the same model without adapters, every weight trained (full
fine-tuning, for comparison: :mod:`sky_flower.bench.lora`).

The data: byte-level next-token prediction (vocabulary 256) on the Python standard
library's source (:func:`sky_flower.pipeline.text.load_python_source`: windows of
:data:`SEQ_LEN` bytes, train and held-out test split by contiguous blocks), IID
partitions of the train windows for the data owners, the test windows for the server.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from sky_flower.pipeline.data import Split
from sky_flower.pipeline.text import VOCAB_SIZE, load_python_source

SEQ_LEN = 32  # bytes per sample
MAX_CHARS = 400_000  # bytes of standard-library source read (about 12,000 windows)
TEST_WINDOWS = 256  # held-out windows the server evaluates on
# the base model (about 8.5 M parameters, 34 MB of float32 weights)
BASE_CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 10,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": SEQ_LEN,
    "tie_word_embeddings": False,  # an untied head: the planner may cut before it
    "use_cache": False,  # training: no key/value cache
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
BASE_SEED = 0
LORA_R, LORA_ALPHA, LORA_DROPOUT = 4, 8, 0.05
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_SEED = 1  # lora_A's initialisation (lora_B starts at zero, as peft does)


def model_path(model_name: str = "") -> str:
    """``model_name`` (a local ``save_pretrained`` directory), or, when empty, the base
    model of :data:`BASE_CONFIG` (seeded by :data:`BASE_SEED`), written once to
    ``$SKY_FLOWER_CACHE`` (default ``~/.cache/sky-flower``) under a name that holds the
    config's hash: a changed config writes a new directory."""
    if model_name:
        return model_name
    import hashlib
    import json

    key = json.dumps([BASE_CONFIG, BASE_SEED], sort_keys=True)
    tag = hashlib.sha256(key.encode()).hexdigest()[:10]
    root = Path(os.environ.get("SKY_FLOWER_CACHE", Path.home() / ".cache" / "sky-flower"))
    path = root / f"lora-app-llama-{tag}"
    if (path / "config.json").exists():
        return str(path)
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BASE_SEED)
        model = LlamaForCausalLM(LlamaConfig(**BASE_CONFIG))
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".lora-app-llama-{tag}-{os.getpid()}"
    model.save_pretrained(tmp)
    try:
        tmp.rename(path)  # atomic: nodes writing it at once keep the first
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def get_model(model_name: str = "", lora_r: int = LORA_R) -> nn.Module:
    """The base causal LM from :func:`model_path`, its weights frozen, with LoRA
    adapters of rank ``lora_r`` (``0``: no adapters, every weight trains)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        model_path(model_name), local_files_only=True, attn_implementation="eager"
    )
    if lora_r == 0:
        return base
    import peft

    config = peft.LoraConfig(
        r=lora_r,
        lora_alpha=LORA_ALPHA,
        lora_dropout=LORA_DROPOUT,
        target_modules=LORA_TARGETS,
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(LORA_SEED)
        return peft.get_peft_model(base, config)


@cache
def net_fn(model_name: str = "", lora_r: int = LORA_R) -> Callable[[], nn.Sequential]:
    """The ``model_fn`` Sky splits: :func:`get_model` called with ``input_ids`` of
    :data:`SEQ_LEN` tokens, returning its logits, converted once per process
    (:func:`sky_flower.pipeline.hf.hf_model_fn`; one per arguments, so that the
    ClientApp and the ServerApp in one process share it)."""
    from sky_flower.pipeline.hf import hf_model_fn

    return hf_model_fn(lambda: get_model(model_name, lora_r), ["input_ids"], SEQ_LEN)


@cache
def _text() -> tuple[Split, Split]:
    return load_python_source(test_fraction=0.1, seed=0, seq_len=SEQ_LEN, max_chars=MAX_CHARS)


def load_data(partition_id: int, num_partitions: int) -> Split:
    """IID partition ``partition_id`` of ``num_partitions`` of the train windows:
    ``x`` input bytes ``(n, SEQ_LEN)``, ``y`` the next bytes ``(n, SEQ_LEN)``."""
    train = _text()[0]
    idx = np.array_split(np.random.default_rng(0).permutation(len(train)), num_partitions)
    part = np.sort(idx[partition_id])
    return Split(train.x[part], train.y[part])


def load_test() -> Split:
    """The first :data:`TEST_WINDOWS` held-out windows (text no data owner trains on)."""
    test = _text()[1]
    return Split(test.x[:TEST_WINDOWS], test.y[:TEST_WINDOWS])


def evaluate(net: nn.Module, data: Split, batch_size: int = 64) -> dict[str, float]:
    """Mean next-byte cross-entropy of ``net`` (a causal LM) on ``data``, its
    perplexity and the next-byte accuracy (dropout off)."""
    net.eval()
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    total, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits = net(input_ids=x[i : i + batch_size]).logits
            labels = y[i : i + batch_size]
            total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
            correct += int((logits.argmax(-1) == labels).sum())
    tokens = y.numel()
    loss = total / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": correct / tokens}
