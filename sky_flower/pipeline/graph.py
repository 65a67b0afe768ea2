"""Any ``nn.Module`` as an ``nn.Sequential`` of stage units, cut at module boundaries
with PyTorch's own machinery.

:func:`as_sequential` traces the model with ``torch.distributed.pipelining.pipeline``
(``torch.export`` underneath; GPipe's split API, Huang et al. 2019, arXiv 1811.06965),
placing a ``SplitPoint.BEGINNING`` before each named submodule, and returns the
resulting stage graph modules as the entries of an ``nn.Sequential``: each entry then
is one unit the partitioner may place on a node, and every boundary between entries
carries exactly one tensor.

What the root module feeds into every block without computing it from the input
(buffers such as rotary tables, tensors made from them and from constants, a dynamic
batch size a reshape reads) is computed again in every stage that reads it
(:func:`replicate_shared_inputs`), its buffers copied into each such stage: it crosses
no cut, so a Llama-style model is cut between any two blocks.

A boundary that would still carry several values (a skip connection crossing the cut,
a tuple) is merged away: its split point is dropped and the two units become one. So
is every boundary between two units that would share a trainable parameter (a head
tied to the embedding), with a warning naming it: pipelining would otherwise replicate
the parameter and train two copies apart.

What the tracer cannot do here, refused with a message: ``torch.export`` fixes the
train/eval mode at trace time, so a model whose forward depends on it (dropout with
``p > 0``, BatchNorm, InstanceNorm with running statistics) would keep training-mode
behaviour under ``model.eval()``; build such a model as an ``nn.Sequential`` of its
blocks instead (the simple path). Data-dependent control flow fails the trace itself.

The converted model's parameter and buffer names are the original's prefixed by the
unit index (``"2.blocks.q.weight"`` for ``"blocks.q.weight"``; a buffer copied into
several units under each of their indices, persistent in each so that the server ships
it with the stage): :func:`original_state_dict` maps a trained converted model's state
dict back to exactly the keys of the user's own module (replicas as one key,
non-persistent buffers dropped), so ``load_state_dict(strict=True)`` loads it.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Mapping, Sequence
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


def _is_split(node: fx.Node) -> bool:
    """Whether ``node`` is a split marker of the traced graph."""
    from torch.distributed.pipelining._IR import aten_pipe_split_alias

    return node.op == "call_function" and node.target is aten_pipe_split_alias


def _pure(node: fx.Node) -> bool:
    """Whether a ``call_function`` node may be computed again elsewhere with the same
    result: no mutation, no random draw (an aten op's schema and tags say so; a Python
    operator on sizes is pure)."""
    if node.op != "call_function" or _is_split(node):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:  # operator.mul on SymInts, getitem, ...
        return getattr(node.target, "__module__", "") in {"_operator", "operator"}
    if node.target is torch.ops.aten.detach_.default:  # changes no value (a lifted
        return True  # constant, torch.tensor(...) in a forward, is traced as copy + detach_)
    tags = getattr(node.target, "tags", ())
    return not schema.is_mutable and torch.Tag.nondeterministic_seeded not in tags


def _size_symbol(node: fx.Node) -> Any:  # noqa: ANN401 - a sympy expression
    """The symbol of a ``sym_size.int`` node's value (a dynamic dimension), else None."""
    val = node.meta.get("val")
    if node.target is not torch.ops.aten.sym_size.int or not isinstance(val, torch.SymInt):
        return None
    expr = val.node.expr
    return expr if expr.is_Symbol else None


def replicate_shared_inputs(gm: fx.GraphModule) -> fx.GraphModule:
    """Recompute, in every stage that reads it, each value that does not depend on the
    model's input: a tensor computed from buffers and constants only (rotary tables a
    root module slices and hands to every block, a mask) and a dynamic size (the batch
    size a reshape reads). A split policy for ``torch.distributed.pipelining``: the
    traced graph with its split markers in, the same graph out.

    Without it such a value is computed once, before the first split point that needs
    it, and crosses every later cut beside the activation: the cut then carries several
    values and :func:`as_sequential` merges it away. Computed again where it is read,
    it crosses no cut; the buffers it is made of are copied into every stage that reads
    them (pipelining replicates a ``get_attr`` used by several stages). The values are
    the same functions of the same tensors, so the outputs and gradients are unchanged.
    A size is read again from the dimension of the stage's input that has the same
    symbol; one no input of that stage carries stays a crossing value.
    """
    graph = gm.graph
    part: dict[fx.Node, int] = {}
    p = 0
    for node in graph.nodes:
        p += _is_split(node)
        part[node] = p
    free: set[fx.Node] = set()  # computed from buffers, constants and sizes only
    for node in graph.nodes:
        if node.op == "get_attr":
            free.add(node)
        elif _size_symbol(node) is not None:
            free.add(node)
        elif _pure(node) and all(i in free for i in node.all_input_nodes):
            free.add(node)
    clones: dict[tuple[fx.Node, int], fx.Node] = {}

    def crossing_inputs(q: int, before: fx.Node) -> list[fx.Node]:
        """Values defined before stage ``q`` and read in it up to ``before`` (included)."""
        seen: list[fx.Node] = []
        for n in graph.nodes:
            if part[n] == q:
                seen += [i for i in n.all_input_nodes if part[i] < q and i not in free]
            if n is before:
                break
        return list(dict.fromkeys(seen))

    def clone(node: fx.Node, q: int, before: fx.Node) -> fx.Node | None:
        """``node`` computed again in stage ``q``, inserted before ``before``."""
        if node.op == "get_attr" or part[node] == q:
            return node
        if (node, q) in clones:
            return clones[(node, q)]
        symbol = _size_symbol(node)
        if symbol is not None:
            copy_ = None
            for t in crossing_inputs(q, before):
                val = t.meta.get("val")
                dims = [
                    d
                    for d, s in enumerate(getattr(val, "shape", ()))
                    if isinstance(s, torch.SymInt) and s.node.expr == symbol
                ]
                if dims:
                    with graph.inserting_before(before):
                        copy_ = graph.call_function(node.target, (t, dims[0]))
                    break
            if copy_ is None:
                return None
        else:
            args = {}
            for i in node.all_input_nodes:
                got = clone(i, q, before)
                if got is None:
                    return None
                args[i] = got
            with graph.inserting_before(before):
                copy_ = graph.node_copy(node, lambda i: args[i])
        copy_.meta = {**node.meta, "nn_module_stack": before.meta.get("nn_module_stack", {})}
        part[copy_] = q
        clones[(node, q)] = copy_
        return copy_

    for node in list(graph.nodes):
        if node not in free or node.op == "get_attr":
            continue
        for user in list(node.users):
            q = part[user]
            if q == part[node]:
                continue
            first = next(u for u in graph.nodes if u in node.users and part[u] == q)
            got = clone(node, q, first)
            if got is not None:
                user.replace_input_with(node, got)
    for node in reversed(list(graph.nodes)):  # what no stage reads any more
        if node in free and node.op != "get_attr" and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _trace(module: nn.Module, example: torch.Tensor, points: Sequence[str]) -> Any:  # noqa: ANN401
    """``torch.distributed.pipelining`` 's ``Pipe`` of a copy of ``module`` cut before
    each of ``points``, what no cut needs to carry computed in each stage
    (:func:`replicate_shared_inputs`)."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import Pipe, annotate_split_points

    model = copy.deepcopy(module).train()
    annotate_split_points(model, {p: SplitPoint.BEGINNING for p in points})
    example = example.detach().clone()
    # a dynamic batch dimension: else torch.export bakes the example's batch size into
    # every reshape, and the units fail (or mix samples) on another batch size
    torch._dynamo.mark_dynamic(example, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's pytree deprecations
        try:
            return Pipe.from_tracing(model, (example,), split_policy=replicate_shared_inputs)
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
        An input of the model (e.g. :func:`sky_flower.core.example.example_input`),
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
        outputs and gradients), each boundary carries exactly one tensor. Buffers and
        values computed from them alone are computed in every unit that reads them;
        cuts that would still carry several values or split a shared trainable
        parameter are merged away (the latter with a warning naming it), so there may
        be fewer units than split points + 1.

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
        _warn_ties(module, pipe, points, bad)
        points = [p for b, p in enumerate(points) if b not in bad]
    else:  # pragma: no cover - one retrace removes every bad boundary
        raise ValueError(f"could not cut {type(module).__name__} at {points}: {bad}")
    seq = nn.Sequential(*[pipe.get_stage_module(i) for i in range(pipe.num_stages)])
    _check_eval_mode(module, seq, example_input)
    return seq


def _warn_ties(
    module: nn.Module,
    pipe: Any,  # noqa: ANN401 - a pipelining Pipe
    points: Sequence[str],
    bad: Mapping[int, str],
) -> None:
    """Warn, naming the parameter and the split points dropped, when a parameter read
    by several stages (a head tied to the embedding) merges the units between them."""
    for uses in pipe.replicated_params:
        stages = sorted(int(s.rsplit("_", 1)[1]) for s in uses)
        lost = [points[b] for b in range(stages[0], stages[-1]) if b in bad]
        if lost:
            names = " and ".join(sorted(set(uses.values())))
            warnings.warn(
                f"{type(module).__name__}: {names} are one trainable parameter read by "
                f"stages {stages[0]} and {stages[-1]}; split training cannot keep copies "
                "of a trainable parameter equal across stages, so everything between "
                f"them is one unit (no cut before {', '.join(lost)}). Untie the weights "
                "(give the head its own parameter) to cut there",
                stacklevel=3,
            )


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


def original_state_dict(
    state: Mapping[str, Any], like: nn.Module | Iterable[str] | None = None
) -> dict[str, Any]:
    """A converted model's state dict (:func:`as_sequential`) keyed as the original's.

    A buffer that several units read (e.g. rotary tables registered on the root module
    and read by every block) is copied into each of them
    (:func:`replicate_shared_inputs`): its copies come back as one key. Units hold
    every buffer they read as a persistent one, so the server ships it with the stage's
    weights; a buffer the user registered with ``persistent=False`` is no key of the
    user's ``state_dict``: give ``like`` to get exactly the user's keys.

    Parameters
    ----------
    state : mapping
        ``"<unit>.<original name>" -> tensor`` (the converted ``nn.Sequential``'s
        ``state_dict()``, or a merge of its stages').
    like : nn.Module or iterable of str, optional
        The user's module (or its ``state_dict`` keys): the result then has exactly its
        keys, in its order (non-persistent buffers dropped), and
        ``module.load_state_dict(..., strict=True)`` loads it.

    Returns
    -------
    dict
        ``"<original name>" -> tensor``.

    Raises
    ------
    ValueError
        If two units hold different values under one original name (a buffer the
        forward changes in place in several stages: the copies drifted apart), or a key
        of ``like`` is in no unit (naming the keys).
    """
    out: dict[str, Any] = {}
    held: dict[str, str] = {}
    for key, value in state.items():
        name = key.split(".", 1)[1]
        if name in out:
            if not torch.equal(torch.as_tensor(out[name]), torch.as_tensor(value)):
                raise ValueError(
                    f"{name!r} is held by units {held[name]} and {key.split('.', 1)[0]} "
                    "with different values: a buffer read by several stages must not be "
                    "changed by the forward (each stage would change its own copy)"
                )
            continue
        out[name] = value
        held[name] = key.split(".", 1)[0]
    if like is None:
        return out
    keys = list(like.state_dict() if isinstance(like, nn.Module) else like)
    missing = [k for k in keys if k not in out]
    if missing:
        raise ValueError(f"the converted state dict lacks {missing} of the original's keys")
    return {k: out[k] for k in keys}


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
    from sky_flower.core.example import example_input

    return as_sequential(module, example_input(2, input_shape, input_dtype), split_points)
