"""How long the Sky server waits for each message, per phase of a run.

One ``failure.message_timeout_s`` for every message failed both ways: a node's first
message includes its start-up (a Ray actor, a ClientApp process, torch imports: seconds),
and a slow node's long stage may rightly take many times a fast node's. So each phase has
its own deadline (seconds from the push), and no deadline is below
``failure.message_timeout_s`` (the floor: an old config keeps at least the patience it
had):

==================  ====================================================================
first contact       a node's first message, start-up included: ``max(floor,
                    first_contact_s)`` (the benchmark's profile request, usually)
benchmark           profile and echo messages: ``max(floor, benchmark_s)``
set-up              ``train.sky_setup`` (the stage's weights): ``max(floor, setup_s)``
stage               each relay ``train.sky_forward`` / ``sky_backward``:
                    ``floor + stage_multiple x predicted`` (``predicted``: that stage's
                    per-message time as the cost model predicts it, the node's slowdown
                    included); a ``direct`` round's one message per stage: ``floor +
                    stage_multiple x steps x predicted step``
collect             ``train.sky_collect`` (the stage's weights back): ``max(floor,
                    collect_s)``
==================  ====================================================================

A slow but alive node is therefore not failed unless it exceeds its own scaled deadline.
``busy_wait_s`` bounds how long a push waits for a node still running a message that
timed out or was abandoned (:mod:`sky_flower.flower.exchange`) before failing it.

No torch or Flower is imported here.
"""

from __future__ import annotations

from sky_flower.sky.settings import DeadlineSettings

PHASES = ("benchmark", "setup", "stage", "collect")


def deadline(
    deadlines: DeadlineSettings, phase: str, floor_s: float, predicted_s: float = 0.0
) -> float:
    """The deadline (s) of a message of ``phase`` (one of :data:`PHASES`) under a run's
    ``deadlines`` settings group (see the module docstring).

    Parameters
    ----------
    deadlines : DeadlineSettings
        The run's ``deadlines.*`` (checked where the settings are read).
    phase : str
        ``benchmark``, ``setup``, ``stage`` or ``collect``.
    floor_s : float
        ``failure.message_timeout_s``: no deadline is shorter; a stage message's is this
        plus the scaled prediction.
    predicted_s : float
        ``stage`` only: the message's predicted seconds (>= 0; NaN or inf count as
        unknown, i.e. 0).

    Raises
    ------
    ValueError
        On an unknown phase.
    """
    if phase == "stage":
        pred = predicted_s if 0.0 <= predicted_s < float("inf") else 0.0
        return floor_s + deadlines.stage_multiple * pred
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}: one of {', '.join(PHASES)}")
    return max(floor_s, getattr(deadlines, f"{phase}_s"))


def stage_message_s(prediction: dict, latency_s: float = 0.0) -> float:
    """One relay stage message's predicted seconds from the stage's per-step prediction
    (:func:`sky_flower.sky.planning.planning.stage_predictions`: ``busy_s`` over ``messages``
    per step), plus its link's round-trip ``latency_s``."""
    messages = max(float(prediction.get("messages", 1) or 1), 1.0)
    return float(prediction.get("busy_s", 0.0)) / messages + max(latency_s, 0.0)
