"""What a Sky run trains: the model, one sample's shape and dtype, and its objective
(:class:`SkyModel`), the first argument of
:class:`sky_flower.strategies.sky.SkyStrategy` (the second being the settings).

As ``torch.distributed.pipelining`` injects ``loss_fn`` into its schedule, the loss and
metric are given here, not found by the strategy; both travel to the nodes by reference
(module-level functions importable there, :func:`sky_flower.pipeline.objective.ref`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sky_flower.core.example import dtype_name
from sky_flower.pipeline.objective import LossReduction, correct_count, ref


@dataclass(frozen=True)
class SkyModel:
    """The model a Sky run trains, and how a micro-batch's loss and metric are computed.

    Attributes
    ----------
    model_fn : Callable[[], nn.Module]
        Builds the model (the same function the nodes use): an ``nn.Sequential`` or a
        module split training can cut (:mod:`sky_flower.core.profile`).
    input_shape : tuple of int
        One sample's shape, without the batch dimension (e.g. ``(64,)``).
    input_dtype : str (default: "float32")
        The input's dtype (``"int64"`` for a language model's token ids): the profile,
        the benchmark and the ``direct`` stage 0 build their probes of it.
    loss_fn : Callable (default: torch.nn.functional.cross_entropy)
        ``loss(output, labels) -> scalar tensor`` of a micro-batch, reduced as
        ``reduction`` declares.
    metric_fn : Callable (default: sky_flower.pipeline.objective.correct_count)
        ``metric(output, labels) -> int``, summed over the round as ``correct``.
    reduction : LossReduction (default: mean)
        How ``loss_fn`` reduces over a micro-batch's samples (mean, sum, or a mean over
        ``weight_fn(labels)``): each micro-batch's loss is scaled by it once so that
        split training equals the unsplit model trained on the whole batch.

    Raises
    ------
    ValueError
        If ``loss_fn``, ``metric_fn`` or the reduction's weight is not a module-level
        function the nodes can import, or ``input_dtype`` is not a torch dtype.
    """

    model_fn: Callable[[], nn.Module]
    input_shape: Sequence[int]
    input_dtype: str = "float32"
    loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy
    metric_fn: Callable[..., int] = correct_count
    reduction: LossReduction = field(default_factory=LossReduction)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", tuple(int(s) for s in self.input_shape))
        object.__setattr__(self, "input_dtype", dtype_name(self.input_dtype))
        ref(self.loss_fn), ref(self.metric_fn)  # must travel to the nodes by name
        if self.reduction.weight_fn is not None:
            ref(self.reduction.weight_fn)

    @classmethod
    def from_settings(
        cls,
        model_fn: Callable[[], nn.Module],
        input_shape: Sequence[int],
        settings: Any,  # noqa: ANN401 - sky_flower.sky.settings.SkySettings
        input_dtype: str = "float32",
    ) -> SkyModel:
        """The model with the objective ``settings.objective`` names (its loss, metric,
        reduction and weight by reference, imported here).

        Raises
        ------
        ValueError
            Naming the setting in the caller's words (``objective.loss`` or run config
            ``loss``, ...) if a reference cannot be imported, or the reduction and the
            weight do not go together.
        """
        run = settings.words == "run_config"
        loss_fn, metric_fn = settings.objective.functions(run_config=run)
        return cls(
            model_fn,
            input_shape,
            input_dtype,
            loss_fn,
            metric_fn,
            settings.objective.reduction_object(run_config=run),
        )
