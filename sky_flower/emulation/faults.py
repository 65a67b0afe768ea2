"""Fault injection for failure tests: a wrapper around a node's message handlers.

A fleet entry (:class:`sky_flower.emulation.devices.Emulation`) may set ``fail_on`` (a
message type), ``fail_mode``, ``fail_round`` and ``fail_step``. The node applies
:func:`inject` around its handler only when its entry sets ``fail_on``; the handlers
themselves have no fault branches. Modes:

``raise``
    raise :class:`FaultInjected` instead of handling the message (Flower turns it into
    an error reply);
``malformed``
    handle it, then cut every array of the reply to one element (a reply of the wrong
    shape);
``crash`` / ``stall``
    mid-round, ``direct`` transport: the handler's per-step hook (:func:`step_hook`)
    strikes before step ``fail_step``: ``crash`` leaves the round's process group at
    once (its sockets close, as when the process is killed) and raises; ``stall`` stops
    communicating for 1.5 x the round's ``timeout_s``, then raises.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from flwr.app import Context, Message, RecordDict

    from sky_flower.emulation.devices import Emulation

FAIL_MODES = ("raise", "malformed", "crash", "stall")
MID_ROUND = ("crash", "stall")

StepHook = Callable[[int], None]
_STEP_HOOK: contextvars.ContextVar[StepHook | None] = contextvars.ContextVar(
    "sky_step_hook", default=None
)

H = TypeVar("H", bound=Callable[..., "RecordDict"])


class FaultInjected(RuntimeError):
    """Raised by a node whose fleet entry sets ``fail_on`` (for failure tests)."""


def fails_in(emu: Emulation, message_type: str, server_round: int | None) -> bool:
    """True if node ``emu`` is configured to misbehave on ``message_type`` in this round
    (``server_round`` None: the round is not known, ``fail_round`` is ignored)."""
    if not emu.fail_on or emu.fail_on != message_type:
        return False
    return emu.fail_round == 0 or server_round in (None, emu.fail_round)


def step_hook() -> StepHook | None:
    """The per-step hook of the message being handled (``crash`` / ``stall``), or None.

    A handler that runs steps (the ``direct`` stage) passes it on as its step callback.
    """
    return _STEP_HOOK.get()


def _mid_round(emu: Emulation, timeout_s: float) -> StepHook:
    """The ``crash`` / ``stall`` fault of ``emu``, as a per-step hook."""

    def fault(step: int) -> None:
        if step != emu.fail_step:
            return
        if emu.fail_mode == "crash":
            import torch.distributed as dist

            dist.destroy_process_group()  # drop out at once: the peers' sockets close
            raise FaultInjected(f"node {emu.name!r}: crashed before step {step} (fault injected)")
        time.sleep(1.5 * timeout_s)
        raise FaultInjected(
            f"node {emu.name!r}: stalled {1.5 * timeout_s:g} s before step {step} (fault injected)"
        )

    return fault


def _malform(content: RecordDict) -> None:
    """Cut every array of ``content`` to one element, in place."""
    from flwr.app import ArrayRecord

    for rec in content.array_records.values():
        for key in list(rec.keys()):
            rec[key] = ArrayRecord({key: torch.zeros(1)})[key]


def inject(handler: H) -> H:
    """``handler`` (``(msg, context, emu) -> RecordDict``) with the fault of the node's
    fleet entry ``emu`` applied on the message type ``emu.fail_on`` (in round
    ``emu.fail_round``, read from the message's ``config["round"]``; 0 = every round).

    Raises
    ------
    FaultInjected
        ``fail_mode="raise"`` (before the handler runs), or ``crash`` / ``stall`` from
        the step hook inside the handler.
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
        cfg = msg.content.config_records.get("config")
        rnd = int(cfg["round"]) if cfg is not None and "round" in cfg else None
        mtype = msg.metadata.message_type
        if not fails_in(emu, mtype, rnd):
            return self.handler(msg, context, emu)
        if emu.fail_mode == "raise":
            raise FaultInjected(f"node {emu.name!r}: fault injected on {mtype} (fleet fail_on)")
        if emu.fail_mode in MID_ROUND:
            timeout_s = float(cfg.get("timeout_s", 0.0)) if cfg is not None else 0.0
            token = _STEP_HOOK.set(_mid_round(emu, timeout_s))
            try:
                return self.handler(msg, context, emu)
            finally:
                _STEP_HOOK.reset(token)
        content = self.handler(msg, context, emu)
        _malform(content)
        return content
