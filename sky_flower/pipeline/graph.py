"""Any ``nn.Module`` as an ``nn.Sequential`` of stage units, cut at module boundaries
with PyTorch's own machinery.

:func:`as_sequential` traces the model with ``torch.distributed.pipelining.pipeline``
(``torch.export`` underneath; GPipe's split API, Huang et al. 2019, arXiv 1811.06965),
placing a ``SplitPoint.BEGINNING`` before each split point, and returns the resulting
stage modules as the entries of an ``nn.Sequential``: each entry then is one unit the
partitioner may place on a node.

* **Default cuts** come from how the forward runs (:func:`default_split_points`): the
  submodules it calls once, down through containers and wrappers, and for a Hugging
  Face model each layer it declares whole (``_no_split_modules``). A module called
  more than once (a reused ``pool``) is no cut point.
* **Train/eval mode.** ``torch.export`` fixes the mode at trace time; a model with
  BatchNorm, dropout or ``self.training`` code is traced once per mode and each unit
  (:class:`TracedUnit`) switches graph with ``train()`` / ``eval()`` over one set of
  parameters and buffers.
* **Values the root computes for every block** without the input (buffers such as
  rotary tables, tensors made from them and from constants, a dynamic batch size a
  reshape reads) are computed again in every stage that reads it
  (:func:`replicate_shared_inputs`), its buffers copied into each such stage: they
  cross no cut, so a Llama-style model is cut between any two blocks.
* **Several tensors across a cut** (hidden states and an attention mask, a skip
  connection) are packed into one ``(B, n)`` tensor by the unit before it and unpacked
  by the unit after it (:func:`pack`, :class:`Wiring`): every transport and schedule
  carries one tensor per cut. A cut that would carry a value without a batch dimension,
  or split a trainable parameter shared by two units (a head tied to the embedding), is
  merged away (the latter with a warning naming it): pipelining would otherwise
  replicate the parameter and train two copies apart.

Data-dependent control flow fails the trace itself (torch.export's message).

The converted model's parameter and buffer names are the original's prefixed by the
unit index (``"2.blocks.q.weight"`` for ``"blocks.q.weight"``; a buffer copied into
several units under each of their indices, persistent in each so that the server ships
it with the stage): :func:`original_state_dict` maps a trained converted model's state
dict back to exactly the keys of the user's own module (replicas as one key,
non-persistent buffers dropped), so ``load_state_dict(strict=True)`` loads it.
"""

from __future__ import annotations

import copy
import logging
import operator
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from sky_flower.pipeline.packing import CutSpec, pack, pack_inputs, unpack
from sky_flower.pipeline.shared_values import replicate_shared_inputs
from sky_flower.pipeline.stage import buffers_kept

__all__ = [
    "CutSpec",
    "TracedUnit",
    "Wiring",
    "as_sequential",
    "bad_boundaries",
    "default_split_points",
    "block_classes",
    "no_split_classes",
    "original_state_dict",
    "pack",
    "pack_inputs",
    "replicate_shared_inputs",
    "sequential_of",
    "unpack",
]

MODE_DEPENDENT = (
    nn.modules.dropout._DropoutNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)
_MAX_TRACES = 4
log = logging.getLogger(__name__)
_SAID: set[tuple[str, tuple[str, ...]]] = set()  # conversions logged
_TRACE_LOCK = threading.RLock()
# torch 2.13's pytree, when a traced (torch.export) module is deep-copied: a notice to
# torch's own code, which every copy of a converted model printed
warnings.filterwarnings(
    "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
)


def mode_dependent_layers(module: nn.Module) -> list[str]:
    """Names of ``module``'s layers whose forward depends on train/eval mode: dropout
    with ``p > 0``, BatchNorm, InstanceNorm with running statistics."""
    names = []
    for name, sub in module.named_modules():
        if not isinstance(sub, MODE_DEPENDENT):
            continue
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p == 0:
            continue
        if isinstance(sub, nn.modules.instancenorm._InstanceNorm) and not sub.track_running_stats:
            continue
        names.append(name)
    return names


@dataclass(frozen=True)
class Wiring:
    """How one unit of a model whose cuts carry several tensors reads and writes them
    (names of the traced ``Pipe``'s root-graph values).

    ``inputs`` arrive packed by ``in_spec`` (unit 0: the model's input, as it is);
    the unit's graph takes ``args`` and returns ``outputs`` (one name, or ``(name,
    index)`` pairs of a tuple); ``carry`` leaves it, packed by ``out_spec`` (the last
    unit: the model's output, as it is). A value an earlier unit made that a later one
    reads passes through the units between (a skip connection)."""

    inputs: tuple[str, ...]
    in_spec: CutSpec | None
    args: tuple[str, ...]
    outputs: str | tuple[tuple[str, int], ...]
    carry: tuple[str, ...]
    out_spec: CutSpec | None


class TracedUnit(nn.Module):
    """One unit of a converted model: its traced graph, once per mode where the forward
    depends on it, and its :class:`Wiring` where a cut carries several tensors.

    * **Modes.** ``torch.export`` fixes the mode at trace time, so a model with
      BatchNorm, dropout or ``if self.training`` code is traced in each mode;
      ``train()`` runs the graph traced in training mode (batch statistics and their
      running update, dropout's draw from the global generator), ``eval()`` the one
      traced in eval mode. The unit registers the training graph's submodules,
      parameters and buffers as its own (its ``state_dict`` keys are the training
      graph's), and the eval graph's tensors are bound to them again after every
      ``to()``/``_apply`` (which replace buffer objects); ``deepcopy`` keeps the
      sharing.
    * **Several tensors across a cut** (hidden states and an attention mask, a skip
      connection): the unit unpacks what arrives (one tensor ``(B, n)``,
      :func:`pack`), runs its graph and packs what leaves, so every transport and
      schedule carries one tensor per cut and its gradient (none for integer parts).
    """

    def __init__(
        self,
        graphs: Mapping[bool, fx.GraphModule],
        wirings: Mapping[bool, Wiring | None] | None = None,
    ) -> None:
        super().__init__()
        train = graphs[True]
        for name, child in train.named_children():
            self.add_module(name, child)
        for name, param in train.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in train.named_buffers(recurse=False):
            self.register_buffer(name, buf, name not in train._non_persistent_buffers_set)
        # plain attributes, not submodules: no second copy of the weights
        self.__dict__["_graphs"] = dict(graphs)
        self.__dict__["_wirings"] = dict(wirings or {})
        self._share()

    def _share(self) -> None:
        """Bind every graph's parameters and buffers to the unit's own (the training
        graph's), path by path.

        Raises
        ------
        ValueError
            If the eval graph reads a tensor the training graph does not hold.
        """
        own = dict(self.named_modules())
        for graph in self._graphs.values():
            for path, sub in graph.named_modules():
                src = own.get(path)
                for table in ("_parameters", "_buffers"):
                    for name in list(getattr(sub, table)):
                        held = None if src is None else getattr(src, table).get(name)
                        if held is None:
                            raise ValueError(
                                f"the eval-mode graph reads {path + '.' if path else ''}"
                                f"{name}, which the training-mode graph of the same unit "
                                "does not hold"
                            )
                        if sub is not src:
                            getattr(sub, table)[name] = held

    def _apply(self, fn: Any, recurse: bool = True) -> TracedUnit:  # noqa: ANN401
        super()._apply(fn, recurse)
        self._share()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the model's input (unit 0) or what the previous unit returned; the
        next unit's input (packed where the cut carries several tensors) or the
        model's output (the last unit)."""
        mode = self.training if len(self._graphs) > 1 else True  # one graph: either mode
        graph, wiring = self._graphs[mode], self._wirings.get(mode)
        if wiring is None:
            return graph(x)
        came = [x] if wiring.in_spec is None else unpack(x, wiring.in_spec)
        values = dict(zip(wiring.inputs, came, strict=True))
        result = graph(*[values[a] for a in wiring.args])
        if isinstance(wiring.outputs, str):
            values[wiring.outputs] = result
        else:
            values.update((name, result[k]) for name, k in wiring.outputs)
        out = [values[n] for n in wiring.carry]
        return out[0] if wiring.out_spec is None else pack(out, wiring.out_spec)


def _wirings(pipe: Any, values: Mapping[fx.Node, Any]) -> list[Wiring] | None:  # noqa: ANN401
    """Each unit's :class:`Wiring` of ``pipe`` (``values``: :func:`_probe_values`; None
    where the model takes one tensor and every cut carries exactly the previous stage's
    whole output: the units need none). Several model inputs reach unit 0 packed."""
    S = pipe.num_stages
    graph = pipe.split_gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    crossing = [_crossing(pipe, b) for b in range(S - 1)]
    if len(inputs) == 1 and all(len(c) == 1 and c[0].op == "call_module" for c in crossing):
        return None
    calls = [n for n in graph.nodes if n.op == "call_module"]
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    wirings = []
    for i, call in enumerate(calls):
        came = inputs if i == 0 else crossing[i - 1]
        leaves = [out] if i == S - 1 else crossing[i]
        getitems = [u for u in call.users if u.op == "call_function"]
        outputs: str | tuple[tuple[str, int], ...]
        if getitems and all(u.target is operator.getitem for u in getitems):
            outputs = tuple((u.name, int(u.args[1])) for u in getitems)
        else:
            outputs = call.name
        wirings.append(
            Wiring(
                inputs=tuple(n.name for n in came),
                in_spec=None
                if i == 0 and len(came) == 1
                else CutSpec.of([values[n] for n in came]),
                args=tuple(a.name for a in call.args),
                outputs=outputs,
                carry=tuple(n.name for n in leaves),
                out_spec=None if i == S - 1 else CutSpec.of([values[n] for n in leaves]),
            )
        )
    return wirings


def _forward_facts(
    module: nn.Module, examples: tuple[torch.Tensor, ...]
) -> tuple[dict[str, int], set[str]]:
    """How often a forward on ``examples`` calls each of ``module``'s submodules, keyed
    by name in the order of their first call (a container that is never called itself,
    e.g. an ``nn.ModuleList``, is absent), and which of them change their input tensor
    in place (``ReLU(inplace=True)``: a cut before one would hand it a stage's received
    activation, which autograd cannot change in place)."""
    counts: dict[str, int] = {}
    in_place: set[str] = set()
    versions: dict[str, list[tuple[torch.Tensor, int]]] = {}

    def before(name: str, args: tuple) -> None:
        counts[name] = counts.get(name, 0) + 1
        versions[name] = [(a, a._version) for a in args if isinstance(a, torch.Tensor)]

    def after(name: str) -> None:
        if any(a._version != v for a, v in versions.pop(name, [])):
            in_place.add(name)

    hooks = []
    for name, sub in module.named_modules():
        if name:
            hooks.append(sub.register_forward_pre_hook(lambda m, a, n=name: before(n, a)))
            hooks.append(sub.register_forward_hook(lambda m, a, o, n=name: after(n)))
    name = type(module).__name__
    shapes = ", ".join(f"{tuple(e.shape)} {str(e.dtype).removeprefix('torch.')}" for e in examples)
    try:  # no side effect on the user's module: running statistics, the random stream
        with torch.no_grad(), buffers_kept(module), torch.random.fork_rng(devices=[]):
            out = module(*examples)
    except (TypeError, RuntimeError, IndexError, ValueError) as err:
        raise ValueError(
            f"{name} cannot run on the example input ({shapes}): {err}. Check input_shape "
            "and input_dtype (one sample's shape, no batch dimension); a model that takes "
            "several tensors describes them in inputs=[{shape, dtype}, ...]"
        ) from err
    finally:
        for h in hooks:
            h.remove()
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"{name} returns {type(out).__name__}, not one tensor: a split model's output "
            "is the loss's input. Wrap it so that its forward returns one tensor (a "
            "transformers model: sky_flower.pipeline.hf.hf_sequential, or a module whose "
            "forward returns self.m(input_ids=ids, use_cache=False).logits)"
        )
    return counts, in_place


def no_split_classes(module: nn.Module) -> set[str]:
    """Class names that a model declares must stay whole: the union of every submodule's
    ``_no_split_modules`` (Hugging Face ``PreTrainedModel``, e.g. ``LlamaDecoderLayer``;
    Accelerate's device-map convention)."""
    names: set[str] = set()
    for sub in module.modules():
        declared = getattr(sub, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.update(str(n) for n in declared)
    return names


def block_classes(module: nn.Module, calls: Mapping[str, int]) -> set[str]:
    """Class names of the blocks the default cuts fall before: those the model declares
    whole (:func:`no_split_classes`), else, where it declares none (DistilBERT, ELECTRA,
    a plain PyTorch model), the class of a stack of blocks: an ``nn.ModuleList`` of at
    least two modules of one class, each called once by the forward (``calls``)."""
    declared = no_split_classes(module)
    if declared:
        return declared
    stacks: set[str] = set()
    for prefix, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList):
            continue
        entries = list(sub.named_children())
        classes = {type(m).__name__ for _, m in entries}
        once = all(calls.get(f"{prefix}.{n}" if prefix else n, 0) == 1 for n, _ in entries)
        if len(entries) >= 2 and len(classes) == 1 and once:
            stacks |= classes
    return stacks


def default_split_points(
    module: nn.Module, calls: Mapping[str, int], in_place: Iterable[str] = ()
) -> list[str]:
    """Submodules to cut before by default, from how the forward runs (``calls``: the
    call count of each submodule; ``in_place``: those that change their input in place;
    :func:`_forward_facts`).

    The frontier of the module tree: a child the forward calls once is a point, except
    that the walk goes down into a child that is never called (a container such as an
    ``nn.ModuleList``), into the only called child of its parent (a wrapper such as
    ``self.m = AutoModelForCausalLM...``) and into a child that holds a block class
    (:func:`block_classes`: ``_no_split_modules``, else a stack of blocks in an
    ``nn.ModuleList``; the walk stops at ``LlamaDecoderLayer``, not above it). A child
    called more than once (a ``pool`` module reused, a shared activation) is no point:
    a cut before it would fall at each call. Nor is one that changes its input in place
    (torchvision's top-level ``ReLU(inplace=True)``): it stays with the unit before
    it."""
    whole = block_classes(module, calls)
    in_place = set(in_place)
    holds_whole = {
        name
        for name, sub in module.named_modules()
        if any(type(s).__name__ in whole for s in sub.modules())
    }
    points: list[str] = []

    def visit(prefix: str, parent: nn.Module) -> None:
        children = list(parent.named_children())
        called = [n for n, _ in children if calls.get(f"{prefix}{n}", 0) > 0]
        for name, child in children:
            full = f"{prefix}{name}"
            n_calls = calls.get(full, 0)
            leaf = not any(True for _ in child.children())
            if type(child).__name__ in whole:
                if n_calls == 1:
                    points.append(full)
            elif n_calls == 0 or (not leaf and (full in holds_whole or called == [name])):
                if n_calls <= 1:
                    visit(f"{full}.", child)
            elif n_calls == 1 and full not in in_place:
                points.append(full)

    visit("", module)
    return points


def _ordered_points(
    module: nn.Module, examples: tuple[torch.Tensor, ...], split_points: Sequence[str] | None
) -> list[str]:
    """The split points in execution order (default: :func:`default_split_points` but
    the first one called).

    Raises
    ------
    ValueError
        If a name is no submodule, is not called by the forward, or is called more than
        once.
    """
    calls, in_place = _forward_facts(module, examples)
    subs = dict(module.named_modules())
    if split_points is None:
        points = set(default_split_points(module, calls, in_place))
        ordered = [n for n in calls if n in points]
        whole = block_classes(module, calls)
        first = next((i for i, n in enumerate(ordered) if type(subs[n]).__name__ in whole), 0)
        # what runs before the first block (embeddings, rotary tables, their
        # dropout) is the model's prologue: one unit with the input, not a cut each
        return ordered[first:] if first else ordered[1:]
    unknown = [n for n in split_points if n not in subs or not n]
    if unknown:
        raise ValueError(f"split points {unknown} are not submodules of {type(module).__name__}")
    missing = [n for n in split_points if n not in calls]
    if missing:
        raise ValueError(f"split points {missing} are never called by the model's forward")
    reused = [f"{n} ({calls[n]} calls)" for n in split_points if calls[n] > 1]
    if reused:
        raise ValueError(
            f"split points {reused} are called more than once by "
            f"{type(module).__name__}'s forward, so a cut before them would fall at each "
            "call: choose modules called once (or leave split_points out: the default "
            "skips reused modules)"
        )
    changing = [n for n in split_points if n in in_place]
    if changing:
        raise ValueError(
            f"split points {changing} change their input in place (inplace=True), so a cut "
            "before them would hand them a stage's received activation, which autograd "
            "cannot change in place: choose another module, or set inplace=False on them"
        )
    return [n for n in calls if n in set(split_points)]


def _stage_of(node: fx.Node) -> int:
    """Stage index of a node of the pipe's root graph (-1: the model's input)."""
    if node.op == "placeholder":
        return -1
    if node.op == "call_module":
        return int(str(node.target).rsplit("_", 1)[1])
    return _stage_of(node.args[0])  # operator.getitem of a stage's tuple output


def _crossing(pipe: Any, b: int) -> list[fx.Node]:  # noqa: ANN401 - a pipelining Pipe
    """The values of ``pipe``'s root graph that cross boundary ``b`` (between stage
    ``b`` and ``b + 1``): defined at or before stage ``b`` (the model's input at -1),
    read after it or returned by the model. A stage that returns several values
    crosses as its ``getitem`` nodes."""
    graph = pipe.split_gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    return [
        n
        for n in graph.nodes
        if n.op != "output"
        and _stage_of(n) <= b
        and any(u is out_node or _stage_of(u) > b for u in n.users)
    ]


def _probe_values(pipe: Any, examples: tuple[torch.Tensor, ...]) -> dict[fx.Node, Any]:  # noqa: ANN401
    """Every value of ``pipe``'s root graph on ``examples`` (the model's inputs; no
    graph, no side effect on buffers or the random stream): what crosses each cut, for
    its shape and dtype."""
    values: dict[fx.Node, Any] = {}
    inputs = iter(examples)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for node in pipe.split_gm.graph.nodes:
            if node.op == "placeholder":
                values[node] = next(inputs)
            elif node.op == "call_module":
                sub = pipe.split_gm.get_submodule(str(node.target))
                with buffers_kept(sub):
                    values[node] = sub(*fx.node.map_arg(node.args, values.__getitem__))
            elif node.op == "call_function":
                values[node] = node.target(*fx.node.map_arg(node.args, values.__getitem__))
    return values


def _tied_spans(pipe: Any) -> list[tuple[list[str], int, int]]:  # noqa: ANN401
    """Each trainable parameter several stages of ``pipe`` read (a head tied to the
    embedding): its names, and the first and last stage reading it."""
    spans = []
    for uses in pipe.replicated_params:
        stages = sorted(int(s.rsplit("_", 1)[1]) for s in uses)
        spans.append((sorted(set(uses.values())), stages[0], stages[-1]))
    return spans


def bad_boundaries(
    pipe: Any,  # noqa: ANN401 - a pipelining Pipe
    values: Mapping[fx.Node, Any],
) -> dict[int, str]:
    """Boundaries of a traced ``Pipe`` that cannot be cut: ``{b: why}``, ``b`` being the
    boundary between stage ``b`` and stage ``b + 1``.

    A boundary is bad if a value crossing it (``values``: :func:`_probe_values`) is no
    tensor whose first dimension is the batch (a size, a tensor shared by all samples:
    it cannot be cut into micro-batches), or if the stages on either side share a
    parameter.
    """
    bad: dict[int, str] = {}
    batch = values[next(iter(values))].shape[0]  # the model's first input
    for b in range(pipe.num_stages - 1):
        for n in _crossing(pipe, b):
            v = values[n]
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != batch:
                what = type(v).__name__ if not isinstance(v, torch.Tensor) else tuple(v.shape)
                bad[b] = f"{n.name} ({what}) crosses it without a batch dimension"
                if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] % batch == 0:
                    bad[b] += (  # (B, C, T) viewed as (B * C, T): *ForMultipleChoice
                        f" (its first dimension is {v.shape[0] // batch} x the batch of "
                        f"{batch}: the forward folds another dimension into the batch's)"
                    )
                break
    for names, first, last in _tied_spans(pipe):
        for b in range(first, last):
            bad.setdefault(b, f"parameter {names[0]} is used on both sides")
    return bad


def _trace(  # noqa: ANN401 - a pipelining Pipe
    module: nn.Module,
    examples: tuple[torch.Tensor, ...],
    points: Sequence[str],
    training: bool = True,
) -> Any:
    """``torch.distributed.pipelining`` 's ``Pipe`` of a copy of ``module`` in training
    (or eval) mode cut before each of ``points``, what no cut needs to carry computed in
    each stage (:func:`replicate_shared_inputs`)."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import Pipe, annotate_split_points

    model = copy.deepcopy(module).train(training)
    annotate_split_points(model, {p: SplitPoint.BEGINNING for p in points})
    examples = tuple(e.detach().clone() for e in examples)
    # a dynamic batch dimension: else torch.export bakes the example's batch size into
    # every reshape, and the units fail (or mix samples) on another batch size
    for example in examples:
        torch._dynamo.mark_dynamic(example, 0)
    failed: list[BaseException] = []

    def policy(gm: fx.GraphModule) -> fx.GraphModule:
        try:
            return replicate_shared_inputs(gm)
        except Exception as err:
            failed.append(err)
            raise

    mode = "training" if training else "eval"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13's pytree deprecations
        try:
            return Pipe.from_tracing(model, examples, split_policy=policy)
        except Exception as err:
            if failed:  # our own split policy, not the tracer
                raise ValueError(
                    f"sky-flower could not recompute the values {type(module).__name__}'s "
                    f"units share (replicate_shared_inputs, cuts before {list(points)}, "
                    f"{mode} mode): {failed[0]}. Give split_points to cut elsewhere, and "
                    "report the model"
                ) from failed[0]
            if isinstance(err, ValueError):
                raise
            text = str(err)
            hint = ""
            cumulative = [
                name
                for name, sub in model.named_modules()
                if isinstance(sub, nn.modules.batchnorm._BatchNorm)
                and sub.momentum is None
                and sub.track_running_stats
            ]
            if training and cumulative:
                hint = (
                    f" (BatchNorm {cumulative} has momentum=None, a cumulative average "
                    "whose factor 1 / num_batches_tracked the layer reads as a Python "
                    "number, which torch.export cannot trace: give it a momentum, e.g. "
                    "0.1, PyTorch's default, or give Sky an nn.Sequential of your own, "
                    "which is not traced)"
                )
            elif called := re.search(
                r"Child module '([^']+)' is not a descendant of parent module '([^']+)'", text
            ):
                hint = (
                    f" ({called[2]} calls {called[1]}, a module it does not hold (handed "
                    "to its forward as an argument, as peft's DoRA, use_dora=True, does), "
                    "which torch.distributed.pipelining cannot trace: call it from a module "
                    "that holds it, or make it a submodule of the caller)"
                )
            elif "nonexistent attribute" in text and "submod_" in text:
                hint = (
                    " (its forward switches autograd, e.g. torch.no_grad() or "
                    "torch.set_grad_enabled inside it, which torch.distributed.pipelining "
                    "cannot split: detach the tensor instead, or move that code out of "
                    "the forward)"
                )
            elif "data-dependent" in text or "full graph" in text:
                hint = (
                    " (the usual cause is control flow on a tensor's values, e.g. "
                    "`if x.sum() > 0`: write it with torch.where, or move it out of the "
                    "forward)"
                )
            raise ValueError(
                f"torch.export cannot trace {type(module).__name__} ({mode} mode){hint}: {text}"
            ) from err


def as_sequential(
    module: nn.Module,
    example_input: torch.Tensor | Sequence[torch.Tensor],
    split_points: Sequence[str] | None = None,
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
        Submodule names (``named_modules`` keys), each called once by the forward; a
        cut is placed before each. Default: :func:`default_split_points` (from how the
        forward runs: modules called once, down through containers, wrappers and to
        the layers a model declares whole in ``_no_split_modules``).

    Returns
    -------
    nn.Sequential
        Units in execution order, ``split_points`` (the cuts kept) as an attribute;
        their composition equals ``module``'s forward in train and eval mode (same
        outputs, dropout draws, BatchNorm statistics and gradients). A unit is the
        traced stage module, or a :class:`TracedUnit` where the forward depends on the
        mode (one graph per mode) or a cut carries several tensors (packed as one,
        :func:`pack`). Values computed from buffers, constants and sizes alone are
        computed in every unit that reads them; a cut that would carry a value without
        a batch dimension or split a shared trainable parameter is merged away (the
        latter with a warning naming it), so there may be fewer units than split
        points + 1.

    Raises
    ------
    ValueError
        On a split point that is no submodule, never called or called more than once,
        a model that does not take one tensor and return one tensor, a forward
        torch.export cannot trace (its message), or a conversion whose eval-mode
        output differs from the model's.
    """
    # torch.export (dynamo) is not thread-safe: a server's pipelines and a node's
    # threads convert one model at a time; an inference-mode caller still traces
    with _TRACE_LOCK, torch.inference_mode(False):
        return _as_sequential(module, example_input, split_points)


def _as_sequential(
    module: nn.Module,
    example_input: torch.Tensor | Sequence[torch.Tensor],
    split_points: Sequence[str] | None,
) -> nn.Sequential:
    """:func:`as_sequential` (under its lock)."""
    examples = (example_input,) if torch.is_tensor(example_input) else tuple(example_input)
    batches = {int(e.shape[0]) if e.dim() else 0 for e in examples}
    if len(batches) != 1 or min(batches) < 2:
        shapes = [tuple(e.shape) for e in examples]
        raise ValueError(
            f"example_input of shape(s) {shapes}: give a batch of at least 2 samples, the "
            "same in every input (torch.export specializes a batch dimension of 1)"
        )
    points = _ordered_points(module, examples, split_points)
    # a second trace in eval mode where the forward depends on the mode
    modal = bool(mode_dependent_layers(module))
    for _ in range(_MAX_TRACES):
        pipes = {True: _trace(module, examples, points, training=True)}
        if modal:
            pipes[False] = _trace(module, examples, points, training=False)
        values = {mode: _probe_values(pipe, examples) for mode, pipe in pipes.items()}
        bad: dict[int, str] = {}
        for mode, pipe in pipes.items():
            if pipe.num_stages != len(points) + 1:
                raise ValueError(
                    f"{type(module).__name__}: torch.export kept {pipe.num_stages - 1} of the "
                    f"{len(points)} cuts before {points} (a module whose forward the tracer "
                    "inlines or runs without the input, e.g. under torch.no_grad, loses its "
                    "cut): give split_points without it"
                )
            _check_io(pipe, len(examples))
            for b, why in bad_boundaries(pipe, values[mode]).items():
                bad.setdefault(b, why)
        if bad:
            _warn_merged(module, pipes[True], points, bad)
            points = [p for b, p in enumerate(points) if b not in bad]
            continue
        seq = _units(pipes, values)
        if modal or _same_in_eval_mode(module, seq, examples):
            break
        modal = True  # a forward that reads self.training where no layer type shows it
    else:  # pragma: no cover - one retrace removes every bad boundary
        raise ValueError(f"could not cut {type(module).__name__} at {points}: {bad}")
    # (a model without a second trace passed this check in the loop)
    if modal and not _same_in_eval_mode(module, seq, examples):
        raise ValueError(
            f"the traced {type(module).__name__} differs from the model in eval mode: "
            "its eval-mode graph does not reproduce model.eval()'s output"
        )
    seq.input_spec = CutSpec.of(examples) if len(examples) > 1 else None
    seq.input_shapes = [tuple(e.shape[1:]) for e in examples]  # data sources pad to them
    seq.input_dtypes = [str(e.dtype).removeprefix("torch.") for e in examples]
    seq.batchnorm_state_keys = _batchnorm_keys(module, seq)
    seq.split_points = list(points)
    seq.module_prefix = getattr(module, "module_prefix", "")  # a wrapper's (hf.Logits)
    for unit, name in zip(seq, unit_names(module, seq, points), strict=True):
        unit.sky_name = name  # layer tables and errors: "2:fc2+bn2", not "2:TracedUnit"
    seq.module_aliases = _alias_groups(module)
    seq.input_names = getattr(module, "input_names", None)  # hf.Logits: the batch's keys
    said = (type(module).__name__, tuple(points))
    if said not in _SAID:  # once per process: a node converts the model for each message
        _SAID.add(said)
        log.info("%s cut before %s: %d units", type(module).__name__, points, len(seq))
    return seq


def unit_names(module: nn.Module, seq: nn.Sequential, points: Sequence[str]) -> list[str]:
    """Each unit of ``seq`` (``module`` converted, cut before ``points``) named by the
    user's modules it holds whole, by their paths in ``module``: ``"fc2"``, two as
    ``"fc2+bn2"``, more as first and last, ``"layers.0..layers.3"``. A module is held
    whole by a unit when every parameter and buffer under it is that unit's alone (a
    buffer copied into several units names none). A unit holding none is named by the
    split point it starts at, or ``"input"`` (the first)."""
    prefix = getattr(module, "module_prefix", "")
    owner: dict[str, int] = {}  # tensor name -> its unit, -1 where several hold it
    for i, unit in enumerate(seq):
        held = [n for n, _ in unit.named_parameters(remove_duplicate=False)]
        held += [n for n, _ in unit.named_buffers(remove_duplicate=False)]
        for name in set(held):
            owner[name] = i if owner.get(name, i) == i else -1
    whole: list[list[str]] = [[] for _ in seq]
    for path, sub in module.named_modules():
        if not path:
            continue
        tensors = [n for n, _ in sub.named_parameters(remove_duplicate=False)]
        tensors += [n for n, _ in sub.named_buffers(remove_duplicate=False)]
        units = {owner.get(f"{path}.{n}", -1) for n in tensors}
        if len(units) != 1 or -1 in units:
            continue
        (i,) = units
        parent = path.rpartition(".")[0]
        if not any(parent == p or parent.startswith(f"{p}.") for p in whole[i]):
            whole[i].append(path)  # the outermost only (named_modules: parents first)
    names = []
    for i, paths in enumerate(whole):
        paths = [p.removeprefix(prefix) for p in paths]
        if not paths:
            names.append(points[i - 1] if i else "input")
        elif len(paths) <= 2:
            names.append("+".join(paths))
        else:
            names.append(f"{paths[0]}..{paths[-1]}")
    return names


def _alias_groups(module: nn.Module) -> list[list[str]]:
    """The keys of ``module``'s state dict that hold one tensor (tied weights), in
    groups of two or more."""
    held_by: dict[int, list[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        held_by.setdefault(id(value), []).append(key)
    return [keys for keys in held_by.values() if len(keys) > 1]


def _batchnorm_keys(module: nn.Module, seq: nn.Sequential) -> frozenset[str]:
    """The converted model's state-dict keys that belong to a BatchNorm layer of the
    user's module (its units hold traced modules that no longer are ``_BatchNorm`` s:
    ``train.bn_policy=local`` reads these)."""
    norms = {
        name
        for name, sub in module.named_modules()
        if isinstance(sub, nn.modules.batchnorm._BatchNorm)
    }
    return frozenset(
        key for key in seq.state_dict() if key.split(".", 1)[1].rpartition(".")[0] in norms
    )


def _compiled(module: nn.Module) -> None:
    """Run every unflattened submodule of ``module`` by its generated code, not by
    ``torch.fx.Interpreter`` node by node (torch.export's default for debugging): the
    same ops in the same order, 1.5-3x less Python overhead per call on small models."""
    from torch.export.unflatten import InterpreterModule

    for sub in module.modules():
        if not isinstance(sub, InterpreterModule) or sub.__dict__.get("graph_module") is None:
            continue
        # a value named "self" (the output of BERT's attention.self module) would
        # shadow the generated forward's own self: give it another name first
        named_self = [n for n in sub.graph.nodes if n.name == "self"]
        for node in named_self:
            node._rename("self_out")
        if named_self:
            sub.graph_module.recompile()
        sub._run_with_interpreter = False


def _units(
    pipes: Mapping[bool, Any], values: Mapping[bool, Mapping[fx.Node, Any]]
) -> nn.Sequential:
    """The stage modules of the training-mode ``Pipe`` (``pipes[True]``), as they are or
    as :class:`TracedUnit` s (paired with the eval-mode ``Pipe``'s where there is one,
    ``pipes[False]``; wired where a cut carries several tensors: ``values`` are each
    ``Pipe``'s :func:`_probe_values`), as an ``nn.Sequential``."""
    for pipe in pipes.values():
        _compiled(pipe.split_gm)
    wirings = {mode: _wirings(pipe, values[mode]) for mode, pipe in pipes.items()}
    units: list[nn.Module] = []
    for i in range(pipes[True].num_stages):
        graphs = {mode: pipe.get_stage_module(i) for mode, pipe in pipes.items()}
        wired = {mode: None if w is None else w[i] for mode, w in wirings.items()}
        if len(pipes) == 1 and wired[True] is None:
            units.append(graphs[True])
        else:
            units.append(TracedUnit(graphs, wired))
    return nn.Sequential(*units)


def _warn_merged(
    module: nn.Module,
    pipe: Any,  # noqa: ANN401 - a pipelining Pipe
    points: Sequence[str],
    bad: Mapping[int, str],
) -> None:
    """Warn, naming what is lost, when cuts are merged away: a trainable parameter read
    by several stages (a head tied to the embedding) merges the units between them (one
    warning naming the parameter and the split points dropped); a value a cut cannot
    carry (one without a batch dimension, e.g. T5's position bias, computed from a
    trainable parameter in one block and read by every later one) merges the units on
    either side (one warning naming the cuts and the values)."""
    tied: set[int] = set()
    for names, first, last in _tied_spans(pipe):
        tied.update(range(first, last))
        lost = [points[b] for b in range(first, last) if b in bad]
        if lost:
            fix = (  # several names: tied modules; one: a module several blocks call
                "Untie the weights (give the head its own parameter; a transformers "
                "model: tie_word_embeddings=False in its config) to cut there"
                if len(names) > 1
                else "To cut there, give each block its own copy of it (a layer shared "
                "by every block, as ALBERT's, or a table every block reads, as "
                "DeBERTa's relative positions, cannot be split)"
            )
            what = "are one trainable parameter" if len(names) > 1 else "is a trainable parameter"
            warnings.warn(
                f"{type(module).__name__}: {' and '.join(names)} {what} "
                f"read by stages {first} and {last}; split training cannot keep copies "
                "of a trainable parameter equal across stages, so everything between "
                f"them is one unit (no cut before {', '.join(lost)}). {fix}",
                stacklevel=4,
            )
    lost = [f"{points[b]} ({why})" for b, why in bad.items() if b not in tied]
    if lost:
        warnings.warn(
            f"{type(module).__name__}: no cut before {'; '.join(lost)}: what crosses there "
            "cannot be cut into micro-batches, so the units on either side are one",
            stacklevel=4,
        )


def _same_in_eval_mode(
    module: nn.Module, seq: nn.Sequential, examples: tuple[torch.Tensor, ...]
) -> bool:
    """Whether ``seq`` in eval mode computes ``module.eval()``'s output on ``examples``
    (within float rounding): a forward that reads ``self.training`` (a functional
    dropout, a branch) shows here where no layer type does."""
    if any(e.device.type == "meta" for e in examples):
        return True
    packed = examples[0] if len(examples) == 1 else pack_inputs(examples)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        want = copy.deepcopy(module).eval()(*examples)
        got = copy.deepcopy(seq).eval()(packed)
    return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6))


def _check_io(pipe: Any, n_inputs: int = 1) -> None:  # noqa: ANN401 - a pipelining Pipe
    """Refuse a model that does not take the ``n_inputs`` example tensors and return one
    tensor."""
    graph = pipe.split_gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    if len(inputs) != n_inputs or len(out) != 1:
        raise ValueError(
            f"the model takes {len(inputs)} inputs (the example gave {n_inputs}) and returns "
            f"{len(out)} values: a split model returns one tensor (the loss's input), and "
            "takes the tensors example_input gives"
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
        ``module.load_state_dict(..., strict=True)`` loads it. A tensor the module
        holds under several keys (an alias) fills each of them. A buffer or frozen
        parameter the forward never reads (so no unit holds it: an InstanceNorm's
        ``num_batches_tracked``) is the module's own value (a module given).

    Returns
    -------
    dict
        ``"<original name>" -> tensor``.

    Raises
    ------
    ValueError
        If two units hold different values under one original name (a buffer the
        forward changes in place in several stages: the copies drifted apart), or a key
        of ``like`` is in no unit (naming the keys; a trainable parameter always is).
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
    if isinstance(like, nn.Module):  # one tensor under several keys (T5's shared and
        # encoder.embed_tokens): the converted model holds it under one of them
        for names in _alias_groups(like):
            present = next((k for k in names if k in out), None)
            for k in names:
                if present is not None and k not in out:
                    out[k] = out[present]
    if isinstance(like, nn.Module):  # what the forward never reads is in no unit (an
        # InstanceNorm's num_batches_tracked, peft's original_module): the module's own
        trained = {k for k, p in like.named_parameters() if p.requires_grad}
        unread = {k: v for k, v in like.state_dict().items() if k not in out and k not in trained}
        out.update(unread)
    missing = [k for k in keys if k not in out]
    if missing:
        raise ValueError(f"the converted state dict lacks {missing} of the original's keys")
    return {k: out[k] for k in keys}


def model_input(model: nn.Module) -> tuple[list[int] | None, str | None]:
    """``(input_shape, input_dtype)`` of one sample of a converted model's input (its
    several inputs packed as :func:`pack_inputs` packs them), or ``(None, None)`` for a
    model that does not record them (an ``nn.Sequential`` of your own)."""
    shapes = getattr(model, "input_shapes", None)
    if shapes is None:
        return None, None
    spec = getattr(model, "input_spec", None)
    if spec is not None:
        return [sum(spec.sizes)], str(spec.dtype).removeprefix("torch.")
    return list(shapes[0]), model.input_dtypes[0]


@dataclass(frozen=True)
class ModuleKeys:
    """A converted model's state-dict keys (``"<unit>.<name>"``) against those of the
    module it was converted from (``"<name>"``): what lets a Flower app keep its own
    ``initial_arrays = ArrayRecord(Net().state_dict())`` and an ``evaluate_fn`` that
    loads ``Net()`` (:meth:`of`).

    Attributes
    ----------
    converted : tuple of str
        The converted model's keys, in its order.
    original : tuple of str
        The user's keys, in their order.
    aliases : dict
        A user's key held by no unit -> the user's key holding the same tensor in the
        module (T5's ``encoder.embed_tokens.weight`` -> ``shared.weight``; the model's
        ``module_aliases``, recorded at conversion).
    prefix : str
        Where the converted module wraps the user's (``module_prefix``, e.g.
        :class:`sky_flower.pipeline.hf.Logits`'s ``"hf."``): left off the user's keys.
    fixed : dict
        Converted keys of buffers the user's state dict does not hold (non-persistent:
        position ids, rotary tables) -> the converted model's own values.
    kept : dict
        The user's entries no unit holds and that alias none (the forward never reads
        them) -> their values in the state given: returned unchanged.
    """

    converted: tuple[str, ...]
    original: tuple[str, ...]
    aliases: Mapping[str, str]
    prefix: str = ""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    kept: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module, state: Mapping[str, Any]) -> ModuleKeys | None:
        """The translation for ``state`` (keyed like the module ``model`` was converted
        from), or None when ``state`` is keyed like ``model`` itself (or ``model`` is
        no converted model: nothing to translate).

        Raises
        ------
        ValueError
            If ``model`` is a converted model and ``state`` is keyed like neither it nor
            its original module (naming keys of both).
        """
        converted = tuple(model.state_dict())
        if set(state) == set(converted) or not hasattr(model, "split_points"):
            return None
        prefix = getattr(model, "module_prefix", "")
        names = {_name(k, prefix) for k in converted}
        params = dict(model.named_parameters())
        absent = [k for k in converted if _name(k, prefix) not in state]
        # a buffer the user's state dict does not hold (registered persistent=False:
        # position ids, rotary tables) is the model's own constant: kept from model_fn()
        own = model.state_dict()
        fixed = {k: own[k].detach().clone() for k in absent if k not in params}
        missing = [k for k in absent if k in params]
        if missing:
            raise ValueError(
                f"initial_arrays is keyed neither like the converted model ({converted[:3]}"
                f"...) nor like the module it was converted from: "
                f"{[k.split('.', 1)[1] for k in missing[:3]]} are missing; give "
                "ArrayRecord(Net().state_dict()) of the module model_fn converts"
            )
        aliases: dict[str, str] = {}
        kept: dict[str, Any] = {}
        groups = [[k.removeprefix(prefix) for k in g] for g in getattr(model, "module_aliases", [])]
        for key in state:
            if key in names:
                continue
            group = next((g for g in groups if key in g), [])
            twin = next((n for n in group if n in names), None)
            if twin is not None:  # one tensor under several keys in the user's module
                aliases[key] = twin
            else:  # an entry the forward never reads (peft's original_module beside
                # modules_to_save): handed back as it came in
                kept[key] = state[key]
        return cls(converted, tuple(state), aliases, prefix, fixed, kept)

    def to_converted(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The user's state dict keyed like the converted model (each unit's copy of a
        shared buffer included)."""
        return {
            k: self.fixed[k] if k in self.fixed else state[_name(k, self.prefix)]
            for k in self.converted
        }

    def to_original(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The converted model's state dict keyed like the user's module, in its order
        (:func:`original_state_dict`; aliases filled)."""
        out = {k.removeprefix(self.prefix): v for k, v in original_state_dict(state).items()}
        out.update(self.kept)
        return {k: out[self.aliases.get(k, k)] for k in self.original}


def _name(key: str, prefix: str) -> str:
    """A converted key's name in the user's module: ``"<unit>.<prefix><name>"``."""
    return key.split(".", 1)[1].removeprefix(prefix)


def _check_shape(input_shape: Any) -> None:  # noqa: ANN401 - what a caller gave
    """Refuse an ``input_shape`` that is no list of positive ints (``3072`` for
    ``[3072]``), naming the fix."""
    try:
        ok = not isinstance(input_shape, str) and all(operator.index(d) > 0 for d in input_shape)
    except TypeError:  # no iterable, or an entry that is no integer
        ok = False
    if not ok:
        raise TypeError(
            f"input_shape is one sample's shape as a list of positive ints, without the "
            f"batch dimension (e.g. [64] or [3, 32, 32]), got {input_shape!r}"
        )


def sequential_of(
    module: nn.Module,
    input_shape: Sequence[int],
    input_dtype: str = "float32",
    split_points: Sequence[str] | None = None,
    inputs: Sequence[Mapping[str, Any]] | None = None,
) -> nn.Sequential:
    """:func:`as_sequential` on a synthetic input of one sample's ``input_shape`` (a
    Hydra ``_target_`` for a user's own module: ``module`` is instantiated first).

    A module that takes several tensors (``forward(input_ids, attention_mask)``)
    describes them in ``inputs`` (``[{"shape": [T], "dtype": "int64"}, ...]``, in the
    forward's order): its converted model takes them packed as one tensor
    (:func:`pack_inputs`, what the data owner's ``x`` holds), which ``input_shape`` and
    ``input_dtype`` then describe (the sum of their sizes; their widest dtype).

    Each call traces the model (about a second for a small one): build it once per
    process where you can.

    Raises
    ------
    ValueError
        As :func:`as_sequential`; or when ``input_shape`` / ``input_dtype`` do not
        describe the packed ``inputs`` (the message gives the values to write).
    TypeError
        When ``module`` is no ``nn.Module`` or ``input_shape`` no list of positive ints.
    """
    from sky_flower.core.example import as_dtype, example_input

    _check_shape(input_shape)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"sequential_of takes a built nn.Module (Net()), got {module!r}: for a class "
            "or a builder, use sequential_fn(Net, input_shape)"
        )
    if not inputs:
        return as_sequential(module, example_input(2, input_shape, input_dtype), split_points)
    examples = tuple(example_input(2, i["shape"], i.get("dtype", "float32")) for i in inputs)
    spec = CutSpec.of(examples)
    packed = [sum(spec.sizes)]
    if [int(d) for d in input_shape] != packed or as_dtype(input_dtype) != spec.dtype:
        raise ValueError(
            f"{type(module).__name__} takes {len(inputs)} inputs, packed for Sky as one "
            f"tensor: write input_shape: {packed} and input_dtype: "
            f"{str(spec.dtype).removeprefix('torch.')} (given {list(input_shape)}, "
            f"{input_dtype})"
        )
    return as_sequential(module, examples, split_points)


def sequential_fn(
    factory: Callable[[], nn.Module],
    input_shape: Sequence[int],
    input_dtype: str = "float32",
    split_points: Sequence[str] | None = None,
    inputs: Sequence[Mapping[str, Any]] | None = None,
) -> Callable[[], nn.Sequential]:
    """A ``model_fn`` for :func:`sky_flower.app.register_sky_client` and
    :func:`sky_flower.app.sky_strategy`: ``factory()`` (your ``Net``) converted by
    :func:`sequential_of`, traced once per process.

    Every call builds a fresh ``factory()`` (its own initialisation) and returns a copy
    of the first call's conversion holding that module's weights and buffers, so a node
    that builds the model for every message traces it once (about a second) instead of
    every time. ``factory`` must build the same architecture on every call.

    Raises
    ------
    ValueError
        As :func:`sequential_of` (on the first call).
    TypeError
        At once, when ``factory`` is a built module (``Net()``) or no callable, or
        ``input_shape`` no list of positive ints.
    """
    _check_shape(input_shape)
    if isinstance(factory, nn.Module) or not callable(factory):
        raise TypeError(
            f"sequential_fn takes what builds the model (the class Net, or a function "
            f"returning a module), got {type(factory).__name__!r} {factory!r:.60}: pass Net, "
            "not Net(); for a module already built use sequential_of(module, input_shape)"
        )
    template: list[nn.Sequential] = []

    def model_fn() -> nn.Sequential:
        meta = torch.get_default_device().type == "meta"
        if not template:  # the trace, made once and always on the CPU: one made on meta
            # (a first build for shapes only) would keep meta constants for good
            with torch.device("cpu"):
                template.append(
                    sequential_of(factory(), input_shape, input_dtype, split_points, inputs)
                )
            if not meta:
                return copy.deepcopy(template[0])
        if meta:  # built for shapes only (stage.meta_layers, under torch.device("meta")):
            # the trace's copy on meta, without building factory() (a from_pretrained, a
            # peft wrap: seconds) for values nobody reads
            return copy.deepcopy(template[0]).to("meta")
        module = factory()
        seq = copy.deepcopy(template[0])
        if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            return seq.to("meta")  # a factory that builds on meta itself: no values to copy
        state = {**dict(module.named_buffers()), **module.state_dict()}  # non-persistent too
        own = seq.state_dict()
        with torch.no_grad():  # a constant the trace lifted (a plain tensor attribute,
            # GPT-2's lifted_tensor_0) is no entry of the module's: the template's value
            seq.load_state_dict({k: state.get(k.split(".", 1)[1], v) for k, v in own.items()})
        return seq

    return model_fn
