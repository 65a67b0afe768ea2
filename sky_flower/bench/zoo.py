"""Models as Flower users write them, built small and seeded, for the model benchmark
(:mod:`sky_flower.bench.models`) and the conversion tests: none was written for Sky.

* ``quickstart_cnn``: Flower's quickstart-pytorch ``Net``, imported from this
  repository's copy of the app (``examples/quickstart-pytorch``): conv1, one ``pool``
  module called twice, conv2, fc1-3, ``F.relu`` and ``view`` in ``forward``.
* ``resnet18``: a torchvision-style ResNet-18 layout (``BasicBlock`` x [2, 2, 2, 2],
  BatchNorm inside every block, ``ReLU(inplace=True)``, a downsample branch),
  ``width`` channels in the first layer (torchvision: 64).
* ``bert_cls``: ``transformers``' ``BertForSequenceClassification`` with its default
  dropout 0.1, the attention mask computed from the padding id (it crosses every cut).
* ``llama``, ``mistral``, ``qwen2``, ``phi3``, ``gemma``, ``gpt_neox``, ``gpt2``,
  ``opt``: tiny random ``transformers`` causal LMs with their default dropouts; the
  families that tie their head to the embedding by default (GPT-2, OPT, Gemma) untied
  (a tied head makes the model one unit, docs/models.md).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from sky_flower.pipeline.data import Split

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_module(app: str, module: str) -> ModuleType:
    """Module ``module`` of the example app ``examples/<app>`` (its folder put on
    ``sys.path`` once)."""
    folder = str(EXAMPLES / app)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(module)


def quickstart_net() -> nn.Module:
    """Flower's quickstart-pytorch CNN, as Flower writes it (``examples/quickstart-pytorch``'s
    ``pytorchexample.task.Net``): ``(B, 3, 32, 32)`` images -> ``(B, 10)`` logits."""
    return example_module("quickstart-pytorch", "pytorchexample.task").Net()


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convolutions with BatchNorm, an
    in-place ReLU, a 1x1 downsample branch where the shape changes."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(bn2(conv2(relu(bn1(conv1(x))))) + identity)``."""
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet layout (``layers`` basic blocks per stage; ResNet-18:
    ``[2, 2, 2, 2]``): ``(B, 3, H, W)`` -> ``(B, num_classes)``."""

    def __init__(
        self, layers: tuple[int, ...] = (2, 2, 2, 2), width: int = 64, num_classes: int = 10
    ) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(width, layers[0], 1)
        self.layer2 = self._make_layer(width * 2, layers[1], 2)
        self.layer3 = self._make_layer(width * 4, layers[2], 2)
        self.layer4 = self._make_layer(width * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [BasicBlock(self.inplanes, planes, stride)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# tiny decoder configs: 3 layers, hidden 32, 4 heads (2 key/value heads where the family
# has them), vocabulary 64; default dropouts
_LM = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}
_GQA = {**_LM, "num_key_value_heads": 2}
HF_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", _GQA),
    "mistral": ("MistralConfig", _GQA),
    "qwen2": ("Qwen2Config", _GQA),
    "phi3": ("Phi3Config", {**_GQA, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gemma": ("GemmaConfig", {**_GQA, "head_dim": 8, "tie_word_embeddings": False}),
    "gpt_neox": ("GPTNeoXConfig", _LM),
    "gpt2": (
        "GPT2Config",
        {"vocab_size": 64, "n_embd": 32, "n_layer": 3, "n_head": 4, "n_positions": 64}
        | {"tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "opt": (
        "OPTConfig",
        {k: v for k, v in _LM.items() if k != "intermediate_size"}
        | {"ffn_dim": 64, "word_embed_proj_dim": 32, "tie_word_embeddings": False},
    ),
}
BERT = {**_LM, "num_labels": 3, "pad_token_id": 0}  # hidden_dropout_prob 0.1 (default)


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: how to build it (seeded) and what it takes."""

    name: str
    kind: str  # "image" (float images, class labels), "lm" (next token), "classify" (ids)
    input_shape: tuple[int, ...]
    make: Callable[[], nn.Module] = field(repr=False)
    classes: int = 10
    vocab: int = 64
    # several input tensors ((shape, dtype) each, in the forward's order): the model then
    # takes them packed as one (input_shape, input_dtype describe the packed tensor)
    inputs: tuple[tuple[tuple[int, ...], str], ...] = ()

    @property
    def input_dtype(self) -> str:
        """``float32`` images or ``int64`` token ids."""
        return "float32" if self.kind == "image" else "int64"

    def build(self, seed: int = 0) -> nn.Module:
        """The model with the weights of ``seed`` (the global generator restored)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.make()

    def data(self, n: int = 64, seed: int = 0) -> Split:
        """``n`` samples of synthetic data in the model's format, seeded: float images
        and class labels; token ids in ``[1, vocab)`` and next-token labels (``lm``);
        token ids padded with 0 after a random length in ``[T/2, T]`` and class labels
        (``classify``; with several ``inputs``: the ids and their attention mask,
        packed)."""
        import numpy as np

        from sky_flower.pipeline.graph import pack_inputs

        rng = np.random.default_rng(seed)
        if self.kind == "image":
            x = rng.normal(0.0, 1.0, size=(n, *self.input_shape)).astype(np.float32)
            return Split(x=x, y=rng.integers(0, self.classes, size=n).astype(np.int64))
        T = self.inputs[0][0][0] if self.inputs else self.input_shape[0]
        ids = rng.integers(1, self.vocab, size=(n, T + 1)).astype(np.int64)
        if self.kind == "lm":
            return Split(x=ids[:, :T].copy(), y=ids[:, 1:].copy())
        lengths = rng.integers(T // 2, T + 1, size=n)
        x = ids[:, :T].copy()
        x[np.arange(T)[None, :] >= lengths[:, None]] = 0  # the pad id after each length
        if self.inputs:
            x = pack_inputs([x, (x != 0).astype(np.int64)])
        return Split(x=x, y=rng.integers(0, self.classes, size=n).astype(np.int64))

    def example(self, batch: int) -> torch.Tensor:
        """A batch of inputs (random images, token ids 1..vocab-1)."""
        gen = torch.Generator().manual_seed(batch)
        if self.kind == "image":
            return torch.randn(batch, *self.input_shape, generator=gen)
        return torch.randint(1, self.vocab, (batch, *self.input_shape), generator=gen)


def _hf(name: str) -> Callable[[], nn.Module]:
    from sky_flower.pipeline.hf import hf_module

    config_class, keys = HF_CONFIGS[name]
    return lambda: hf_module(config_class, keys, task="causal-lm", seed=0)


class TwoInputClassifier(nn.Module):
    """A ``transformers`` classifier as ``(input_ids, attention_mask) -> logits``: the
    mask is a second input, as a tokenizer's batch has it."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_labels)``."""
        return self.hf(input_ids=input_ids, attention_mask=attention_mask).logits


def _bert() -> nn.Module:
    from sky_flower.pipeline.hf import hf_module

    return hf_module("BertConfig", BERT, task="sequence-classification", seed=0)


T = 8  # tokens per sample
ZOO: dict[str, ZooModel] = {
    "quickstart_cnn": ZooModel("quickstart_cnn", "image", (3, 32, 32), quickstart_net),
    "resnet18": ZooModel("resnet18", "image", (3, 32, 32), lambda: ResNet(width=8)),
    "bert_cls": ZooModel("bert_cls", "classify", (T,), _bert, classes=3),
    **{name: ZooModel(name, "lm", (T,), _hf(name)) for name in HF_CONFIGS},
}
