"""Per-layer model profile: FLOPs, parameter, optimizer-state and activation bytes.

Pure PyTorch (no Flower import). A model is an ordered list of layers: an
``nn.Sequential`` or any list of modules whose composition is the model. Each entry is
one unit the partitioner may place on a node.

FLOPs come from :class:`torch.utils.flop_counter.FlopCounterMode` run on the real
modules; bytes come from the tensors the modules really produce, and the stash (what
autograd keeps for the backward pass) from the tensors their forward really saves.

Example
-------
>>> import torch.nn as nn
>>> model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
>>> profiles = profile_layers(model, input_shape=(64,), microbatch_size=8)
>>> [p.name for p in profiles]
['0:Linear', '1:ReLU', '2:Linear']
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from sky_flower.core.clock import clock
from sky_flower.core.example import example_input
from sky_flower.core.ties import refuse_ties_across_entries

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class LayerProfile:
    """What one layer (one partitionable entry) costs.

    All per-sample figures scale linearly with the micro-batch size.

    Attributes
    ----------
    index : int
        Position in the model, 0-based.
    name : str
        ``"<index>:<module class>"``.
    fwd_flops : float
        Forward FLOPs per sample (FlopCounterMode convention: one multiply-add = 2).
    bwd_flops : float
        Backward FLOPs per sample (input gradient, unless the layer is the first,
        plus weight gradients).
    param_bytes : int
        Bytes of trainable parameters. Gradients take the same again.
    optimizer_state_bytes : int
        Bytes of optimizer state after one step of the configured optimizer (over the
        trainable parameters only).
    act_in_bytes : float
        Bytes of this layer's input per sample.
    act_out_bytes : float
        Bytes of this layer's output per sample (what crosses a stage boundary).
    stash_bytes : float or None
        Bytes per sample that autograd keeps for this layer's backward pass: every
        distinct storage its forward saves (e.g. a Linear's input, a ReLU's output),
        parameters and buffers excluded, views counted once. ``None`` = not measured;
        :class:`sky_flower.core.cost.CostModel` then falls back to ``act_out_bytes``.
    frozen_bytes : int
        Bytes of frozen parameters (``requires_grad=False``, e.g. a base model under
        LoRA adapters): held, never trained, so no gradient and no optimizer state.
    """

    index: int
    name: str
    fwd_flops: float
    bwd_flops: float
    param_bytes: int
    optimizer_state_bytes: int
    act_in_bytes: float
    act_out_bytes: float
    stash_bytes: float | None = None
    frozen_bytes: int = 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of all parameters, trainable and frozen (what moving the layer moves)."""
        return self.param_bytes + self.frozen_bytes

    @property
    def static_bytes(self) -> int:
        """Bytes a node holds to train the layer, whatever the batch: every weight, the
        trainable parameters' gradients and optimizer state (``2 * param_bytes +
        optimizer_state_bytes + frozen_bytes``)."""
        return 2 * self.param_bytes + self.optimizer_state_bytes + self.frozen_bytes

    def to_dict(self) -> dict:
        """Plain-dict form for JSON."""
        return asdict(self)


def as_layers(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """Return the ordered list of layers of ``model``.

    Raises
    ------
    TypeError
        If ``model`` is neither an ``nn.Sequential`` nor a sequence of modules.
    ValueError
        If the model has no layers, or is an ``nn.Sequential`` subclass with its own
        ``forward`` (e.g. a skip across entries): split training runs the entries as a
        plain chain, which would train another function.
    """
    if isinstance(model, nn.Sequential) and type(model).forward is not nn.Sequential.forward:
        raise ValueError(
            f"{type(model).__name__} is an nn.Sequential subclass with its own forward: "
            "split training runs its entries one after another as a plain chain and "
            "would ignore what that forward adds (e.g. a skip connection across entries). "
            "Put each skip inside one entry (a residual block module, as "
            "sky_flower.pipeline.models.ResidualBlock) and use a plain nn.Sequential"
        )
    if isinstance(model, nn.Sequential):
        layers = list(model)
    elif isinstance(model, Sequence) and all(isinstance(m, nn.Module) for m in model):
        layers = list(model)
    else:
        raise TypeError(
            "model must be an nn.Sequential or a list of nn.Module layers in execution "
            f"order, got {type(model).__name__}: convert another nn.Module with "
            "sky_flower.pipeline.graph.sequential_of(module, input_shape, input_dtype) "
            "(in a model config: _target_: sky_flower.pipeline.graph.sequential_of, "
            "module: {_target_: <your class>, ...}; see conf/model/llama_lm.yaml)"
        )
    if not layers:
        raise ValueError("model has no layers: pass at least one module")
    refuse_ties_across_entries(layers)
    return layers


def default_optimizer_factory(
    name: str = "adam", lr: float = 1e-3
) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """Optimizer factory by name (``adam``, ``sgd``, ``sgd_momentum``).

    Raises
    ------
    ValueError
        On an unknown optimizer name.
    """
    name = name.lower()
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    if name == "sgd_momentum":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}: choose one of adam, sgd, sgd_momentum")


def _optimizer_state_bytes(layer: nn.Module, make_optimizer: OptimizerFactory) -> int:
    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:
        return 0
    clone = copy.deepcopy(layer)
    cparams = [p for p in clone.parameters() if p.requires_grad]
    opt = make_optimizer(cparams)
    for p in cparams:
        p.grad = torch.zeros_like(p)
    opt.step()
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
    return total


def _saved_storages_hooks(
    layer: nn.Module, saved: dict[int, int]
) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks that record ``{storage data_ptr: nbytes}`` of every tensor autograd saves
    during a forward of ``layer``, its parameters and buffers excluded (a view records its
    base's storage, so a storage counts once however many views of it are saved)."""
    own = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in own:
            saved[ptr] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _batchnorm_check(index: int, layer: nn.Module, microbatch_size: int) -> None:
    """Refuse BatchNorm in training on micro-batches of one sample (naming the layer)."""
    if microbatch_size > 1:
        return
    for name, sub in layer.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm):
            where = f"{index}.{name}" if name else str(index)
            raise ValueError(
                f"layer {where} ({type(sub).__name__}) gets micro-batches of 1 sample: "
                "BatchNorm normalises over the micro-batch and cannot train on one sample. "
                "Use micro-batches of at least 2 samples (schedule.batch_size / "
                "schedule.microbatches >= 2) or replace it with GroupNorm or LayerNorm"
            )


def layer_label(layer: nn.Module) -> str:
    """What a layer is called in layer tables and errors: a converted model's unit by
    the modules of the user's model it holds (``"fc2+bn2"``, set by
    :func:`sky_flower.pipeline.graph.as_sequential`), any other layer by its class
    (``"Linear"``)."""
    return str(getattr(layer, "sky_name", None) or type(layer).__name__)


def _run_layer(index: int, layer: nn.Module, x_in: torch.Tensor) -> torch.Tensor:
    """``layer(x_in)``, its errors turned into messages naming the layer and the fix.

    Raises
    ------
    ValueError
        If the layer modifies its input in place (e.g. ``ReLU(inplace=True)`` as an entry
        of its own), fails on the input's shape, or returns something other than one
        tensor (a tuple: ``nn.LSTM``, a two-output layer).
    """
    kind = layer_label(layer)
    try:
        y = layer(x_in)
    except RuntimeError as err:
        if "in-place" in str(err) or "inplace" in str(err):
            raise ValueError(
                f"layer {index} ({kind}) modifies its input in place (inplace=True): a cut "
                "before it hands it a stage's received activation, which autograd cannot "
                "modify in place. Set inplace=False on it, or put it in one nn.Sequential "
                f"entry with the layer before it: {err}"
            ) from err
        raise ValueError(
            f"layer {index} ({kind}) does not accept input of shape {tuple(x_in.shape)}: {err}"
        ) from err
    if not torch.is_tensor(y):
        raise ValueError(
            f"layer {index} ({kind}) returns a {type(y).__name__}, not one tensor: a cut "
            "after it could not send its output. Every entry of the model must return one "
            "tensor: put it in one nn.Sequential entry with what consumes its outputs, "
            "e.g. nn.Sequential(nn.LSTM(...), sky_flower.pipeline.models.FirstOutput())"
        )
    return y


def check_layers(
    model: nn.Module | Sequence[nn.Module], x: torch.Tensor, microbatch_size: int
) -> torch.Tensor:
    """Run ``x`` (a few real samples, ``(n, *input_shape)``) through the model entry by
    entry, as split training will, and refuse what it cannot train (the checks of
    :func:`profile_layers`, without its measurements). Returns the model's output; the
    model's parameters get no gradient.

    Raises
    ------
    ValueError, TypeError
        As :func:`as_layers` and :func:`profile_layers`, naming the layer and the fix.
    """
    layers = as_layers(model)
    for index, layer in enumerate(layers):
        _batchnorm_check(index, layer, microbatch_size)
    h = x
    for index, layer in enumerate(layers):
        h = h.detach().requires_grad_(index > 0 and h.is_floating_point())
        h = _run_layer(index, layer, h)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return h.detach()


def profile_layers(
    model: nn.Module | Sequence[nn.Module],
    input_shape: Sequence[int],
    microbatch_size: int,
    make_optimizer: OptimizerFactory | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[LayerProfile]:
    """Profile every layer of ``model`` on a micro-batch of ``microbatch_size`` samples.

    Parameters
    ----------
    model : nn.Sequential or list of nn.Module
        The model as an ordered list of layers.
    input_shape : sequence of int
        Shape of one sample, without the batch dimension (e.g. ``(64,)``).
    microbatch_size : int
        Samples per micro-batch used for the measurement (FLOPs are then divided by it).
    make_optimizer : callable, optional
        ``params -> torch.optim.Optimizer``; default Adam.
    dtype : torch.dtype
        Dtype of the probe input (float32; an integer dtype, e.g. token ids, gives zeros:
        :func:`sky_flower.core.example.example_input`).

    Returns
    -------
    list of LayerProfile
        One entry per layer, in order. ``stash_bytes`` is measured with
        :class:`torch.autograd.graph.saved_tensors_hooks` on the same forward pass.

    Raises
    ------
    ValueError
        If ``microbatch_size`` < 1, the layers do not compose on ``input_shape``, a layer
        returns no single tensor (a tuple), modifies its input in place, or holds
        BatchNorm with micro-batches of one sample (each message names the layer and
        the fix).
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    layers = as_layers(model)
    make_optimizer = make_optimizer or default_optimizer_factory()
    x = example_input(microbatch_size, input_shape, dtype)
    profiles: list[LayerProfile] = []
    for index, layer in enumerate(layers):
        x_in = x.detach().requires_grad_(index > 0 and x.is_floating_point())
        fwd_counter = FlopCounterMode(display=False)
        saved: dict[int, int] = {}
        _batchnorm_check(index, layer, microbatch_size)
        with fwd_counter, _saved_storages_hooks(layer, saved):
            y = _run_layer(index, layer, x_in)
        bwd_flops = 0
        if y.requires_grad:
            bwd_counter = FlopCounterMode(display=False)
            with bwd_counter:
                y.backward(torch.ones_like(y))
            bwd_flops = bwd_counter.get_total_flops()
        layer.zero_grad(set_to_none=True)
        param_bytes = sum(
            p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad
        )
        frozen_bytes = sum(
            p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad
        )
        profiles.append(
            LayerProfile(
                index=index,
                name=f"{index}:{layer_label(layer)}",
                fwd_flops=fwd_counter.get_total_flops() / microbatch_size,
                bwd_flops=bwd_flops / microbatch_size,
                param_bytes=int(param_bytes),
                optimizer_state_bytes=_optimizer_state_bytes(layer, make_optimizer),
                act_in_bytes=x_in.numel() * x_in.element_size() / microbatch_size,
                act_out_bytes=y.numel() * y.element_size() / microbatch_size,
                stash_bytes=sum(saved.values()) / microbatch_size,
                frozen_bytes=int(frozen_bytes),
            )
        )
        x = y.detach()
    return profiles


@dataclass(frozen=True)
class NodeProfile:
    """What one node can do, as measured in the benchmark round.

    Attributes
    ----------
    name : str
        Node name from the fleet config (stable across runs, unlike Flower node IDs).
    layer_fwd_s, layer_bwd_s : tuple of float
        Seconds per micro-batch for each layer's forward and backward pass, measured on
        the node itself (median after warm-up), emulated slowdown included.
    memory_bytes : int
        Memory available for training on the node (bytes).
    latency_s : float
        Seconds per message round trip server <-> node, Flower's per-message overhead
        included (from echo timing).
    bandwidth_bps : float
        Link bandwidth in bytes per second (from echo timing at two payload sizes).
    state_s_per_byte : float
        Extra seconds per message per byte the node keeps in ``context.state`` (Flower
        ships a node's context with every message it handles), from echo timing with
        and without a probe array stored in the state; the training job adds the
        node's own per-byte cost of rebuilding a stage from the state and saving it back
        (:func:`sky_flower.sky.node.client.time_state_roundtrip`), which every stage
        message pays too.
    holds_data : bool
        Whether the node is a data owner.
    slowdown : float
        Emulated slowdown factor reported by the node (0 = none), for display.
    node_id : int
        Flower node ID in the current run (0 when not known).
    microbatch_overhead_s : float
        Calibration: fixed seconds a ``direct`` stage pays per micro-batch
        besides its layers' compute (``torch.distributed.pipelining``'s schedule and
        autograd bookkeeping, forward and backward together), from a one-stage schedule
        on the node (:func:`time_microbatch_overhead`). 0 = not measured.
    peer_latency_s : float
        Calibration: one-way seconds of one ``direct`` peer message on this node's gloo
        stack (a gloo echo between two ranks on the node: loopback, whatever load the
        host carries), charged on every stage boundary per micro-batch and direction on
        top of the emulated link. 0 = not measured.
    host : str
        The machine the node runs on; stages whose nodes share a host share its cores.
        ``""`` = unknown (no contention charged).
    host_parallelism : float
        Calibration: how many workers the host runs at full speed at once, measured as
        ``max_k k t_1 / t_k`` over ``k`` concurrent compute workers (``t_k``: one
        worker's time among ``k``). 0 = not measured (no contention charged).
    layer_step_s : tuple of float
        Calibration: seconds of one optimizer step over each layer's parameters
        (emulated slowdown included), also spread over the step's micro-batches in
        ``layer_bwd_s``; ``direct`` charges it where it runs, once at the end of the
        step. ``()`` = not given (the spread stays).
    device, device_name : str
        Where the node's stages compute (``"cpu"``, ``"cuda:N"``: what the times and
        ``memory_bytes`` are of) and its name (``""`` = not reported).
    setup_s : float
        ``stream``: seconds from the push of the node's benchmark message (its
        ``query.sky_profile``, which carries the stream-link probe) until the node had
        joined the probe's endpoint:
        what a stage session's set-up costs the node in Flower but for its weights (the
        SuperNode's pull, a deployment's ClientApp start, connecting). 0 = not
        measured.
    """

    name: str
    layer_fwd_s: tuple[float, ...]
    layer_bwd_s: tuple[float, ...]
    memory_bytes: int
    latency_s: float = 0.0
    bandwidth_bps: float = float("inf")
    state_s_per_byte: float = 0.0
    holds_data: bool = False
    slowdown: float = 0.0
    node_id: int = 0
    microbatch_overhead_s: float = 0.0
    peer_latency_s: float = 0.0
    host: str = ""
    host_parallelism: float = 0.0
    layer_step_s: tuple[float, ...] = ()
    device: str = "cpu"
    device_name: str = ""
    setup_s: float = 0.0

    def to_dict(self) -> dict:
        """Plain-dict form for JSON (infinite bandwidth as ``None``)."""
        d = asdict(self)
        d["layer_fwd_s"] = list(self.layer_fwd_s)
        d["layer_bwd_s"] = list(self.layer_bwd_s)
        d["layer_step_s"] = list(self.layer_step_s)
        if self.bandwidth_bps == float("inf"):
            d["bandwidth_bps"] = None
        return d


def time_layers(
    model: nn.Module | Sequence[nn.Module],
    input_shape: Sequence[int],
    microbatch_size: int,
    warmup: int = 2,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[list[float], list[float]]:
    """Time each layer's forward and backward pass on this machine.

    Runs every layer on a micro-batch of the configured shape, ``warmup`` untimed
    passes then ``repeats`` timed ones, and returns the medians. ``dtype`` is the input's
    (as :func:`profile_layers`). ``device``: where the layers run (moved there; a CUDA
    device is synchronized around each timed pass).

    Returns
    -------
    (fwd_s, bwd_s) : tuple of list of float
        Seconds per micro-batch, one entry per layer.
    """
    import statistics

    layers = as_layers(model)
    x = example_input(microbatch_size, input_shape, dtype).to(device)
    fwd_s: list[float] = []
    bwd_s: list[float] = []
    for index, layer in enumerate(layers):
        layer.to(device)
        f_times: list[float] = []
        b_times: list[float] = []
        y = None
        for rep in range(warmup + repeats):
            x_in = x.detach().requires_grad_(index > 0 and x.is_floating_point())
            t0 = clock(device)
            y = layer(x_in)
            t1 = clock(device)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            t2 = clock(device)
            if rep >= warmup:
                f_times.append(t1 - t0)
                b_times.append(t2 - t1)
        layer.zero_grad(set_to_none=True)
        fwd_s.append(statistics.median(f_times))
        bwd_s.append(statistics.median(b_times))
        assert y is not None
        x = y.detach()
    return fwd_s, bwd_s


def time_optimizer_steps(
    model: nn.Module | Sequence[nn.Module],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    warmup: int = 1,
    repeats: int = 3,
    device: torch.device | str = "cpu",
) -> list[float]:
    """Seconds of one optimizer step over each layer's parameters (median; 0 for a layer
    without parameters), the layer on ``device`` (a CUDA device synchronized around
    each step). A stage steps once per training step, so the training job spreads this
    over the step's micro-batches (``layer_bwd_s += step / M``)."""
    import statistics

    out = []
    for layer in as_layers(model):
        layer.to(device)
        params = [p for p in layer.parameters() if p.requires_grad]
        if not params:
            out.append(0.0)
            continue
        opt = optimizer_factory(params)
        for p in params:
            p.grad = torch.ones_like(p)
        times = []
        for rep in range(warmup + repeats):
            t0 = clock(device)
            opt.step()
            if rep >= warmup:
                times.append(clock(device) - t0)
        out.append(statistics.median(times))
    return out
