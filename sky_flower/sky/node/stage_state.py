"""A stage's state as Flower records: what every stage message rebuilds and saves, and
what it has applied.

Every relay stage message rebuilds its stage from the ``context.state`` records (weights
and buffers, optimizer state; records only, so this also works where each message runs
in a fresh process) and the messages that step the optimizer save them back
(:class:`sky_flower.sky.node.client.SkyClient`).

Idempotent delivery: every stage message carries its identity (:class:`Identity`: kind,
round, set-up session, step, micro-batch group; :mod:`sky_flower.sky.protocol`). The
node records in ``context.state`` (:data:`APPLIED`) the set-up and step it is at and the
identities of that step it has applied, with their replies (:data:`REPLY`; only the
current step's, and the set-up's). :func:`replay` answers a repeat with the first
reply, never applying it again; a message older than the node's set-up or step is
refused (a :data:`~sky_flower.sky.protocol.STAGE_ERROR` reply,
:class:`StaleMessageError`), not applied; a step message of a set-up the node never
received raises :class:`NodeStateError` (the node missed a message).
``train.sky_collect`` only reads the weights: it is checked, not recorded. A
``train.sky_direct`` round (which keeps no stage state on the node) runs once per
set-up: a repeat is refused (:func:`direct_repeat`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from torch import nn

from sky_flower.core.clock import synchronize
from sky_flower.core.profile import as_layers
from sky_flower.pipeline.objective import LossReduction, loss_reduction
from sky_flower.pipeline.stage import (
    build_stage,
    make_stage_optimizer,
    optimizer_from_tensors,
    optimizer_to_tensors,
)
from sky_flower.sky import protocol as P

APPLIED = "sky.applied"  # ConfigRecord {round, session, step, ids}: what the stage applied
REPLY = "sky.reply."  # + "<identity key>|<record key>": a record of an applied message's reply
DIRECT_RAN = "sky.direct.ran"  # ConfigRecord {round, session}: the last direct round run
SESSIONS_RAN = "sky.sessions.ran"  # ConfigRecord {ids}: the stage sessions this node started
SESSIONS_KEPT = 64  # how many of them it remembers


class NodeStateError(RuntimeError):
    """This node lacks the state a stage message needs (it restarted, or missed a
    message): the node's failure, unlike an error of the stage's own computation."""


class StaleMessageError(RuntimeError):
    """A stage message older than what this node has applied (an earlier set-up or
    step, or a ``train.sky_direct`` round already run): refused, not applied."""


def stage_reduction(st: P.StageConfig) -> LossReduction:
    """How the objective's loss reduces over a micro-batch, as the stage config says
    (``reduction``; ``weight`` for ``weighted``, ``"-"`` for none): every transport's
    last stage scales its loss with it (docs/models.md)."""
    return loss_reduction(st.reduction, "" if st.weight == "-" else st.weight)


def save_stage(
    module: nn.Module, opt: torch.optim.Optimizer | None
) -> tuple[ArrayRecord, ArrayRecord]:
    """A stage as records: its weights and its optimizer's state tensors (none for a
    stage without parameters), copied to the CPU from the stage's device."""
    weights = ArrayRecord({k: v.detach().cpu() for k, v in module.state_dict().items()})
    return weights, ArrayRecord(optimizer_to_tensors(opt) if opt is not None else {})


def load_stage(
    model_fn: Callable[[], nn.Module],
    first: int,
    last: int,
    records: tuple[ArrayRecord, ArrayRecord | None],
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    device: torch.device | str = "cpu",
) -> tuple[nn.Sequential, torch.optim.Optimizer | None]:
    """Layers ``first..last`` rebuilt on ``device`` from ``records`` (weights, optimizer
    state or None for a fresh optimizer) as :func:`save_stage` wrote them; no optimizer
    for layers without trainable parameters."""
    weights, optim = records
    module = build_stage(model_fn, first, last, weights.to_torch_state_dict(), device)
    opt = make_stage_optimizer(module, make_opt)
    if optim is not None and opt is not None:
        optimizer_from_tensors(opt, optim.to_torch_state_dict())
    return module, opt


def time_state_roundtrip(
    model_fn: Callable[[], nn.Module],
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    repeats: int = 3,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """What a stage message spends on its own state, per byte of weights + optimizer
    state: ``(rebuild, save)`` seconds per byte. Every stage message rebuilds its stage
    from the ``context.state`` records (weights, optimizer tensors); messages that
    step the optimizer save them back as records. Timed on the
    whole model, median of ``repeats``, the stage rebuilt on ``device`` (the copies to
    and from it included)."""
    import statistics

    last = len(as_layers(model_fn())) - 1
    stage = build_stage(model_fn, 0, last, device=device)
    opt = optimizer_factory([p for p in stage.parameters() if p.requires_grad])
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # populate the optimizer state
    weights, state = save_stage(stage, opt)
    nbytes = max(weights.count_bytes() + state.count_bytes(), 1)
    rebuild, save = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        module, opt2 = load_stage(model_fn, 0, last, (weights, state), optimizer_factory, device)
        synchronize(device)
        t1 = time.perf_counter()
        weights, state = save_stage(module, opt2)
        save.append(time.perf_counter() - t1)
        rebuild.append(t1 - t0)
    return statistics.median(rebuild) / nbytes, statistics.median(save) / nbytes


# --- idempotent delivery ---------------------------------------------------------------
@dataclass(frozen=True)
class Identity:
    """What a stage message is: its handler ``kind`` (``sky_setup``, ``sky_forward``,
    ``sky_backward``, ``sky_collect``), its set-up ``(round, session)``, and for a
    forward / backward its ``step`` and micro-batches ``first .. first + count - 1``
    (``step`` -1: the set-up itself)."""

    kind: str
    round: int
    session: int
    step: int = -1
    first: int = 0
    count: int = 0

    @property
    def setup(self) -> tuple[int, int]:
        """``(round, session)``: the set-up the message belongs to (ordered)."""
        return self.round, self.session

    def key(self) -> str:
        """Its key among the applied identities of one set-up."""
        return f"{self.step}:{self.kind}:{self.first}:{self.count}"

    def __str__(self) -> str:
        text = f"train.{self.kind} of round {self.round} (set-up {self.session})"
        if self.step >= 0:
            text += f", step {self.step}, micro-batches {self.first}..{self.first + self.count - 1}"
        return text


def identity(msg: Message) -> Identity | None:
    """The identity of a relay stage message; None for the other message types (and a
    collect without one).

    Raises
    ------
    ProtocolError
        If its config or micro-batch record is malformed.
    """
    mtype, records = msg.metadata.message_type, msg.content.config_records
    kind = mtype.split(".", 1)[-1]
    if mtype == P.SETUP:
        st = P.StageConfig.from_config_record(records.get(P.CONFIG))
        return Identity(kind, st.round, st.session)
    if mtype in (P.FORWARD, P.BACKWARD):
        g = P.MicroBatchGroup.from_config_record(records.get(P.MB))
        return Identity(kind, g.round, g.session, g.step, g.first, g.count)
    if mtype == P.COLLECT and P.CONFIG in records:
        sid = P.SessionId.from_config_record(records[P.CONFIG])
        return Identity(kind, sid.round, sid.session)
    return None


def replay(msg: Message, context: Context) -> RecordDict | None:
    """The reply to ``msg`` if it must not be applied: the first reply of a repeat, a
    :data:`~sky_flower.sky.protocol.STAGE_ERROR` refusal (:class:`StaleMessageError`)
    of a message older than the node's set-up or step; None if it is new.

    Raises
    ------
    NodeStateError
        If ``msg`` is a step message of a set-up this node never received.
    ProtocolError
        If its identity is malformed.
    """
    ident = identity(msg)
    applied = context.state.config_records.get(APPLIED)
    if ident is None or applied is None:
        return None
    at = (int(applied["round"]), int(applied["session"]))
    step = int(applied["step"])
    where = f"round {at[0]} (set-up {at[1]})" + (f", step {step}" if step >= 0 else "")
    if ident.setup > at:
        if ident.kind == P.action(P.SETUP):
            return None
        raise NodeStateError(f"{ident} arrived, but this node holds the stage of {where}")
    if ident.key() in applied["ids"] and ident.setup == at:  # a repeat: the first reply
        prefix = f"{REPLY}{ident.key()}|"
        return RecordDict(
            {k[len(prefix) :]: v for k, v in context.state.items() if k.startswith(prefix)}
        )
    older_step = ident.step < step and ident.kind != P.action(P.COLLECT)
    if ident.setup < at or older_step:
        err = StaleMessageError(
            f"{ident} is older than what this node has applied ({where}): refused, not applied"
        )
        return RecordDict({P.STAGE_ERROR: P.stage_error(err)})
    return None


def remember(msg: Message, context: Context, reply: RecordDict) -> None:
    """Record that ``msg`` was applied and keep its ``reply`` for a repeat: the replies
    of the set-up and of its current step only (older ones are dropped)."""
    ident = identity(msg)
    if ident is None or ident.kind == P.action(P.COLLECT):  # read-only: nothing to keep
        return
    applied = context.state.config_records.get(APPLIED)
    keep: list[str] = []
    step = ident.step
    if applied is not None and (int(applied["round"]), int(applied["session"])) == ident.setup:
        step = max(step, int(applied["step"]))
        keep = [i for i in applied["ids"] if int(i.split(":", 1)[0]) in (-1, step)]
    for key in [k for k in context.state.keys() if k.startswith(REPLY)]:
        if key[len(REPLY) :].split("|", 1)[0] not in keep:
            del context.state[key]
    keep.append(ident.key())
    for name, record in reply.items():
        context.state[f"{REPLY}{ident.key()}|{name}"] = record
    context.state[APPLIED] = ConfigRecord(
        {"round": ident.round, "session": ident.session, "step": step, "ids": keep}
    )


def direct_repeat(st: P.StageConfig, context: Context) -> RecordDict | None:
    """A :data:`~sky_flower.sky.protocol.STAGE_ERROR` refusal of a ``train.sky_direct``
    whose set-up (``st.round``, ``st.session``) is not newer than the last one this node
    ran (a repeat, or a stale message); None if it is new. A direct round keeps no
    stage state on the node (its weights travel in the reply only), so a repeat cannot
    be answered with its first reply: it is refused, never run twice."""
    ran = context.state.config_records.get(DIRECT_RAN)
    if ran is None or (st.round, st.session) > (int(ran["round"]), int(ran["session"])):
        return None
    err = StaleMessageError(
        f"train.sky_direct of round {st.round} (set-up {st.session}): this node already "
        f"ran round {int(ran['round'])} (set-up {int(ran['session'])}); a repeat is "
        "refused, not run again"
    )
    return RecordDict({P.STAGE_ERROR: P.stage_error(err)})


def direct_ran(st: P.StageConfig, context: Context) -> None:
    """Record that this node ran the ``train.sky_direct`` round of ``st``'s set-up."""
    context.state[DIRECT_RAN] = ConfigRecord({"round": st.round, "session": st.session})


def session_repeat(st: P.StageConfig, context: Context) -> RecordDict | None:
    """A :data:`~sky_flower.sky.protocol.STAGE_ERROR` refusal of a stage session's
    set-up (``train.sky_stream`` with ``across_rounds``) this node has started before (a
    repeat of its message: it is refused, never run twice); None if it is new. Sessions
    of several pipelines run on one node at once, so they are told apart by their own
    ``st.session``, not ordered by round."""
    ran = context.state.config_records.get(SESSIONS_RAN)
    if ran is None or str(st.session) not in list(ran["ids"]):  # type: ignore[arg-type]
        return None
    err = StaleMessageError(
        f"the stage session {st.session} (stage {st.stage}, from round {st.round}) already "
        "ran on this node; a repeat is refused, not run again"
    )
    return RecordDict({P.STAGE_ERROR: P.stage_error(err)})


def session_ran(st: P.StageConfig, context: Context) -> None:
    """Record that this node started the stage session ``st.session`` (the last
    :data:`SESSIONS_KEPT`)."""
    ran = context.state.config_records.get(SESSIONS_RAN)
    ids = [str(i) for i in ran["ids"]] if ran is not None else []  # type: ignore[union-attr]
    context.state[SESSIONS_RAN] = ConfigRecord({"ids": [*ids, str(st.session)][-SESSIONS_KEPT:]})
