"""Models as Flower users bring them, for the conversion tests (tests/test_user_models.py)
and the benchmark (python -m sky_flower.bench.models imports the same builders from
sky_flower.bench.zoo): Flower's quickstart CNN, a torchvision-style ResNet, a BERT
classifier with its attention mask and default dropout, and tiny random
``transformers`` decoders (nothing downloaded)."""

from __future__ import annotations

import copy
from functools import cache

import torch
from torch import nn

from sky_flower.bench.zoo import BERT, T, TwoInputClassifier, ZooModel
from sky_flower.bench.zoo import ZOO as _ZOO
from sky_flower.pipeline.data import Split
from sky_flower.pipeline.graph import as_sequential, sequential_of
from sky_flower.pipeline.hf import hf_module


def _bert_two_inputs() -> nn.Module:
    return TwoInputClassifier(hf_module("BertConfig", BERT, task="sequence-classification").hf)


# the zoo, and BERT taking its attention mask as a second input (packed with the ids)
ZOO = {
    **_ZOO,
    "bert_2in": ZooModel(
        "bert_2in",
        "classify",
        (2 * T,),
        _bert_two_inputs,
        classes=3,
        inputs=(((T,), "int64"), ((T,), "int64")),
    ),
}

__all__ = ["ZOO", "ZooModel", "converted", "data_for", "example", "user_module"]


def user_module(name: str) -> nn.Module:
    """A fresh copy of zoo model ``name`` (seeded: the same weights every call)."""
    return ZOO[name].build()


@cache
def _converted(name: str) -> nn.Sequential:
    model = ZOO[name]
    if model.inputs:
        inputs = [{"shape": list(shape), "dtype": dtype} for shape, dtype in model.inputs]
        return sequential_of(user_module(name), model.input_shape, model.input_dtype, inputs=inputs)
    return as_sequential(user_module(name), model.example(2))


def converted(name: str) -> nn.Sequential:
    """A fresh copy of ``name`` converted (traced once per process and name)."""
    return copy.deepcopy(_converted(name))


def data_for(name: str, n: int = 64, seed: int = 0) -> Split:
    """``n`` samples of synthetic data in ``name``'s input format
    (:meth:`sky_flower.bench.zoo.ZooModel.data`)."""
    return ZOO[name].data(n, seed)


def example(name: str) -> torch.Tensor:
    """A batch of 4 of ``name``'s inputs (for the composition tests)."""
    data = data_for(name, 4, seed=1)
    return torch.from_numpy(data.x)
