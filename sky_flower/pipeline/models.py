"""Models as ordered lists of layers (``nn.Sequential``), built from a config dict.

Each top-level entry of the returned ``nn.Sequential`` is one unit the partitioner can
place on a node: a cut falls only between entries, and what crosses a cut is the one
tensor an entry returns. ``build_model`` is called on the server (profiling, initial
weights, evaluation) and on every node (to rebuild its stage), so it must be
deterministic in structure; weights always come from the server.

A config names its builder by ``_target_`` (any importable callable returning an
``nn.Module``, called with the config's other keys, Hydra's ``instantiate``), e.g.
``conf/model/cnn_bn.yaml``. The keys in :data:`MODEL_META_KEYS` describe the model's
input and are not passed to the builder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

# the shipped configs (conf/model/<name>.yaml) and their builders
SHIPPED = {
    "mlp": "sky_flower.pipeline.models.build_mlp",
    "cnn_bn": "sky_flower.pipeline.models.build_cnn_bn",
    "resnet": "sky_flower.pipeline.models.build_resnet",
    "transformer_lm": "sky_flower.pipeline.lm.build_transformer_lm",
}
MODELS = tuple(SHIPPED)
# config keys that describe the model for the job, not arguments of its builder
MODEL_META_KEYS = ("name", "input_shape", "input_dtype", "planning_only")


def _he_init(model: nn.Module) -> nn.Module:
    """He initialisation (He et al. 2015, arXiv 1502.01852) of every Linear / Conv
    weight, biases zero (skipped on the meta device, where a stage is first built)."""
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Conv2d) and module.weight.device.type != "meta":
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


def build_mlp(
    in_features: int = 64,
    hidden_width: int = 1024,
    hidden_layers: int = 8,
    num_classes: int = 10,
) -> nn.Sequential:
    """MLP as ``hidden_layers`` blocks ``Linear + ReLU`` and one ``Linear`` head.

    Weights use He initialisation (He et al. 2015, arXiv 1502.01852), biases zero:
    PyTorch's default Linear init shrinks the signal through a deep ReLU stack and
    trains an 8-block MLP several times slower.

    Shapes: input ``(B, in_features)``, output logits ``(B, num_classes)``.
    """
    if hidden_layers < 1 or hidden_width < 1:
        raise ValueError(
            f"hidden_layers ({hidden_layers}) and hidden_width ({hidden_width}) must be >= 1"
        )
    blocks: list[nn.Module] = []
    width = in_features
    for _ in range(hidden_layers):
        blocks.append(nn.Sequential(nn.Linear(width, hidden_width), nn.ReLU()))
        width = hidden_width
    blocks.append(nn.Linear(width, num_classes))
    return _he_init(nn.Sequential(*blocks))  # type: ignore[return-value]


def build_cnn_bn(
    image_size: int = 8,
    channels: Sequence[int] = (16, 32, 64),
    hidden: int = 128,
    num_classes: int = 10,
    dropout: float = 0.25,
) -> nn.Sequential:
    """A CNN with BatchNorm and Dropout for flat ``image_size`` x ``image_size`` grey
    images (digits: 8x8, input ``(B, 64)``), output logits ``(B, num_classes)``.

    Entries: ``Unflatten + Conv-BN-ReLU`` (the first block), one ``Conv-BN-ReLU-MaxPool``
    per further channel count (halving the image), ``Flatten-Dropout-Linear-ReLU`` and a
    ``Dropout-Linear`` head: ``len(channels) + 2`` entries, each one unit of the plan.

    Raises
    ------
    ValueError
        If the poolings would shrink the image below 1 pixel or ``channels`` is empty.
    """
    if not channels:
        raise ValueError("channels must name at least one convolution's width")
    side = image_size // 2 ** (len(channels) - 1)
    if side < 1:
        raise ValueError(
            f"{len(channels) - 1} poolings shrink a {image_size}x{image_size} image below 1 "
            "pixel: use fewer channels entries"
        )
    blocks: list[nn.Module] = [
        nn.Sequential(
            nn.Unflatten(1, (1, image_size, image_size)),
            nn.Conv2d(1, channels[0], 3, padding=1),
            nn.BatchNorm2d(channels[0]),
            nn.ReLU(),
        )
    ]
    for c_in, c_out in zip(channels[:-1], channels[1:], strict=True):
        blocks.append(
            nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1),
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )
        )
    blocks.append(
        nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(channels[-1] * side * side, hidden),
            nn.ReLU(),
        )
    )
    blocks.append(nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden, num_classes)))
    return _he_init(nn.Sequential(*blocks))  # type: ignore[return-value]


class ResidualBlock(nn.Module):
    """A basic residual block (He et al. 2016, arXiv 1512.03385, Fig. 2):
    ``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``; the shortcut is a 1x1
    convolution with BatchNorm when the stride or the width changes.

    Shapes: ``(B, c_in, H, W) -> (B, c_out, H / stride, W / stride)``.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),  # the torchvision pattern: in place after a BatchNorm
            nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, c_in, H, W) -> (B, c_out, H / stride, W / stride)``."""
        return torch.relu(self.body(x) + self.shortcut(x))


def build_resnet(
    image_size: int = 8,
    widths: Sequence[int] = (16, 32, 64),
    blocks_per_width: int = 1,
    num_classes: int = 10,
) -> nn.Sequential:
    """A small residual network for flat ``image_size`` x ``image_size`` grey images
    (digits: input ``(B, 64)``), output logits ``(B, num_classes)``.

    Entries: a stem ``Unflatten-Conv-BN-ReLU``, ``blocks_per_width`` :class:`ResidualBlock`
    per width (the first of each width after the first with stride 2), and a head
    ``AdaptiveAvgPool-Flatten-Linear``. Every residual block is one entry, so its skip
    connection never crosses a cut.

    Raises
    ------
    ValueError
        If ``widths`` is empty or ``blocks_per_width`` < 1.
    """
    if not widths or blocks_per_width < 1:
        raise ValueError("widths must be non-empty and blocks_per_width >= 1")
    entries: list[nn.Module] = [
        nn.Sequential(
            nn.Unflatten(1, (1, image_size, image_size)),
            nn.Conv2d(1, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
    ]
    c_in = widths[0]
    for i, width in enumerate(widths):
        for j in range(blocks_per_width):
            entries.append(ResidualBlock(c_in, width, stride=2 if i > 0 and j == 0 else 1))
            c_in = width
    entries.append(
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))
    )
    return _he_init(nn.Sequential(*entries))  # type: ignore[return-value]


class FirstOutput(nn.Module):
    """Keeps the first element of a tuple output (e.g. ``nn.LSTM``'s ``(output, (h, c))``):
    ``nn.Sequential(nn.LSTM(...), FirstOutput())`` is one entry that returns one tensor."""

    def forward(self, x: Any) -> torch.Tensor:  # noqa: ANN401 - a tuple of tensors
        """``(t, ...) -> t``; a tensor passes unchanged."""
        return x[0] if isinstance(x, tuple | list) else x


def build_model(cfg: Mapping) -> nn.Module:
    """Build the model of config ``cfg``: ``cfg["_target_"]`` called with the config's
    other keys (:data:`MODEL_META_KEYS` excepted, but for those the builder takes by
    name: :func:`sky_flower.pipeline.graph.sequential_of` takes ``input_shape`` and
    ``input_dtype``), as Hydra's ``instantiate`` does.

    The old spelling ``{"name": "mlp", ...}`` (no ``_target_``) still builds the MLP.

    Raises
    ------
    ValueError
        Naming the key: on a config without ``_target_`` whose ``name`` is not ``mlp``,
        on a ``name`` that contradicts a shipped ``_target_`` (``model.name=cnn_bn`` on
        the MLP's config: choose a model with ``model=<name>``), on a ``_target_`` that
        cannot be imported or called with the given arguments, or one that returns no
        ``nn.Module`` or an ``nn.Module`` that is no ``nn.Sequential`` (naming
        :func:`sky_flower.pipeline.graph.sequential_of`, which converts it).
    """
    cfg = dict(cfg)
    name, target = cfg.get("name"), cfg.pop("_target_", None)
    if target is None:
        if name != "mlp":
            raise ValueError(
                f"unknown model {name!r}: choose a model with model=<name> (one of "
                f"{', '.join(MODELS)}) or give your own builder as model._target_="
                "<module.function>"
            )
        target = SHIPPED["mlp"]
    elif name is not None and target in SHIPPED.values() and SHIPPED.get(name) != target:
        choice = name if name in SHIPPED else f"<one of {', '.join(MODELS)}>"
        raise ValueError(
            f"model.name={name} does not choose the model (model._target_ is {target}; "
            f"name is a label): write model={choice}, or model._target_=<module.function> "
            "for your own"
        )
    wants = _meta_keys_taken(target)
    kwargs = {k: v for k, v in cfg.items() if k not in MODEL_META_KEYS or k in wants}
    model = call_target("model", target, kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model._target_={target} returned {type(model).__name__}, not an nn.Module"
        )
    if not isinstance(model, nn.Sequential):
        raise ValueError(not_sequential_message(f"model._target_={target}", model))
    return without_inplace_entries(model)


def not_sequential_message(what: str, model: nn.Module) -> str:
    """Why a model that is no ``nn.Sequential`` is refused, and how to convert it with
    :func:`sky_flower.pipeline.graph.sequential_of` (in a config and in Python)."""
    name = type(model).__name__
    where = f"{type(model).__module__}.{name}"
    return (
        f"{what} gave a {name}, an nn.Module that is not an nn.Sequential: split training "
        "cuts a model only between the entries of an nn.Sequential. Convert it with "
        "sky_flower.pipeline.graph.sequential_of, which traces it (torch.export) into "
        "units cut at its submodules: in a model config, "
        "`_target_: sky_flower.pipeline.graph.sequential_of`, "
        f"`module: {{_target_: {where}, <its arguments>}}`, `input_shape: [<one sample's "
        "shape>]`, `input_dtype: int64` for token ids (optional `split_points: [<submodule "
        "names>]`); in Python (a Flower app), model_fn=sequential_fn(" + name + ", "
        "input_shape) from sky_flower.pipeline.graph; conf/model/llama_lm.yaml is an example"
    )


def _meta_keys_taken(target: Any) -> set[str]:  # noqa: ANN401 - a target name
    """The keys of :data:`MODEL_META_KEYS` that the builder ``target`` takes as
    arguments (:func:`sky_flower.pipeline.graph.sequential_of` takes ``input_shape``
    and ``input_dtype``); none if it cannot be imported (:func:`call_target` says so)."""
    import inspect

    from hydra.utils import get_object

    try:
        params = inspect.signature(get_object(str(target))).parameters
    except Exception:  # noqa: BLE001 - call_target reports an unimportable target
        return set()
    return {k for k in MODEL_META_KEYS if k in params}


def without_inplace_entries(model: nn.Module) -> nn.Module:
    """``model`` with ``inplace=False`` on every top-level entry that has an ``inplace``
    flag (``nn.ReLU(inplace=True)`` after a BatchNorm entry, the torchvision pattern).

    A cut may fall before any entry, and there the entry's input is the activation the
    stage received, which autograd may not modify in place; out of place the entry
    computes the same function. Entries inside a block are left as they are (their input
    is the block's own intermediate). Returns ``model`` itself (changed in place).
    """
    if isinstance(model, nn.Sequential):
        for entry in model:
            if getattr(entry, "inplace", False) is True:
                entry.inplace = False  # type: ignore[assignment]
    return model


def call_target(group: str, target: str, kwargs: Mapping[str, Any]) -> Any:  # noqa: ANN401
    """``target(**kwargs)`` through Hydra (``hydra.utils.instantiate``: nested
    ``_target_`` entries are built too; lists arrive as lists).

    Raises
    ------
    ValueError
        Naming ``<group>._target_``, if ``target`` is not a string, cannot be imported,
        or fails on these arguments (the builder's own error is the cause).
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"{group}._target_ must be an importable name, got {target!r}")
    try:
        return instantiate({"_target_": target, **kwargs}, _convert_="all")
    except InstantiationException as err:
        why = str(err).replace(", set env var HYDRA_FULL_ERROR=1 to see chained exception", "")
        why = " ".join(why.split())  # one line
        raise ValueError(f"{group}._target_={target}: {why}") from err
    except (TypeError, ValueError, ImportError, AttributeError) as err:
        raise ValueError(f"{group}._target_={target} failed: {err}") from err
