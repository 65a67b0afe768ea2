"""What a transport runner is given and what it returns.

A runner executes one round of split training for one pipeline: it takes the
:class:`Pipeline` (the plan with the node of every stage and what the cost model
predicts per stage), the global model's arrays and the number of steps, and returns a
:class:`RoundOutcome`. :class:`sky_flower.strategies.sky.SkyStrategy` picks its runner
once from the transport (``RUNNERS`` there) and never branches on it again.

A runner holds no strategy state: each call builds its own
:class:`sky_flower.flower.exchange.Exchange`, so several pipelines (one per data owner)
can later run their rounds concurrently, one runner instance each.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid
from torch import nn

from sky_flower.core.cost import Schedule
from sky_flower.core.partition import Plan
from sky_flower.flower.exchange import Exchange, NodeError, NodeLedger
from sky_flower.pipeline.objective import ref
from sky_flower.pipeline.stage import frozen_keys
from sky_flower.sky import protocol as P
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.deadlines import deadline
from sky_flower.sky.transport.records import StageRecord


class SkyNodeError(NodeError):
    """A Sky node failed to answer, or answered with an error or a malformed reply.

    ``nodes`` / ``node_ids``: the nodes that caused it, where known (a ``direct`` round
    also names, in the text, the peers that stopped because of them; those are not in
    ``nodes``). The strategy drops exactly these nodes after a failed round.
    """


@dataclass(frozen=True)
class Pipeline:
    """A plan as a runner executes it.

    Attributes
    ----------
    plan : Plan
        Stages in pipeline order (stage 0: the data owner).
    node_ids : tuple[int, ...]
        Flower node id of every stage, shape (S,).
    group_size : int
        Relay: micro-batches per Flower message (``c``; ``M // c`` message groups per
        step). ``sequential`` is one group (``c = M``).
    predictions : tuple[dict, ...]
        Per stage, the cost model's per-step figures (seconds): ``compute_s``,
        ``busy_s`` and ``messages`` (see
        :func:`sky_flower.sky.planning.planning.stage_predictions`).
    slowdowns : tuple[float, ...]
        Per stage, the node's emulated slowdown (measured compute times ``1 + slowdown``).
    links : tuple[tuple[float, float], ...]
        Per stage, the node's link ``(latency s, bandwidth bytes/s; 0 = unlimited)``.
    devices : tuple[tuple[str, str], ...]
        Per stage, the node's ``(host, device)`` as its benchmark reported them
        (``host`` ``""`` when not measured); ``()``: not known (every stage on the CPU).
        ``direct`` picks NCCL from them (:func:`sky_flower.pipeline.device.direct_backend`).
    setup_s : float
        Predicted seconds of a stage session's set-up (``stream``: its Flower set-up
        messages until every stage has joined), charged once per session; 0: not
        predicted.
    """

    plan: Plan
    node_ids: tuple[int, ...]
    group_size: int
    predictions: tuple[dict[str, Any], ...]
    slowdowns: tuple[float, ...]
    links: tuple[tuple[float, float], ...]
    devices: tuple[tuple[str, str], ...] = ()
    setup_s: float = 0.0

    @property
    def num_stages(self) -> int:
        """Number of stages ``S``."""
        return len(self.plan.stages)


@dataclass(frozen=True)
class RunSettings:
    """What every runner needs beyond the pipeline: the run's settings, what the model
    gives, and the run's live context.

    ``settings``: the run's frozen :class:`~sky_flower.sky.settings.SkySettings`, read by
    group (``train``, ``failure``, ``messaging``, ``direct``, ``stream``, ``deadlines``,
    ``seed``; :attr:`schedule` is its :meth:`~SkySettings.schedule_object`).
    From the model: ``model_fn``, one sample's ``input_shape`` and ``input_dtype``,
    ``num_layers``, and its objective: ``loss_fn`` / ``metric_fn`` travel to the nodes by
    reference (:func:`sky_flower.pipeline.objective.ref`): they must be importable
    module-level functions on the nodes too.
    The live context: ``stop`` (set it to end the round at its next poll),
    ``describe`` (node id -> node name; errors name nodes by it), ``ledger`` (the
    run's messages in flight and nodes contacted, shared by every exchange:
    :class:`sky_flower.flower.exchange.NodeLedger`), ``optimizer_store`` and
    ``sessions``.
    """

    model_fn: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    num_layers: int
    settings: SkySettings = field(default_factory=SkySettings)
    input_dtype: str = "float32"  # of the model's input (int64 for token ids)
    loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy
    metric_fn: Callable[..., int] | None = None
    # how loss_fn reduces over a micro-batch (sky_flower.pipeline.objective.LossReduction)
    loss_reduction: str = "mean"
    loss_weight_fn: Callable[..., Any] | None = None  # reduction "weighted" only
    stop: threading.Event = field(default_factory=threading.Event)
    describe: Callable[[int], str | None] = lambda nid: None
    ledger: NodeLedger = field(default_factory=NodeLedger)
    # train.optimizer_state=keep: the pipelines' optimizer states between rounds
    # (sky_flower.sky.migration.OptimizerStore); None: a fresh optimizer every round
    optimizer_store: Any = None
    # transport=stream with stream.sessions: the run's live stage sessions
    # (sky_flower.sky.transport.session.StreamSessions); None: a set-up every round
    sessions: Any = None

    @cached_property
    def schedule(self) -> Schedule:
        """The settings' :class:`~sky_flower.core.cost.Schedule`."""
        return self.settings.schedule_object()

    def deadline(self, phase: str, predicted_s: float = 0.0) -> float:
        """Seconds a message of ``phase`` may take
        (:func:`sky_flower.sky.transport.deadlines.deadline`, floor
        ``failure.message_timeout_s``)."""
        s = self.settings
        return deadline(s.deadlines, phase, s.failure.message_timeout_s, predicted_s)

    def exchange(self, grid: Grid, timeout_s: float | None = None) -> Exchange:
        """A fresh :class:`Exchange` on ``grid`` raising :class:`SkyNodeError`, on the
        run's ledger (first contact, messages in flight)."""
        s = self.settings
        return Exchange(
            grid,
            timeout_s=s.failure.message_timeout_s if timeout_s is None else timeout_s,
            poll_interval_s=s.messaging.poll_interval_s,
            stop=self.stop,
            describe=self.describe,
            error_cls=SkyNodeError,
            ledger=self.ledger,
            first_contact_s=s.deadlines.first_contact_s,
            busy_wait_s=s.deadlines.busy_wait_s,
        )

    def stream_endpoint(self) -> dict[str, Any]:
        """:class:`sky_flower.sky.transport.channel.Endpoint`'s keywords for
        ``transport=stream``."""
        st = self.settings.stream
        return {
            "bind": st.bind or st.host,
            "advertise": st.host,
            "tls": st.tls,
            "max_frame_bytes": int(st.max_frame_mb * 2**20),
        }

    def objective(self) -> dict[str, str]:
        """The stage-config entries naming the loss and metric functions and the loss's
        reduction (and weight function)."""
        from sky_flower.pipeline.objective import correct_count

        return {
            "loss": ref(self.loss_fn),
            "metric": ref(self.metric_fn or correct_count),
            "reduction": self.loss_reduction,
            "weight": ref(self.loss_weight_fn) if self.loss_weight_fn is not None else "-",
        }


def message(node_id: int, mtype: str, content: dict[str, Any], group: str) -> Message:
    """A Flower message of type ``mtype`` to ``node_id`` holding ``content``."""
    return Message(RecordDict(content), dst_node_id=node_id, message_type=mtype, group_id=group)


@dataclass
class RoundOutcome:
    """One successful round of one pipeline.

    Attributes
    ----------
    arrays : ArrayRecord
        The new global model.
    losses : list[float]
        Training loss of every step, shape (steps,).
    correct, seen : int
        Correct predictions and samples over the round.
    step_times : list[float]
        Wall seconds of every step, shape (steps,).
    stages : list[StageRecord]
        Per stage: measured against predicted figures (:mod:`sky_flower.sky.rounds.report`).
    extra : dict
        Transport-specific row entries (relay: ``microbatches_per_message``; direct:
        ``setup_s``, ``wall_s``): fields of the round's record.
    weights_bytes, full_weights_bytes : int
        Bytes of weights the stages' replies carried (trainable parameters and
        buffers), and what they would have carried with every entry of the model (full
        fine-tuning); :func:`merge_weights`.
    """

    arrays: ArrayRecord
    losses: list[float]
    correct: int
    seen: int
    step_times: list[float]
    stages: list[StageRecord]
    extra: dict[str, Any] = field(default_factory=dict)
    weights_bytes: int = 0
    full_weights_bytes: int = 0


class Runner(ABC):
    """One round of split training on one transport, for one pipeline.

    Parameters
    ----------
    settings : RunSettings
        The run's settings, the model and its objective, the run's live context.
    """

    label: ClassVar[str]  # how the report names the transport
    peer_links: ClassVar[bool] = False  # benchmark: emulated peer links, no relay echoes
    calibrate: ClassVar[bool] = False  # benchmark: time the direct step's calibration

    def __init__(self, settings: RunSettings) -> None:
        self.s = settings
        model = settings.model_fn()
        self.expected = set(model.state_dict().keys())  # the model's keys
        # its frozen parameters (requires_grad=False): the stages' replies leave them out,
        # the round's model keeps those it started from (merge_weights)
        self.frozen = frozen_keys(model)

    def merge(
        self, replies: Sequence[Message], ex: Exchange, start: ArrayRecord
    ) -> tuple[ArrayRecord, int, int]:
        """:func:`merge_weights` of this model (its keys, its frozen parameters taken
        from ``start``, the model the round started from)."""
        return merge_weights(replies, ex, self.expected, P.ARRAYS, start, self.frozen)

    @staticmethod  # noqa: B027 - an optional hook
    def check_schedule(schedule: Schedule) -> None:
        """Raise ``ValueError`` if the transport cannot run ``schedule`` (called before
        any node is contacted); every schedule by default."""

    def check_plan(self, plan: Pipeline) -> None:  # noqa: B027 - an optional hook
        """Raise ``ValueError`` if the transport cannot run ``plan``; any by default."""

    @abstractmethod
    def run_round(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> RoundOutcome:
        """Train ``plan``'s stages for ``steps`` steps of round ``server_round`` from
        the global model ``arrays``.

        Raises
        ------
        SkyNodeError
            Naming (``nodes``, ``node_ids``) the nodes that failed, stalled or replied
            malformed.
        """


def merge_weights(  # noqa: PLR0913
    replies: Sequence[Message],
    ex: Exchange,
    expected: set[str],
    key: str,
    start: ArrayRecord | None = None,
    frozen: frozenset[str] | set[str] = frozenset(),
) -> tuple[ArrayRecord, int, int]:
    """Reassemble the pipeline's model from the stages' weight replies (record ``key``).

    A stage replies with its trainable parameters and buffers only: its ``frozen``
    parameters (``requires_grad=False``, :func:`sky_flower.pipeline.stage.frozen_keys`
    of the server's model) never change in training, so they are taken from ``start``,
    the model the round started from.

    Returns
    -------
    (ArrayRecord, int, int)
        The model (in ``start``'s key order where parameters are frozen), the bytes of weights the
        replies carried (:meth:`ArrayRecord.count_bytes`, summed over the replies) and
        the bytes the whole model takes in the same count: what the replies would carry
        under full fine-tuning.

    Raises
    ------
    SkyNodeError
        If a reply is an error or lacks its weights (naming its node), a layer tensor
        comes back twice or not at all, or of another shape or dtype than ``start``'s
        (naming its node), or a reply carries a parameter the server's model freezes
        (the nodes' and the server's ``model_fn`` disagree on what trains).
    ValueError
        If ``frozen`` is not empty and ``start`` is not given.
    """
    if frozen and start is None:
        raise ValueError("frozen parameters are taken from the round's start: give start")
    ex.raise_errors(replies)
    merged: dict[str, torch.Tensor] = {}
    sent = 0
    for reply in replies:
        rec = reply.content.array_records.get(key)
        src = reply.metadata.src_node_id
        if rec is None:
            raise ex.fail(f"{ex.name(src)}: reply lacks its weights", [src])
        sent += rec.count_bytes()
        for name in rec:  # a stage's tensor must fit the model's (start: the round's)
            want = start.get(name) if start is not None else None
            got = rec[name]
            if want is not None and (tuple(got.shape), got.dtype) != (
                tuple(want.shape),
                want.dtype,
            ):
                raise ex.fail(
                    f"{ex.name(src)}: returned {name} as {got.dtype} {tuple(got.shape)}, "
                    f"the model's is {want.dtype} {tuple(want.shape)}",
                    [src],
                )
        for name, value in rec.to_torch_state_dict().items():
            if name in merged:
                raise ex.fail(f"layer tensor {name} returned twice")
            if name in frozen:
                raise ex.fail(
                    f"{ex.name(src)}: reply carries {name}, a parameter the server's model "
                    "freezes (requires_grad=False): the nodes' and the server's model_fn "
                    "disagree on which parameters train",
                    [src],
                )
            merged[name] = value
    if frozen:  # the start's frozen entries, everything in the start's key order
        base = start.to_torch_state_dict()  # type: ignore[union-attr]
        merged.update({name: base[name] for name in frozen if name in base})
        merged = {name: merged[name] for name in base if name in merged} | merged
    if set(merged) != expected:
        missing = sorted(expected - set(merged))
        raise ex.fail(f"stages returned an incomplete model; missing {missing[:5]}")
    model = ArrayRecord(merged)
    return model, sent, model.count_bytes()
