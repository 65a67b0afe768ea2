"""Any ``nn.Module`` as an ``nn.Sequential`` of stage units, cut at module boundaries
with PyTorch's own machinery.

:func:`as_sequential` traces the model with ``torch.distributed.pipelining.pipeline``
(``torch.export`` underneath; GPipe's split API, Huang et al. 2019, arXiv 1811.06965),
placing a ``SplitPoint.BEGINNING`` before each named submodule, and returns the
resulting stage graph modules as the entries of an ``nn.Sequential``: each entry then
is one unit the partitioner may place on a node, and every boundary between entries
carries exactly one tensor.

A boundary that would carry several values (a skip connection crossing the cut, a
tuple) is merged away: its split point is dropped and the two units become one. So is
every boundary between two units that would share a parameter (a tied embedding and
head): pipelining would otherwise replicate the parameter and train two copies.

What the tracer cannot do here, refused with a message: ``torch.export`` fixes the
train/eval mode at trace time, so a model whose forward depends on it (dropout with
``p > 0``, BatchNorm, InstanceNorm with running statistics) would keep training-mode
behaviour under ``model.eval()``; build such a model as an ``nn.Sequential`` of its
blocks instead (the simple path). Data-dependent control flow fails the trace itself.

The converted model's parameter and buffer names are the original's prefixed by the
unit index (``"2.blocks.q.weight"`` for ``"blocks.q.weight"``):
:func:`original_state_dict` maps a trained converted model's state dict back, so it
loads into the user's own module.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

MODE_DEPENDENT = (
    nn.modules.dropout._DropoutNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)
_MAX_TRACES = 4


def _check_modes(module: nn.Module) -> None:
    """Refuse layers whose forward depends on train/eval mode (see the module docstring)."""
    for name, sub in module.named_modules():
        if not isinstance(sub, MODE_DEPENDENT):
            continue
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p == 0:
            continue
        if isinstance(sub, nn.modules.instancenorm._InstanceNorm) and not sub.track_running_stats:
            continue
        raise ValueError(
            f"{name} ({type(sub).__name__}) behaves differently in train and eval mode, and "
            "torch.export (which torch.distributed.pipelining traces with) fixes the mode at "
            "trace time: model.eval() would not switch it. Build this model as an "
            "nn.Sequential of its blocks instead (each block a top-level entry), or set "
            "dropout to 0"
        )


def _call_order(module: nn.Module, example: torch.Tensor) -> list[str]:
    """Names of ``module``'s submodules in the order a forward on ``example`` first calls
    them (a container that is never called itself, e.g. an ``nn.ModuleDict``, is absent)."""
    order: list[str] = []
    hooks = [
        sub.register_forward_pre_hook(lambda m, a, n=name: order.append(n))
        for name, sub in module.named_modules()
        if name
    ]
    try:
        with torch.no_grad():
            module(example)
    finally:
        for h in hooks:
            h.remove()
    return list(dict.fromkeys(order))


def default_split_points(module: nn.Module, called: Sequence[str]) -> list[str]:
    """Every top-level child that the forward calls; a child it does not call (a
    container such as ``nn.ModuleDict``) stands for its own children, recursively."""
    points: list[str] = []

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, _ in parent.named_children():
            full = f"{prefix}{name}"
            if full in called:
                points.append(full)
            else:
                visit(f"{full}.", getattr(parent, name))

    visit("", module)
    return points


def _ordered_points(
    module: nn.Module, example: torch.Tensor, split_points: Sequence[str] | None
) -> list[str]:
    """The split points in execution order (default: :func:`default_split_points` but
    the first one called).

    Raises
    ------
    ValueError
        If a name is no submodule, or is not called by the forward.
    """
    called = _call_order(module, example)
    if split_points is None:
        points = set(default_split_points(module, called))
        return [n for n in called if n in points][1:]
    subs = dict(module.named_modules())
    unknown = [n for n in split_points if n not in subs or not n]
    if unknown:
        raise ValueError(f"split points {unknown} are not submodules of {type(module).__name__}")
    missing = [n for n in split_points if n not in called]
    if missing:
        raise ValueError(f"split points {missing} are never called by the model's forward")
    return [n for n in called if n in set(split_points)]


def _stage_of(node: fx.Node) -> int:
    """Stage index of a node of the pipe's root graph (-1: the model's input)."""
    if node.op == "placeholder":
        return -1
    if node.op == "call_module":
        return int(str(node.target).rsplit("_", 1)[1])
    return _stage_of(node.args[0])  # operator.getitem of a stage's tuple output


def bad_boundaries(pipe: Any) -> dict[int, str]:  # noqa: ANN401 - a pipelining Pipe
    """Boundaries of a traced ``Pipe`` that cannot be cut: ``{b: why}``, ``b`` being the
    boundary between stage ``b`` and stage ``b + 1``.

    A boundary is bad if other than exactly one value (the previous stage's whole
    output) crosses it, or if the stages on either side share a parameter.
    """
    graph = pipe.split_gm.graph
    S = pipe.num_stages
    nodes = [n for n in graph.nodes if n.op != "output"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    bad: dict[int, str] = {}
    for b in range(S - 1):
        crossing = [
            n
            for n in nodes
            if _stage_of(n) <= b and any(u is out_node or _stage_of(u) > b for u in n.users)
        ]
        if len(crossing) != 1 or crossing[0].op != "call_module":
            names = ", ".join(str(n.name) for n in crossing)
            bad[b] = f"{len(crossing)} values cross it ({names})"
    for uses in pipe.replicated_params:
        stages = sorted(int(s.rsplit("_", 1)[1]) for s in uses)
        for b in range(stages[0], stages[-1]):
            bad.setdefault(b, f"parameter {next(iter(uses.values()))} is used on both sides")
    return bad


def _trace(module: nn.Module, example: torch.Tensor, points: Sequence[str]) -> Any:  # noqa: ANN401
    """``torch.distributed.pipelining.pipeline`` of a copy of ``module`` cut before
    each of ``points``."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = copy.deepcopy(module).train()
    spec = {p: SplitPoint.BEGINNING for p in points}
    example = example.detach().clone()
    # a dynamic batch dimension: else torch.export bakes the example's batch size into
    # every reshape, and the units fail (or mix samples) on another batch size
    torch._dynamo.mark_dynamic(example, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's pytree deprecations
        try:
            return pipeline(model, (example,), split_spec=spec or None)
        except RuntimeError as err:
            raise ValueError(f"torch.export cannot trace {type(module).__name__}: {err}") from err


def as_sequential(
    module: nn.Module, example_input: torch.Tensor, split_points: Sequence[str] | None = None
) -> nn.Sequential:
    """``module`` as an ``nn.Sequential`` of units cut at module boundaries.

    Parameters
    ----------
    module : nn.Module
        Any module whose forward takes one tensor and returns one tensor (an
        ``nn.Sequential`` needs no conversion: it already is one).
    example_input : torch.Tensor, shape (B, ...)
        An input of the model (e.g. :func:`sky_flower.pipeline.example.example_input`),
        ``B >= 2``; its values do not matter, its shape and dtype do. The batch
        dimension is traced as dynamic: the units take any batch size.
    split_points : sequence of str, optional
        Submodule names (``named_modules`` keys); a cut is placed before each. Default:
        every top-level child but the one called first (a child the forward never calls,
        e.g. an ``nn.ModuleDict``, stands for its children).

    Returns
    -------
    nn.Sequential
        Units in execution order; their composition equals ``module``'s forward (same
        outputs and gradients), each boundary carries exactly one tensor. Cuts that
        would carry several values or split a shared parameter are merged away, so
        there may be fewer units than split points + 1.

    Raises
    ------
    ValueError
        On a train/eval-dependent layer (named), a split point that is no submodule or
        never called, a model that does not take one tensor and return one tensor, or a
        forward torch.export cannot trace.
    """
    _check_modes(module)
    if example_input.dim() < 1 or example_input.shape[0] < 2:
        raise ValueError(
            f"example_input of shape {tuple(example_input.shape)}: give a batch of at least 2 "
            "samples (torch.export specializes a batch dimension of 1)"
        )
    points = _ordered_points(module, example_input, split_points)
    for _ in range(_MAX_TRACES):
        pipe = _trace(module, example_input, points)
        if pipe.num_stages != len(points) + 1:
            raise ValueError(
                f"the split points {points} gave {pipe.num_stages} stages, not "
                f"{len(points) + 1}: a split point called more than once?"
            )
        _check_io(pipe)
        bad = bad_boundaries(pipe)
        if not bad:
            break
        points = [p for b, p in enumerate(points) if b not in bad]
    else:  # pragma: no cover - one retrace removes every bad boundary
        raise ValueError(f"could not cut {type(module).__name__} at {points}: {bad}")
    seq = nn.Sequential(*[pipe.get_stage_module(i) for i in range(pipe.num_stages)])
    _check_eval_mode(module, seq, example_input)
    return seq


def _check_eval_mode(module: nn.Module, seq: nn.Sequential, example: torch.Tensor) -> None:
    """Refuse a conversion whose eval-mode output differs from the model's: its forward
    depends on the mode in a way :func:`_check_modes` cannot see (e.g. a functional
    dropout), which the trace fixed to training mode."""
    if example.device.type == "meta":
        return
    with torch.no_grad():
        want = copy.deepcopy(module).eval()(example)
        got = copy.deepcopy(seq).eval()(example)
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise ValueError(
            f"the traced {type(module).__name__} differs from the model in eval mode (max "
            f"difference {float((got - want).abs().max()):.3g}): its forward depends on "
            "self.training (e.g. a functional dropout), which torch.export fixes at trace "
            "time. Build it as an nn.Sequential of its blocks instead"
        )


def _check_io(pipe: Any) -> None:  # noqa: ANN401 - a pipelining Pipe
    """Refuse a model that does not take one tensor and return one tensor."""
    graph = pipe.split_gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    if len(inputs) != 1 or len(out) != 1:
        raise ValueError(
            f"the model takes {len(inputs)} inputs and returns {len(out)} values: a split "
            "model must take one tensor and return one tensor"
        )


def original_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """A converted model's state dict (:func:`as_sequential`) keyed as the original's.

    Parameters
    ----------
    state : mapping
        ``"<unit>.<original name>" -> tensor`` (the converted ``nn.Sequential``'s
        ``state_dict()``, or a merge of its stages').

    Returns
    -------
    dict
        ``"<original name>" -> tensor``: ``module.load_state_dict(...)`` loads it into
        the user's own module.

    Raises
    ------
    ValueError
        If two units hold the same original name (cannot happen for a model converted by
        :func:`as_sequential`, whose units never share a parameter).
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = key.split(".", 1)[1]
        if name in out:
            raise ValueError(f"{name!r} is held by two units")
        out[name] = value
    return out


def sequential_of(
    module: nn.Module,
    input_shape: Sequence[int],
    input_dtype: str = "float32",
    split_points: Sequence[str] | None = None,
) -> nn.Sequential:
    """:func:`as_sequential` on a synthetic input of one sample's ``input_shape`` (a
    Hydra ``_target_`` for a user's own module: ``module`` is instantiated first).

    Each call traces the model (about a second for a small one): build it once per
    process where you can.

    Raises
    ------
    ValueError
        As :func:`as_sequential`.
    """
    from sky_flower.pipeline.example import example_input

    return as_sequential(module, example_input(2, input_shape, input_dtype), split_points)
