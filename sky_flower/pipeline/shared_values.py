"""What no cut needs to carry: a split policy for ``torch.distributed.pipelining``
(:func:`replicate_shared_inputs`) that computes again, in every stage that reads it, a
value the root computes for every block without the input (rotary tables, a causal
mask, a dynamic batch size), and a value made from one integer input tensor where that
tensor is smaller (BERT's ``(B, 1, T, T)`` mask from the ``(B, T)`` ids).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx


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
    # values made by pure ops from one integer tensor that depends on the input (an
    # attention mask from the token ids): recomputed where read from that source when
    # the source has fewer elements per sample (BERT's (B, 1, T, T) mask from the (B, T)
    # ids)
    source: dict[fx.Node, fx.Node] = {}
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    trained: set[fx.Node] = set()  # reads a parameter: never recomputed elsewhere
    for node in graph.nodes:
        if node.op == "get_attr":
            if node.target in params:
                trained.add(node)
        elif any(i in trained for i in node.all_input_nodes):
            trained.add(node)
    for node in graph.nodes:
        if node in free or node in trained or not _pure(node):
            continue
        roots = {source.get(i, i) for i in node.all_input_nodes if i not in free}
        if len(roots) == 1:
            (root,) = roots
            val = root.meta.get("val")
            if isinstance(val, torch.Tensor) and not val.dtype.is_floating_point:
                source[node] = root
    cheaper = {
        n
        for n, root in source.items()
        if (k := _sample_numel(root)) is not None and k < (_sample_numel(n) or 0)
    }
    recomputable = free | source.keys()
    clones: dict[tuple[fx.Node, int], fx.Node] = {}
    origin: dict[fx.Node, fx.Node] = {}  # a copy -> the value it computes again

    def crossing_inputs(q: int) -> list[fx.Node]:
        """Values defined before stage ``q`` and read in it (each defined before any
        node of stage ``q``: a size read from one may go anywhere in the stage, also
        before the stage first reads the tensor, as a block's ``arange(B * 8)`` before
        its first layer)."""
        seen: list[fx.Node] = []
        for n in graph.nodes:
            if part[n] == q:
                seen += [i for i in n.all_input_nodes if part[i] < q and i not in free]
        return list(dict.fromkeys(seen))

    def clone(node: fx.Node, q: int, before: fx.Node) -> fx.Node | None:
        """``node`` computed again in stage ``q``, inserted before ``before`` (a
        derived value's integer source is read as it is: it crosses instead). A
        value that already reads another stage's copy (``B * 16`` made in block 0
        from block 0's copy of the batch size) is computed again from the original."""
        node = origin.get(node, node)
        if node.op == "get_attr" or part[node] == q or node not in recomputable:
            return node
        if (node, q) in clones:
            return clones[(node, q)]
        symbol = _size_symbol(node)
        if symbol is not None:
            copy_ = None
            for t in crossing_inputs(q):
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
        origin[copy_] = node
        return copy_

    moved = free | cheaper
    for node in list(graph.nodes):
        if node not in moved or node.op == "get_attr":
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
        if node in recomputable and node.op != "get_attr" and not node.users:
            graph.erase_node(node)
    _sort_within_stages(graph, part)
    graph.lint()
    gm.recompile()
    return gm


def _sample_numel(node: fx.Node) -> int | None:
    """Elements per sample of ``node``'s tensor (what it costs packed across a cut,
    where every element takes the pack's dtype): its first dimension dynamic (the
    batch), the others static; None for anything else."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    if not isinstance(val.shape[0], torch.SymInt):
        return None
    if not all(isinstance(d, int) for d in val.shape[1:]):
        return None
    return math.prod(val.shape[1:])


def _inputs_first(members: Sequence[fx.Node]) -> list[fx.Node]:
    """``members`` (one stage's nodes) reordered so that each follows its inputs among
    them, keeping the given order wherever it already does (a depth-first emit)."""
    inside = set(members)
    order: list[fx.Node] = []
    done: set[fx.Node] = set()
    for node in members:
        stack = [(node, iter(node.all_input_nodes))]
        while stack:
            top, inputs = stack[-1]
            nxt = next((i for i in inputs if i in inside and i not in done), None)
            if nxt is not None:
                stack.append((nxt, iter(nxt.all_input_nodes)))
                continue
            stack.pop()
            if top not in done:
                done.add(top)
                order.append(top)
    return order


def _sort_within_stages(graph: fx.Graph, part: Mapping[fx.Node, int]) -> None:
    """Reorder each stage's nodes so that every node follows its inputs, keeping the
    traced order wherever it already does. A value recomputed in a stage is inserted
    before its first reader there, and a copy made for one reader may be reused by an
    earlier one (rotary tables and masks read by every layer); no node leaves its
    stage."""
    stages: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if not _is_split(node):
            stages.setdefault(part[node], []).append(node)
    for members in stages.values():
        order = _inputs_first(members)
        if order == members:
            continue
        anchor = members[0].prev
        for node in order:
            anchor.append(node)
            anchor = node
