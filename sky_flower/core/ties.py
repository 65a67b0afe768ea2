"""Tied weights (one parameter shared by several modules) in a model split into stages.

A tie inside one nn.Sequential entry is kept (:func:`sky_flower.pipeline.stage.build_stage`
re-ties it after materialising the stage); a tie between two entries is refused, since a
cut between them would give each stage its own copy and the copies would train apart.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """The groups of parameter names of ``module`` that are one tensor (tied weights),
    e.g. ``[["0.weight", "2.weight"]]``; empty when nothing is shared."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def refuse_ties_across_entries(layers: Sequence[nn.Module]) -> None:
    """Refuse a parameter shared by two entries: a cut between them would give each
    stage its own copy, and the copies would train apart (a tie inside one entry is
    kept: :func:`sky_flower.pipeline.stage.build_stage` re-ties it)."""
    owner: dict[int, tuple[int, str]] = {}
    for j, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), (j, name))
            if first[0] != j:
                raise ValueError(
                    f"parameters {first[0]}.{first[1]} and {j}.{name} are one tensor (tied "
                    f"weights) shared by entries {first[0]} and {j}: a cut between them "
                    "would give each stage its own copy and the copies would train apart. "
                    f"Put entries {first[0]}..{j} into one nn.Sequential entry (a tie "
                    "inside one entry is kept), or untie the weights"
                )
