"""Stage-state migration: each layer's optimizer state follows it to its new node.

A stage's optimizer state lives on its node, keyed by the parameter's index in the
stage (:func:`sky_flower.pipeline.stage.optimizer_to_tensors`: ``"<pid>.<name>"``), so
it means nothing once the cuts move. With ``train.optimizer_state=keep`` every stage
returns its optimizer state at the end of the round keyed by the model's own parameter
names (``"3.0.weight::exp_avg"``), the server keeps it per pipeline (its data owner),
and the next round's set-up hands each stage the state of the layers it now holds,
whichever node held them before (relay: ``train.sky_setup``; direct:
``train.sky_direct``). Weights and buffers (BatchNorm's running statistics) already
travel this way every round (the global model). Training therefore continues exactly
as if nothing had moved (``tests/test_replan.py``).

With ``train.optimizer_state=round`` (the default, as before) every round starts with a
fresh optimizer on every stage and nothing of the optimizer is shipped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

from sky_flower.pipeline.stage import (
    frozen_keys,
    meta_layers,
    optimizer_from_tensors,
    optimizer_to_tensors,
    slice_state,
    trained_state,
)
from sky_flower.sky import protocol as P

OPTIM_KEY = "sky.optim-state"  # array record: optimizer state by parameter name
WANT_KEY = "sky.optim-wanted"  # config record of a collect: reply with the state
SEP = "::"  # "<parameter name>::<state name>"


def param_names(model_fn: Callable[[], nn.Module], first: int, last: int) -> list[str]:
    """Names (full-model keys, e.g. ``"3.0.weight"``) of the trainable parameters of
    layers ``first..last``, in the order a stage's optimizer holds them (built on the
    meta device: no weight memory)."""
    layers = meta_layers(model_fn)
    stage = nn.Sequential(OrderedDict((str(j), layers[j]) for j in range(first, last + 1)))
    return [n for n, p in stage.named_parameters() if p.requires_grad]


def global_optimizer_state(
    model_fn: Callable[[], nn.Module], first: int, last: int, local: ArrayRecord | None
) -> ArrayRecord:
    """A stage's optimizer state (``"<pid>.<name>"`` keys) keyed by parameter name
    (``"<parameter>::<name>"``); empty for a stage without one.

    Raises
    ------
    ValueError
        If a parameter index is outside the stage.
    """
    if local is None:
        return ArrayRecord()
    names = param_names(model_fn, first, last)
    out = {}
    for key, value in local.to_torch_state_dict().items():
        pid, name = key.split(".", 1)
        if not 0 <= int(pid) < len(names):
            raise ValueError(
                f"optimizer state {key!r}: no parameter {pid} in layers {first}..{last}"
            )
        out[f"{names[int(pid)]}{SEP}{name}"] = value
    return ArrayRecord(out)


def local_optimizer_state(
    model_fn: Callable[[], nn.Module], first: int, last: int, by_name: ArrayRecord
) -> ArrayRecord:
    """The inverse of :func:`global_optimizer_state` for the stage of layers
    ``first..last`` (entries of other layers are refused).

    Raises
    ------
    ValueError
        If an entry names a parameter the stage does not hold.
    """
    index = {n: i for i, n in enumerate(param_names(model_fn, first, last))}
    out = {}
    for key, value in by_name.to_torch_state_dict().items():
        param, name = key.split(SEP, 1)
        if param not in index:
            raise ValueError(f"optimizer state {key!r} is not of layers {first}..{last}")
        out[f"{index[param]}.{name}"] = value
    return ArrayRecord(out)


def load_optimizer_state(
    opt: torch.optim.Optimizer | None,
    model_fn: Callable[[], nn.Module],
    first: int,
    last: int,
    by_name: ArrayRecord | None,
) -> None:
    """Load ``by_name``, the optimizer state of layers ``first..last`` by parameter name
    (``train.optimizer_state=keep``), into the stage's optimizer ``opt``; nothing when
    either is None (a fresh optimizer, a stage without parameters).

    Raises
    ------
    ValueError
        If an entry names a parameter the stage does not hold.
    """
    if opt is not None and by_name is not None:
        local = local_optimizer_state(model_fn, first, last, by_name)
        optimizer_from_tensors(opt, local.to_torch_state_dict())


def live_stage_reply(  # noqa: PLR0913
    modules: Iterable[nn.Module],
    metrics: MetricRecord,
    opt: torch.optim.Optimizer | None,
    model_fn: Callable[[], nn.Module],
    st: P.StageConfig,
    keep: bool,
) -> RecordDict:
    """A live stage's reply after a round (``stream``, ``direct``): the trainable
    weights and buffers of its ``modules`` without the frozen parameters, by model key
    (:data:`~sky_flower.sky.protocol.ARRAYS`), ``metrics``
    (:data:`~sky_flower.sky.protocol.METRICS`) and, with ``keep``
    (``train.optimizer_state=keep``), ``opt``'s state by parameter name
    (:data:`OPTIM_KEY`; empty without an optimizer)."""
    weights: dict[str, torch.Tensor] = {}
    for module in modules:
        weights.update(trained_state(module.state_dict(), frozen_keys(module)))
    out = RecordDict({P.ARRAYS: ArrayRecord(weights), P.METRICS: metrics})
    if keep:
        local = ArrayRecord(optimizer_to_tensors(opt) if opt is not None else {})
        out[OPTIM_KEY] = global_optimizer_state(model_fn, st.first, st.last, local)
    return out


def wants_optimizer(content: RecordDict) -> bool:
    """Whether a collect (or direct) message asks for the stage's optimizer state."""
    return WANT_KEY in content.config_records or OPTIM_KEY in content.array_records


class OptimizerStore:
    """The server's copy of every pipeline's optimizer state between rounds, keyed by
    the pipeline's data owner, then by ``"<parameter>::<name>"`` (thread-safe: the
    pipelines of a round run on threads)."""

    def __init__(self) -> None:
        self._state: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def stage_record(self, owner: str, first: int, last: int) -> ArrayRecord:
        """The state of layers ``first..last`` of ``owner``'s pipeline (empty at first)."""
        with self._lock:
            return ArrayRecord(slice_state(self._state.get(owner, {}), first, last))

    def put(self, owner: str, records: list[ArrayRecord]) -> None:
        """Keep the stages' states (one record per stage) as ``owner``'s."""
        merged: dict[str, torch.Tensor] = {}
        for rec in records:
            merged.update(rec.to_torch_state_dict())
        with self._lock:
            self._state[owner] = merged

    def nbytes(self, owner: str, first: int, last: int) -> int:
        """Bytes of the state of layers ``first..last`` of ``owner``'s pipeline."""
        return int(self.stage_record(owner, first, last).count_bytes())

    def owners(self) -> Mapping[str, int]:
        """Owner -> entries kept (for tests and logs)."""
        with self._lock:
            return {o: len(s) for o, s in self._state.items()}


def want_record() -> dict[str, ConfigRecord]:
    """The content entry that makes a collect reply carry the optimizer state."""
    return {WANT_KEY: ConfigRecord({"optimizer": 1})}
