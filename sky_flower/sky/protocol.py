"""The Sky wire protocol: message types, record keys and typed configs, in one place.

Both sides import from here: the server (:mod:`sky_flower.strategies.sky`) builds its
messages with these names and dataclasses, the node (:mod:`sky_flower.sky.node.client`)
reads them back with the same ones, so a key cannot drift between the two.

Message types (``flwr`` allows ``train``/``evaluate``/``query`` + ``.action``):

====================  ==================================================================
:data:`PROFILE`       ``query.sky_profile``: time the node's layers (:class:`ProfileRequest`
                      in, :class:`ProfileReply` out)
:data:`ECHO`          ``query.sky_echo``: payload back (:class:`EchoRequest`)
:data:`SETUP`         ``train.sky_setup``: install this round's stage (:class:`StageConfig`
                      and the stage's weights under :data:`ARRAYS`)
:data:`FORWARD`       ``train.sky_forward``: forward of one micro-batch group
                      (:class:`MicroBatchGroup`; the last stage: loss and backward too;
                      ``sequential`` is one group of all ``M`` micro-batches)
:data:`BACKWARD`      ``train.sky_backward``: backward of one group from its stash
:data:`COLLECT`       ``train.sky_collect``: the stage's weights at the end of a round
:data:`DIRECT`        ``train.sky_direct``: a whole round peer to peer (:class:`DirectConfig`)
:data:`STREAM`        ``train.sky_stream``: a whole round over the server's stream endpoint
                      (:class:`StreamConfig`; :mod:`sky_flower.sky.transport.stream`)
:data:`STREAM_ECHO`   ``query.sky_stream_echo``: echo frames on the stream endpoint
                      (:class:`StreamLink`): the link over the data plane itself
====================  ==================================================================

Identity (idempotent delivery): every stage message says which set-up, step and
micro-batches it belongs to. ``train.sky_setup`` carries the round and a set-up
``session`` (:func:`new_session`: increasing over a server's set-ups, so a helper that two
owners' pipelines share in one round tells them apart) in its :class:`StageConfig`;
every forward / backward carries both again in its :class:`MicroBatchGroup` with the
step and the group; ``train.sky_collect`` and ``train.sky_direct`` carry them in their
:data:`CONFIG`. A node applies each identity once and answers a repeat with the first
reply (:mod:`sky_flower.sky.node.stage_state`).

Typed records: every config and figure is a frozen dataclass with the :class:`Record`
mixin, one flat ``ConfigRecord`` (or ``MetricRecord``) each way, every value type-checked
on the way in (:class:`ProtocolError` names the class and the key).

Record keys: a message's settings travel in the config record :data:`CONFIG`, stage
weights in the array record :data:`ARRAYS` (Flower's own name for a model's arrays),
activations / gradients / labels in array records :data:`ACT` / :data:`GRAD` /
:data:`LABELS` (each holding one array of the same name), figures in the metric record
:data:`METRICS`.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from flwr.app import ConfigRecord, MetricRecord

from sky_flower.pipeline.rendezvous import Rendezvous

# --- typed records ---------------------------------------------------------------------
# :class:`Record` is the mixin of every config and figure dataclass below: one flat
# ``ConfigRecord`` (or ``MetricRecord``) each way, nested dataclasses inlined, every value
# type-checked on the way in.


class ProtocolError(ValueError):
    """A record lacks a key of a protocol dataclass, or holds a value of the wrong type."""


R = TypeVar("R", bound="Record")


def _check(cls_name: str, key: str, hint: Any, value: Any) -> Any:
    """``value`` converted to ``hint`` (``int``, ``float``, ``str``, ``bool``,
    ``tuple[int, ...]``, ``tuple[float, ...]``, or one of these ``| None``).

    Raises
    ------
    ProtocolError
        If the value does not have that type (a bool is not an int; an int is a float).
    """
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if args and type(None) in args:  # X | None
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(
                f"{cls_name}: key {key!r} must be a list, got {type(value).__name__} {value!r}"
            )
        return tuple(_check(cls_name, f"{key}[{i}]", args[0], v) for i, v in enumerate(value))
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    if not ok:
        raise ProtocolError(
            f"{cls_name}: key {key!r} must be {hint.__name__}, got {type(value).__name__} {value!r}"
        )
    return float(value) if hint is float else value


def _flat(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a flat dict: nested dataclasses are inlined, tuples become
    lists, ``None`` values are left out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(value))
        elif value is not None:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _build(cls: type, rec: Mapping[str, Any], where: str = "") -> Any:
    """Instance of dataclass ``cls`` from the flat mapping ``rec`` (see :func:`_flat`);
    a missing key takes the field's default, if it has one; extra keys are ignored.
    ``where`` names the record in errors (default: the class)."""
    where = where or cls.__name__
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(hint, rec, f"{where}.{f.name}")
        elif f.name in rec:
            kwargs[f.name] = _check(where, f.name, hint, rec[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if type(None) in typing.get_args(hint):
                kwargs[f.name] = None
            else:
                raise ProtocolError(f"{where}: the record lacks key {f.name!r}")
    try:
        return cls(**kwargs)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as err:  # the dataclass's own checks
        raise ProtocolError(f"{where}: {err}") from err


class Record:
    """Mixin for the protocol's frozen dataclasses: one flat record each way.

    ``record_type`` is the Flower record class the dataclass travels as (a
    ``ConfigRecord``, or a ``MetricRecord`` for figures). Nested dataclass fields are
    inlined into the same record (their keys must not collide).
    """

    record_type: ClassVar[type] = ConfigRecord

    def to_record(self) -> Any:
        """This config as a flat Flower record (``record_type``)."""
        return self.record_type(_flat(self))

    def to_config_record(self) -> ConfigRecord:
        """This config as a flat ``ConfigRecord``."""
        return ConfigRecord(_flat(self))

    @classmethod
    def from_config_record(cls: type[R], rec: Mapping[str, Any]) -> R:
        """Read a config back from a record (a ``ConfigRecord``, ``MetricRecord`` or any
        mapping). Keys the dataclass does not know are ignored.

        Raises
        ------
        ProtocolError
            Naming the class and the key that is missing or holds a value of the wrong
            type, or what the dataclass's own checks refuse.
        """
        if rec is None:
            raise ProtocolError(f"{cls.__name__}: no record")
        return _build(cls, rec)

    from_record = from_config_record

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key of the flat record, nested dataclasses' included."""
        return tuple(_keys(cls))


def _keys(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        out.extend(_keys(hint) if dataclasses.is_dataclass(hint) else [f.name])
    return out


# --- message types ---------------------------------------------------------------------
PROFILE = "query.sky_profile"
ECHO = "query.sky_echo"
SETUP = "train.sky_setup"
FORWARD = "train.sky_forward"
BACKWARD = "train.sky_backward"
COLLECT = "train.sky_collect"
DIRECT = "train.sky_direct"
STREAM = "train.sky_stream"
STREAM_ECHO = "query.sky_stream_echo"
MESSAGE_TYPES = (PROFILE, ECHO, SETUP, FORWARD, BACKWARD, COLLECT, DIRECT, STREAM, STREAM_ECHO)

# --- record keys -----------------------------------------------------------------------
CONFIG = "config"  # ConfigRecord: the message's settings (the dataclasses below)
ARRAYS = "arrays"  # ArrayRecord: stage weights (setup, collect and direct, both ways)
METRICS = "metrics"  # MetricRecord: a reply's figures
PROFILE_KEY = "profile"  # ConfigRecord: a profile reply (ProfileReply)
PAYLOAD = "payload"  # ArrayRecord: echo payload (one array "p")
ACT = "act"  # ArrayRecord {"act": activations}, forward: stage k -> k + 1
GRAD = "grad"  # ArrayRecord {"grad": input gradient}, backward: stage k -> k - 1
LABELS = "labels"  # ArrayRecord {"labels": int64 labels}, stage 0 -> last stage
# ArrayRecord {"label_total": float64 0-d}: objective.reduction=weighted, the weight of the
# whole step's labels (sky_flower.pipeline.objective.LossReduction), stage 0 -> last stage
LABEL_TOTAL = "label_total"
MB = "mb"  # ConfigRecord: the micro-batch group of a forward / backward (MicroBatchGroup)
# ConfigRecord {"error": "<type>: <text>"}: a forward / backward reply whose stage raised
# (its model, loss or data): the stage's error, not the node's failure
STAGE_ERROR = "stage_error"
# ConfigRecord (SessionLink): a train.sky_direct that starts a direct stage session
SESSION = "session"
# ConfigRecord (StreamLink) in a query.sky_profile: transport=stream's benchmark round times
# the node's stream link in the same message (the node answers echo frames first)
LINK = "link"

# metric keys of the replies
LOSS = "loss"
CORRECT = "correct"
SAMPLES = "n"
COMPUTE_S = "compute_s"  # seconds of the stage's own compute (native, before slowdown)
BUSY_S = "busy_s"  # wall seconds inside the handler (added by the node's wrapper)
READY = "ready"  # setup's acknowledgement

# the last stage's objective, by reference (sky_flower.pipeline.objective)
DEFAULT_LOSS = "torch.nn.functional:cross_entropy"
DEFAULT_METRIC = "sky_flower.pipeline.objective:correct_count"


_SESSIONS = itertools.count(time.time_ns())
_SESSION_LOCK = threading.Lock()


def new_session() -> int:
    """A fresh set-up session, larger than every earlier one (from the clock in ns)."""
    with _SESSION_LOCK:
        return next(_SESSIONS)


def action(message_type: str) -> str:
    """The handler action of a message type: ``"train.sky_setup" -> "sky_setup"``."""
    return message_type.split(".", 1)[1]


def stage_error(err: BaseException) -> ConfigRecord:
    """The :data:`STAGE_ERROR` record of a stage's own exception: its type and first line."""
    lines = str(err).strip().splitlines()
    return ConfigRecord({"error": f"{type(err).__name__}: {lines[0] if lines else ''}"})


@dataclass(frozen=True)
class StageConfig(Record):
    """What a stage needs to know for a round (``train.sky_setup``'s :data:`CONFIG`).

    Attributes
    ----------
    stage : int
        Stage index ``k`` (0 = the data owner).
    first, last : int
        The stage's layers ``first..last`` (inclusive) of the model.
    is_first, is_last : bool
        Stage 0 (runs its own batches) / the last stage (loss and backward).
    microbatches : int
        ``M`` micro-batches per step.
    batch_size : int
        ``B`` samples per step (``B % M == 0``).
    optimizer : str
        Optimizer name (:func:`sky_flower.core.profile.default_optimizer_factory`).
    lr : float
        Learning rate.
    round : int
        Server round (seeds the data order).
    seed : int
        Run seed.
    loss : str
        ``"module:qualname"`` of the last stage's ``loss(output, labels) -> scalar``
        (:mod:`sky_flower.pipeline.objective`); default cross-entropy.
    metric : str
        ``"module:qualname"`` of the last stage's ``metric(output, labels) -> int``;
        default correct predictions. A node built with its own ``loss_fn`` /
        ``metric_fn`` uses those instead.
    reduction : str
        How the loss reduces over a micro-batch: ``mean``, ``sum`` or ``weighted``
        (:class:`sky_flower.pipeline.objective.LossReduction`).
    weight : str
        ``weighted``: ``"module:qualname"`` of ``weight(labels) -> number``; else
        ``"-"`` (Flower cannot count the bytes of an empty string in a ConfigRecord).
    session : int
        The set-up's session (:func:`new_session`; 0: none given): with ``round``, the
        identity every message of this set-up carries.
    """

    stage: int
    first: int
    last: int
    is_first: bool
    is_last: bool
    microbatches: int
    batch_size: int
    optimizer: str
    lr: float
    round: int
    seed: int
    loss: str = DEFAULT_LOSS
    metric: str = DEFAULT_METRIC
    session: int = 0
    reduction: str = "mean"
    weight: str = "-"

    def __post_init__(self) -> None:
        if not 0 <= self.first <= self.last:
            raise ProtocolError(f"StageConfig: layers {self.first}..{self.last} are no range")
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ProtocolError(
                f"StageConfig: batch_size {self.batch_size} is not divisible into "
                f"{self.microbatches} micro-batches"
            )


@dataclass(frozen=True)
class SessionId(Record):
    """Which set-up a message belongs to: the server ``round`` and the set-up's
    ``session`` (:func:`new_session`). :data:`COLLECT`'s :data:`CONFIG`."""

    round: int
    session: int = 0


@dataclass(frozen=True)
class MicroBatchGroup(Record):
    """The micro-batches a :data:`FORWARD` / :data:`BACKWARD` message is about
    (record :data:`MB`): ``first .. first + count - 1`` of step ``step`` of the set-up
    ``(round, session)`` (its :class:`StageConfig`'s). The ``sequential`` relay sends
    one group of all ``M``."""

    step: int
    first: int
    count: int
    round: int
    session: int = 0

    def check(self, microbatches: int) -> None:
        """Raise :class:`ProtocolError` unless the group lies inside ``M`` micro-batches."""
        if self.count < 1 or self.first < 0 or self.first + self.count > microbatches:
            raise ProtocolError(
                f"micro-batches {self.first}..{self.first + self.count - 1} are outside "
                f"the step's {microbatches}"
            )


@dataclass(frozen=True)
class ProfileRequest(Record):
    """``query.sky_profile``'s :data:`CONFIG`: how to time the node's layers.

    ``optimizer`` None: no optimizer step nor state round trip is timed."""

    input_shape: tuple[int, ...]
    microbatch_size: int
    warmup: int
    repeats: int
    optimizer: str | None = None
    lr: float = 0.0
    input_dtype: str = "float32"  # of the model's input (int64 for token ids)
    calibrate: bool = False  # also time the direct step's calibration (issue 16)


NO_HOST = "-"  # ProfileReply.host not measured (Flower cannot count an empty string's bytes)


@dataclass(frozen=True)
class ProfileReply(Record):
    """A node's benchmark (record :data:`PROFILE_KEY` of the reply). Times in seconds
    per micro-batch and layer, already scaled by the node's ``1 + slowdown``."""

    name: str
    holds_data: bool
    num_examples: int
    memory_bytes: int
    slowdown: float
    emulation: str
    link_latency_s: float
    link_bandwidth_bps: float
    layer_fwd_s: tuple[float, ...]
    layer_bwd_s: tuple[float, ...]
    layer_step_s: tuple[float, ...]
    state_rebuild_s_per_byte: float = 0.0
    state_save_s_per_byte: float = 0.0
    # calibration (issue 16; sky_flower.pipeline.calibrate), 0 / "" when not measured
    microbatch_overhead_s: float = 0.0
    peer_latency_s: float = 0.0
    host: str = NO_HOST
    host_parallelism: float = 0.0
    # where the node's stages compute (issue 31, sky_flower.pipeline.device): the times
    # and memory above are this device's; an older node's reply lacks them (the CPU)
    device: str = "cpu"
    device_name: str = NO_HOST
    # the ClientApps Flower's simulation runtime runs at once (its Ray actor pool,
    # sky_flower.flower.runtime.simulation_workers); 0: not known (a SuperNode)
    runtime_workers: int = 0


@dataclass(frozen=True)
class EchoRequest(Record):
    """``query.sky_echo``'s :data:`CONFIG`: ``store_bytes > 0`` first stores a probe of
    that size in the node's ``context.state``, ``< 0`` removes it."""

    store_bytes: int = 0


@dataclass(frozen=True)
class DirectLinks(Record):
    """Emulated links of a ``direct`` stage (seconds, bytes/s; 0 = none): its own, its
    next stage's and its previous stage's NIC."""

    link_latency_s: float = 0.0
    link_bandwidth_bps: float = 0.0
    next_latency_s: float = 0.0
    next_bandwidth_bps: float = 0.0
    prev_latency_s: float = 0.0
    prev_bandwidth_bps: float = 0.0


@dataclass(frozen=True)
class DirectConfig(Record):
    """``train.sky_direct``'s :data:`CONFIG`: a stage's whole round, peer to peer.

    Flattened into one record with the keys of :class:`StageConfig`,
    :class:`sky_flower.pipeline.direct.Rendezvous` (whose defaults hold when a key is
    absent) and :class:`DirectLinks`.
    """

    stage: StageConfig
    rendezvous: Rendezvous
    links: DirectLinks
    kind: str
    steps: int
    input_shape: tuple[int, ...]
    node_id: int
    input_dtype: str = "float32"  # of this stage's input (the model's input on stage 0)
    # interleaved / zero_bubble: this rank's chunks as flat (chunk, first, last) triples
    # and their input shapes as flat (ndim, dims...) runs, integers separated by spaces;
    # "-" = the one stage above (Flower 1.42's ConfigRecord.count_bytes raises on an
    # empty list and on an empty string)
    chunk_layers: str = "-"
    chunk_shapes: str = "-"


@dataclass(frozen=True)
class StreamLink(Record):
    """How a node reaches the round's stream endpoint (:mod:`sky_flower.sky.transport.channel`):
    ``address`` (``host:port``), its ``ticket`` (fresh per endpoint), the SHA-256
    ``fingerprint`` (hex) and PEM ``cert_pem`` of the endpoint's certificate (both
    ``"-"``: plaintext, an insecure run), the frame cap ``max_frame_bytes`` and
    ``timeout_s``, the bound on the whole call (s). :data:`STREAM_ECHO`'s :data:`CONFIG`.
    """

    address: str
    ticket: str
    fingerprint: str
    cert_pem: str
    max_frame_bytes: int
    timeout_s: float


@dataclass(frozen=True)
class StreamConfig(Record):
    """``train.sky_stream``'s :data:`CONFIG`: a stage's whole round on the server's
    stream endpoint, flattened into one record with the keys of :class:`StageConfig`
    and :class:`StreamLink`; ``steps`` of the round, ``node_id`` it is planned for.
    ``across_rounds``: a stage session (:mod:`sky_flower.sky.transport.session`): the
    stage serves every round the server drives over its stream until ``close``;
    ``silence_s``: the server's silence bound (``stream-timeout-s``; an injected stall
    lasts 1.5 x it)."""

    stage: StageConfig
    link: StreamLink
    steps: int
    node_id: int
    input_dtype: str = "float32"
    across_rounds: bool = False
    silence_s: float = 0.0


@dataclass(frozen=True)
class SessionLink(Record):
    """A ``train.sky_direct`` message's :data:`SESSION` record: it starts a ``direct``
    stage session (:mod:`sky_flower.sky.transport.session`). ``link``: the session's
    control stream to the server's endpoint (the round's ``begin`` in, the stage's
    ``end`` with its weights out; activations and gradients stay peer to peer);
    ``silence_s``: the peers' bound (``direct-timeout-s``; an injected stall lasts
    1.5 x it)."""

    link: StreamLink
    silence_s: float = 0.0


def starts_session(content: Mapping[str, Any]) -> bool:
    """Whether a message's ``content`` (a ``RecordDict``) starts a stage session: a
    :class:`StreamConfig` with ``across_rounds``, or a :data:`SESSION` record (a
    ``direct`` stage's control link). Such a message serves many rounds."""
    if content.get(SESSION) is not None:
        return True
    cfg = content.get(CONFIG)
    return bool(cfg is not None and cfg.get("across_rounds", False))


@dataclass(frozen=True)
class StepMetrics(Record):
    """The last stage's figures for one forward message (:data:`METRICS`)."""

    record_type: ClassVar[type] = MetricRecord
    loss: float
    correct: int
    n: int
    compute_s: float

    def __post_init__(self) -> None:
        # n: the micro-batch's labels counted (at least one); correct: those hit
        if self.n < 1 or not 0 <= self.correct <= self.n:
            raise ProtocolError(
                f"StepMetrics: n={self.n} labels and correct={self.correct} are no count "
                "(need n >= 1 and 0 <= correct <= n)"
            )


@dataclass(frozen=True)
class DirectMetrics(Record):
    """A ``direct`` stage's figures for its round (:data:`METRICS`)."""

    record_type: ClassVar[type] = MetricRecord
    losses: tuple[float, ...]
    correct: int
    n: int
    step_times_s: tuple[float, ...]
    setup_s: float
    compute_s: float

    def __post_init__(self) -> None:
        if self.n < 0 or not 0 <= self.correct <= self.n:  # n: 0 on all but the last stage
            raise ProtocolError(
                f"DirectMetrics: n={self.n} samples and correct={self.correct} are no count "
                "(need n >= 0 and 0 <= correct <= n)"
            )


RECORDS = (
    StageConfig,
    SessionId,
    MicroBatchGroup,
    ProfileRequest,
    ProfileReply,
    EchoRequest,
    DirectLinks,
    DirectConfig,
    StreamLink,
    StreamConfig,
    StepMetrics,
    DirectMetrics,
)
