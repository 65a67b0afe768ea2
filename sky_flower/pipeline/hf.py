"""Hugging Face ``transformers`` models as a model source (the optional extra
``sky-flower[hf]``).

:func:`hf_sequential` builds a model from a ``transformers`` config class and its keys
(random weights, seeded: nothing is downloaded) or from a local ``save_pretrained``
directory (its weights), wraps it so that it takes one tensor of token ids and returns
one tensor of logits, and converts it with
:func:`sky_flower.pipeline.graph.sequential_of`: cut before every layer the model
declares whole (``_no_split_modules``, e.g. ``LlamaDecoderLayer``) and before the
modules after the last one (final norm, head), its dropouts, rotary tables, causal and
attention masks as the model has them. :func:`pretrained_state_dict` gives a trained
converted model's weights back under the ``transformers`` model's own keys, so that
``save_pretrained`` / ``from_pretrained`` round-trip.

Two tasks:

* ``causal-lm``: ``(B, T)`` int64 token ids -> ``(B, T, vocab)`` logits
  (``model(input_ids=ids, use_cache=False).logits``); train with ``task=lm``.
* ``sequence-classification``: ``(B, T)`` token ids, ``pad_token_id`` marking padding
  -> ``(B, num_labels)`` logits; the attention mask ``ids != pad_token_id`` is computed
  from the ids and crosses every cut beside the hidden states.

A model whose head is tied to its embedding (``tie_word_embeddings``, the default of
GPT-2, OPT, Gemma) is one unit: set ``tie_word_embeddings: false`` to cut it.
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

TASKS = ("causal-lm", "sequence-classification")
PREFIX = "hf."  # the wrapper's attribute holding the transformers model


def _transformers() -> Any:  # noqa: ANN401 - the module
    """``transformers``, or an error saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as err:  # pragma: no cover - the test set-up installs it
        raise ImportError(
            "Hugging Face models need transformers: pip install 'sky-flower[hf]'"
        ) from err


class CausalLM(nn.Module):
    """A ``transformers`` causal LM as ``ids (B, T) int64 -> logits (B, T, vocab)``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of every position (no key/value cache: training)."""
        return self.hf(input_ids=ids, use_cache=False).logits


class SequenceClassifier(nn.Module):
    """A ``transformers`` sequence classifier as ``ids (B, T) int64 -> logits (B,
    num_labels)``, attending to the positions whose id is not ``pad_token_id``."""

    def __init__(self, hf: nn.Module, pad_token_id: int) -> None:
        super().__init__()
        self.hf, self.pad_token_id = hf, int(pad_token_id)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of the classes."""
        mask = (ids != self.pad_token_id).long()
        return self.hf(input_ids=ids, attention_mask=mask).logits


class Logits(nn.Module):
    """A ``transformers`` model as a Flower app calls it, ``model(**batch).logits``:
    ``forward(*inputs)`` takes the tensors named ``input_names`` (``input_ids``,
    ``attention_mask``, ...) in that order and returns the logits."""

    module_prefix = PREFIX  # its state-dict keys are the model's under "hf."

    def __init__(self, hf: nn.Module, input_names: Sequence[str]) -> None:
        super().__init__()
        self.hf, self.input_names = hf, tuple(input_names)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The model's ``logits`` for the named inputs."""
        return self.hf(**dict(zip(self.input_names, inputs, strict=True))).logits


def hf_model_fn(
    factory: Callable[[], nn.Module],
    input_names: Sequence[str],
    seq_len: int,
    split_points: Sequence[str] | None = None,
) -> Callable[[], nn.Sequential]:
    """A ``model_fn`` for :func:`sky_flower.app.register_sky_client` and
    :func:`sky_flower.app.sky_strategy` from a Flower app's own ``transformers`` model
    (``factory``: ``get_model`` of Flower's quickstart-huggingface, e.g.
    ``AutoModelForSequenceClassification.from_pretrained(local_dir)``), called with the
    batch's ``input_names`` (``input_ids``, ``attention_mask``; the data owner's
    ``input_keys``) of ``seq_len`` int64 tokens each (shorter batches are padded up to
    it), returning its ``logits``: :class:`Logits` converted by
    :func:`sky_flower.pipeline.graph.sequential_fn` (traced once per process). The
    strategy takes and gives the model's own state-dict keys
    (``ArrayRecord(get_model(...).state_dict())``).

    Raises
    ------
    ValueError
        As :func:`sky_flower.pipeline.graph.sequential_of` (on the first call).
    """
    from sky_flower.pipeline.graph import sequential_fn

    n = len(input_names)
    inputs = [{"shape": [int(seq_len)], "dtype": "int64"}] * n
    return sequential_fn(
        lambda: Logits(factory(), input_names), [n * int(seq_len)], "int64", split_points, inputs
    )


def hf_module(
    config_class: str | None = None,
    config: Mapping[str, Any] | None = None,
    pretrained: str | None = None,
    task: str = "causal-lm",
    seed: int = 0,
    attn_implementation: str = "eager",
) -> nn.Module:
    """The wrapped ``transformers`` model (not yet converted).

    Parameters
    ----------
    config_class : str, optional
        A ``transformers`` config class name (``"LlamaConfig"``); with ``config``, its
        keys. The weights are drawn from the model's own init, seeded by ``seed``.
    pretrained : str, optional
        Instead: a local directory written by ``save_pretrained`` (its config and
        weights; ``config`` keys override the config's).
    task : {"causal-lm", "sequence-classification"}
    attn_implementation : str
        ``"eager"`` (default; traced on every family) or ``"sdpa"``.

    Raises
    ------
    ValueError
        On an unknown task or config class, neither or both of ``config_class`` and
        ``pretrained``, or a ``pretrained`` path that is no directory.
    """
    tf = _transformers()
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
    if (config_class is None) == (pretrained is None):
        raise ValueError("give model.config_class (with model.config) or model.pretrained")
    auto = {
        "causal-lm": tf.AutoModelForCausalLM,
        "sequence-classification": tf.AutoModelForSequenceClassification,
    }[task]
    keys = dict(config or {})
    if pretrained is not None:
        path = Path(pretrained)
        if not path.is_dir():
            raise ValueError(
                f"model.pretrained={pretrained} is no directory: give a local directory "
                "written by save_pretrained (nothing is downloaded)"
            )
        cfg = tf.AutoConfig.from_pretrained(path, local_files_only=True, **keys)
        hf = auto.from_pretrained(
            path, config=cfg, local_files_only=True, attn_implementation=attn_implementation
        )
    else:
        cls = getattr(tf, str(config_class), None)
        if not (isinstance(cls, type) and issubclass(cls, tf.PretrainedConfig)):
            raise ValueError(
                f"model.config_class={config_class} is no transformers config class "
                "(e.g. LlamaConfig, BertConfig)"
            )
        cfg = cls(**keys)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hf = auto.from_config(cfg, attn_implementation=attn_implementation)
    if task == "causal-lm":
        return CausalLM(hf)
    pad = hf.config.pad_token_id
    return SequenceClassifier(hf, 0 if pad is None else pad)


def hf_sequential(
    input_shape: Sequence[int] | None = None,
    input_dtype: str = "int64",
    split_points: Sequence[str] | None = None,
    seq_len: int | None = None,
    **kwargs: Any,  # noqa: ANN401 - hf_module's keys
) -> nn.Sequential:
    """:func:`hf_module` converted by :func:`sky_flower.pipeline.graph.sequential_of`
    (``input_shape``: one sample's, ``[T]``, default ``[seq_len]``); a Hydra
    ``_target_`` (``conf/model/hf.yaml``).

    Raises
    ------
    ValueError
        As :func:`hf_module` and :func:`sky_flower.pipeline.graph.sequential_of`, or
        when neither ``input_shape`` nor ``seq_len`` is given.
    """
    from sky_flower.pipeline.graph import sequential_of

    if input_shape is None:
        if seq_len is None:
            raise ValueError("give model.input_shape ([T]) or model.seq_len")
        input_shape = [int(seq_len)]
    # the same arguments give the same model: a node that builds it for every message
    # traces it once per process (a copy each call; a checkpoint by its files' times)
    key = _cache_key([list(input_shape), input_dtype, split_points], kwargs)
    if key not in _CONVERTED:
        module = hf_module(**kwargs)
        _CONVERTED[key] = sequential_of(module, input_shape, input_dtype, split_points)
    return copy.deepcopy(_CONVERTED[key])


_CONVERTED: dict[str, nn.Sequential] = {}


def _cache_key(conversion: list, kwargs: Mapping[str, Any]) -> str:
    """The conversion's arguments, :func:`hf_module`'s ``kwargs`` (and a checkpoint
    directory's file times) and the default device, as a key."""
    stamp = None
    if kwargs.get("pretrained") and Path(kwargs["pretrained"]).is_dir():
        stamp = sorted((f.name, f.stat().st_mtime_ns) for f in Path(kwargs["pretrained"]).iterdir())
    parts = [conversion, dict(kwargs), stamp, str(torch.get_default_device())]
    return json.dumps(parts, sort_keys=True, default=str)


def pretrained_state_dict(
    state: Mapping[str, Any], like: nn.Module | None = None
) -> dict[str, Any]:
    """A trained converted model's state dict under the ``transformers`` model's own
    keys (``model.layers.0.self_attn.q_proj.weight``): load it with
    ``load_state_dict`` into the model, then ``save_pretrained``.

    Parameters
    ----------
    state : mapping
        The converted ``nn.Sequential``'s state dict (or the strategy's global arrays).
    like : nn.Module, optional
        The ``transformers`` model: the result has exactly its keys.

    Raises
    ------
    ValueError
        As :func:`sky_flower.pipeline.graph.original_state_dict`.
    """
    from sky_flower.pipeline.graph import original_state_dict

    wrapped = original_state_dict(state)
    out = {k.removeprefix(PREFIX): v for k, v in wrapped.items() if k.startswith(PREFIX)}
    if like is None:
        return out
    return original_state_dict({f"0.{k}": v for k, v in out.items()}, like=like)
