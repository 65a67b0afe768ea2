"""Typed records of a round, written as the ``results.json`` rows they become.

:class:`RecordFields` is the base: a dataclass read by attribute
(``stage.measured_compute_s``) whose :meth:`RecordFields.to_dict` is the JSON-ready row
written to ``results.json``. :class:`StageRecord` is what a runner reports per stage
(:mod:`sky_flower.sky.rounds.records` holds the pipeline and round records).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def optional(default: Any = None) -> Any:  # noqa: ANN401 - a dataclasses.field
    """A field absent from the row (and from ``results.json``) while it is ``None``:
    what a transport or a failed round does not measure."""
    return field(default=default, metadata={"omit_none": True})


class RecordFields:
    """A dataclass record; its row (:meth:`to_dict`) has one key per field (a field made
    with :func:`optional` only while it is not ``None``), plus, for a field whose
    metadata has ``prefix``, one key per entry of that dict field (``test_accuracy``
    from ``test={"accuracy": ...}``)."""

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON-ready data (nested records and lists of them too)."""
        row: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if "prefix" in f.metadata:
                row.update({f"{f.metadata['prefix']}{k}": _plain(v) for k, v in value.items()})
            elif value is not None or not f.metadata.get("omit_none"):
                row[f.name] = _plain(value)
        return row


def _plain(value: Any) -> Any:  # noqa: ANN401 - any record value
    if isinstance(value, RecordFields):
        return value.to_dict()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass
class StageRecord(RecordFields):
    """One stage of one pipeline in a round: measured against predicted, per step
    (seconds; :mod:`sky_flower.sky.rounds.report` prints the columns a transport fills).

    Attributes
    ----------
    stage : int
        Its index in the pipeline.
    node : str
        The node that ran it.
    measured_compute_s : float
        Compute per step (emulated slowdown included).
    predicted_compute_s : float or None
        What the cost model predicted for it.
    median_compute_s : float or None
        Relay and stream: the median step's compute.
    messages, predicted_messages : float or None
        Relay and stream: messages (hops) per step, measured and predicted.
    measured_busy_s, predicted_busy_s : float or None
        Relay and stream: busy time per step (compute plus handling).
    median_step_s : float or None
        Direct: the median step's wall time on the stage.
    owner : str or None
        The data owner whose pipeline it is (set by the federated round).
    """

    stage: int
    node: str
    measured_compute_s: float
    predicted_compute_s: float | None = optional()
    median_compute_s: float | None = optional()
    messages: float | None = optional()
    predicted_messages: float | None = optional()
    measured_busy_s: float | None = optional()
    predicted_busy_s: float | None = optional()
    median_step_s: float | None = optional()
    owner: str | None = optional()
