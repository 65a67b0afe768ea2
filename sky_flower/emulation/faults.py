"""Fault injection for failure tests: a wrapper around a node's message handlers.

A fleet entry (:class:`sky_flower.emulation.devices.Emulation`) may set ``fail_on`` (a
message type), ``fail_mode``, ``fail_round``, ``fail_step`` and ``fail_delay_s``. The node
applies :func:`inject` around its handler only when its entry sets ``fail_on``; the
handlers themselves have no fault branches. A message is hit when its type is
``fail_on``, its round (``config["round"]``, else the message's group id) is
``fail_round`` (0 = every round) and, for a message about one step (a config record with
a ``step``: the relay's forward / backward), that step is ``fail_step``. Modes:

``raise``
    raise :class:`FaultInjected` instead of handling the message (Flower turns it into
    an error reply);
``malformed``
    handle it, then cut every array of the reply to one element (a reply of the wrong
    shape);
``nan``
    handle it, then fill every floating-point array and metric of the reply with NaN
    (a diverged node: a reply of the right shape whose values are not finite);
``late``
    handle it, then sleep ``fail_delay_s`` before replying (past the server's deadline
    when longer than it: the reply arrives late);
``crash`` / ``stall``
    mid-round, ``direct`` and ``stream`` transports: the handler's per-step hook
    (:func:`step_hook`)
    strikes before step ``fail_step``: ``crash`` leaves the round's process group at
    once (its sockets close, as when the process is killed) and raises; ``stall`` stops
    communicating for 1.5 x the round's ``timeout_s`` (or ``fail_delay_s`` if set), then
    raises. A handler that runs no steps (every relay message) never calls the hook:
    ``crash`` then loses the message (the handler's reply and state changes are
    dropped, the node raises as a crashed node's message fails), ``stall`` sleeps
    ``fail_delay_s`` first and then does the same.
"""

from __future__ import annotations

import contextvars
import copy
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from flwr.app import Context, Message, RecordDict

    from sky_flower.emulation.devices import Emulation

FAIL_MODES = ("raise", "malformed", "nan", "late", "crash", "stall")
MID_ROUND = ("crash", "stall")

StepHook = Callable[[int], None]
_STEP_HOOK: contextvars.ContextVar[StepHook | None] = contextvars.ContextVar(
    "sky_step_hook", default=None
)

H = TypeVar("H", bound=Callable[..., "RecordDict"])


class FaultInjected(RuntimeError):
    """Raised by a node whose fleet entry sets ``fail_on`` (for failure tests)."""


def fails_in(
    emu: Emulation, message_type: str, server_round: int | None, step: int | None = None
) -> bool:
    """True if node ``emu`` is configured to misbehave on ``message_type`` in this round
    (``server_round`` None: the round is not known, ``fail_round`` is ignored) and, for
    a message about one step, this ``step`` (None: not about one step)."""
    if not emu.fail_on or emu.fail_on != message_type:
        return False
    if step is not None and step != emu.fail_step:
        return False
    return emu.fail_round == 0 or server_round in (None, emu.fail_round)


def step_hook() -> StepHook | None:
    """The per-step hook of the message being handled (``crash`` / ``stall``), or None.

    A handler that runs steps (the ``direct`` stage) passes it on as its step callback.
    """
    return _STEP_HOOK.get()


def _mid_round(emu: Emulation, timeout_s: float, called: list[int]) -> StepHook:
    """The ``crash`` / ``stall`` fault of ``emu``, as a per-step hook (``called`` gets
    each step it is called for)."""
    if emu.fail_delay_s > 0:
        timeout_s = emu.fail_delay_s / 1.5

    def fault(step: int) -> None:
        called.append(step)
        if step != emu.fail_step:
            return
        if emu.fail_mode == "crash":
            import torch.distributed as dist

            if dist.is_initialized():  # direct: drop out at once, the peers' sockets close
                dist.destroy_process_group()  # (stream: raising closes the stage's stream)
            raise FaultInjected(f"node {emu.name!r}: crashed before step {step} (fault injected)")
        time.sleep(1.5 * timeout_s)
        raise FaultInjected(
            f"node {emu.name!r}: stalled {1.5 * timeout_s:g} s before step {step} (fault injected)"
        )

    return fault


def round_hook(
    emu: Emulation, message_type: str, server_round: int, timeout_s: float
) -> StepHook | None:
    """The per-step hook of round ``server_round`` inside a message that serves several
    rounds (a ``stream`` or ``direct`` stage session,
    :func:`sky_flower.sky.node.stage_session.serve_session`), or None: ``crash`` /
    ``stall`` as :func:`step_hook`'s (a stall lasts 1.5 x ``timeout_s``, the server's
    silence bound, or ``fail_delay_s``), ``raise`` strikes before step ``fail_step`` too.
    The other modes spoil the round's reply instead (:func:`spoil_reply`)."""
    if not fails_in(emu, message_type, server_round):
        return None
    if emu.fail_mode in MID_ROUND:
        return _mid_round(emu, timeout_s, [])
    if emu.fail_mode != "raise":
        return None

    def fault(step: int) -> None:
        if step == emu.fail_step:
            raise FaultInjected(
                f"node {emu.name!r}: fault injected on {message_type} in round {server_round} "
                "(fleet fail_on)"
            )

    return fault


def spoil_reply(emu: Emulation, message_type: str, server_round: int, content: RecordDict) -> None:
    """Round ``server_round``'s reply ``content`` of a message serving several rounds,
    spoiled in place as the fleet entry says (``malformed``, ``nan``; ``late`` sleeps
    ``fail_delay_s``); nothing for other modes or rounds."""
    if not fails_in(emu, message_type, server_round):
        return
    if emu.fail_mode == "late":
        time.sleep(emu.fail_delay_s)
    elif emu.fail_mode == "malformed":
        _malform(content)
    elif emu.fail_mode == "nan":
        _poison(content)


def _malform(content: RecordDict) -> None:
    """Cut every array of ``content`` to one element, in place."""
    from flwr.app import ArrayRecord

    for rec in content.array_records.values():
        for key in list(rec.keys()):
            rec[key] = ArrayRecord({key: torch.zeros(1)})[key]


def _poison(content: RecordDict) -> None:
    """Fill every floating-point array and metric of ``content`` with NaN, in place."""
    from flwr.app import ArrayRecord

    for rec in content.array_records.values():
        for key in list(rec.keys()):
            value = rec[key].numpy()
            if value.dtype.kind == "f":
                rec[key] = ArrayRecord({key: torch.full(value.shape, float("nan"))})[key]
    for rec in content.metric_records.values():
        for key, value in list(rec.items()):
            if isinstance(value, float):
                rec[key] = float("nan")


def _round_and_step(msg: Message) -> tuple[int | None, int | None]:
    """The round a message belongs to (``config["round"]``, else its numeric group id)
    and the step it is about (a config record's ``step``), None where it has none."""
    records = msg.content.config_records
    cfg = records.get("config")
    if cfg is not None and "round" in cfg:
        rnd: int | None = int(cfg["round"])  # type: ignore[arg-type]
    else:
        group = msg.metadata.group_id
        rnd = int(group) if group.isdigit() else None
    steps = [int(rec["step"]) for rec in records.values() if "step" in rec]  # type: ignore[arg-type]
    return rnd, (steps[0] if steps else None)


def inject(handler: H) -> H:
    """``handler`` (``(msg, context, emu) -> RecordDict``) with the fault of the node's
    fleet entry ``emu`` applied on the message type ``emu.fail_on`` (in round
    ``emu.fail_round``, 0 = every round, and step ``emu.fail_step`` of a message about
    one step: see the module docstring).

    Raises
    ------
    FaultInjected
        ``fail_mode="raise"`` (before the handler runs), or ``crash`` / ``stall`` from
        the step hook inside the handler (after it, for a handler that runs no steps).
    """
    return _Faulty(handler)  # type: ignore[return-value]


class _Faulty:
    """:func:`inject`'s wrapper: a module-level class, so that Flower's simulation
    engine can pickle the ClientApp that holds it (a closure would carry the
    unpicklable context variable with it)."""

    def __init__(self, handler: Callable[..., RecordDict]) -> None:
        self.handler = handler
        self.__name__ = getattr(handler, "__name__", "handler")

    def __call__(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        mtype = msg.metadata.message_type
        if not fails_in(emu, mtype, *_round_and_step(msg)):
            return self.handler(msg, context, emu)
        if emu.fail_mode == "raise":
            raise FaultInjected(f"node {emu.name!r}: fault injected on {mtype} (fleet fail_on)")
        if emu.fail_mode in MID_ROUND:
            return self._mid_round(msg, context, emu)
        content = self.handler(msg, context, emu)
        if emu.fail_mode == "late":
            time.sleep(emu.fail_delay_s)
        else:
            (_malform if emu.fail_mode == "malformed" else _poison)(content)
        return content

    def _mid_round(self, msg: Message, context: Context, emu: Emulation) -> RecordDict:
        """``crash`` / ``stall``: through the step hook, or around a handler without steps."""
        cfg = msg.content.config_records.get("config")
        timeout_s = float(cfg.get("timeout_s", 0.0)) if cfg is not None else 0.0  # type: ignore[arg-type]
        called: list[int] = []
        before = None if context is None else copy.deepcopy(context.state)
        token = _STEP_HOOK.set(_mid_round(emu, timeout_s, called))
        try:
            content = self.handler(msg, context, emu)
        finally:
            _STEP_HOOK.reset(token)
        if called:  # a handler with steps: the hook struck (or its step never came)
            return content
        if before is not None:  # a crashed node keeps none of the message's effects
            context.state = before
        mtype = msg.metadata.message_type
        if emu.fail_mode == "stall":
            time.sleep(emu.fail_delay_s)
            raise FaultInjected(
                f"node {emu.name!r}: stalled {emu.fail_delay_s:g} s on {mtype}, then failed "
                "(fault injected)"
            )
        raise FaultInjected(f"node {emu.name!r}: crashed on {mtype}, reply lost (fault injected)")
