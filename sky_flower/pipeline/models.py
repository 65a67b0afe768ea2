"""Models as ordered lists of layers (``nn.Sequential``), built from a config dict.

Each top-level entry of the returned ``nn.Sequential`` is one unit the partitioner can
place on a node. ``build_model`` is called on the server (profiling, initial weights,
evaluation) and on every node (to rebuild its stage), so it must be deterministic in
structure; weights always come from the server.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

MODELS = ("mlp",)


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
    model = nn.Sequential(*blocks)
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            nn.init.zeros_(module.bias)
    return model


def build_model(cfg: Mapping) -> nn.Sequential:
    """Build the model named by ``cfg["name"]`` with the remaining keys as arguments.

    Raises
    ------
    ValueError
        On an unknown model name (lists the known ones) or an unknown argument.
    """
    cfg = dict(cfg)
    name = cfg.pop("name", None)
    cfg.pop("input_shape", None)
    if name == "mlp":
        try:
            return build_mlp(**cfg)
        except TypeError as err:
            raise ValueError(f"bad model config for mlp: {err}") from err
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
