"""Sky's log tables, formatted from the round records (the data in ``results.json``):
the per-round table and one per-stage table, measured against predicted, for every
transport (the columns are those the round's ``stages`` fill)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from logging import INFO

from flwr.serverapp.strategy import Result
from flwr.supercore import log

from sky_flower import tables
from sky_flower.core.partition import Plan
from sky_flower.sky.rounds.records import RoundRecord, StageRecord

# (StageRecord field, header, format) in display order
STAGE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("messages", "msgs", ".0f"),
    ("measured_compute_s", "compute s", ".4f"),
    ("predicted_compute_s", "predicted", ".4f"),
    ("measured_busy_s", "busy s", ".4f"),
    ("predicted_busy_s", "predicted", ".4f"),
    ("median_step_s", "median step s", ".4f"),
)
ROUND_COLUMNS = ("round", "train loss", "test acc", "step time (s)", "predicted (s)", "round (s)")


def compute_ratio(stage: StageRecord) -> str:
    """Measured over predicted compute of a stage (``"-"`` without a prediction): the
    calibration's check, per stage (it aims at 0.75-1.25)."""
    predicted = stage.predicted_compute_s
    return f"{stage.measured_compute_s / predicted:.2f}" if predicted else "-"


def stage_table(stages: Sequence[StageRecord]) -> str:
    """Per-stage table of a round's ``stages``: stage, node, then every column of
    :data:`STAGE_COLUMNS` the stages fill (seconds per step), and measured / predicted
    compute (``meas/pred``) where they predict it."""
    cols = [c for c in STAGE_COLUMNS if stages and getattr(stages[0], c[0]) is not None]
    ratio = bool(stages) and stages[0].predicted_compute_s is not None
    head = ["stage", "node", *(h for _, h, _ in cols)] + (["meas/pred"] if ratio else [])
    rows = [
        [st.stage, st.node, *(format(getattr(st, key), fmt) for key, _, fmt in cols)]
        + ([compute_ratio(st)] if ratio else [])
        for st in stages
    ]
    return tables.text(head, rows, align="rl")


def stage_report(row: RoundRecord, label: str) -> str:
    """A round's measured against predicted step time, then its per-stage table.

    ``label`` names the transport and schedule (e.g. ``"relay, gpipe"``)."""
    measured, predicted = row.measured_step_time_s, row.predicted_step_time_s
    head = (
        f"round {row.round} ({label}): step measured {measured:.4f} s, predicted "
        f"{predicted:.4f} s ({measured / predicted - 1:+.0%})"
    )
    if row.microbatches_per_message is not None:
        head += f"; {row.microbatches_per_message} micro-batch(es) per message"
    if row.setup_s is not None:
        head += f"; set-up {row.setup_s:.3f} s"
    return f"{head}\n{stage_table(row.stages or [])}"


def log_round_header() -> None:
    """Log the per-round table's header."""
    log(INFO, "%5s  %10s  %9s  %13s  %14s  %8s", *ROUND_COLUMNS)


def log_round(row: RoundRecord, label: str) -> None:
    """Log a round that trained: its line of the per-round table
    (:func:`log_round_line`), :func:`stage_report` (compute includes the emulated
    slowdown), :func:`pipeline_table` (FedAvg across the pipelines that finished), and
    where the row has them :func:`weights_sent_line` and :func:`session_line` (stream:
    the stage session's set-up and round times). ``label``: the transport and schedule."""
    log_round_line(row)
    log(
        INFO,
        "Measured vs predicted, per step (compute includes the emulated slowdown):\n%s",
        stage_report(row, label),
    )
    log(
        INFO,
        "Round %d, one pipeline per data owner (FedAvg across):\n%s",
        row.round,
        pipeline_table(row),
    )
    for line in (weights_sent_line(row), session_line(row)):
        if line is not None:
            log(INFO, "Round %d: %s", row.round, line)


def log_round_line(row: RoundRecord) -> None:
    """Log a round's line of the per-round table (``sky_flower.deploy`` reads it)."""
    acc = row.test.get("accuracy")
    log(
        INFO,
        "%5d  %10.4f  %9s  %13.4f  %14.4f  %8.1f",
        row.round,
        row.train_loss,
        "-" if acc is None else f"{acc:.4f}",
        row.measured_step_time_s,
        row.predicted_step_time_s,
        row.round_time_s,
    )


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"12.3 KiB"``, ``"1.2 MiB"``."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def weights_sent_line(row: RoundRecord) -> str | None:
    """The bytes of weights a round's replies carried, against full fine-tuning's where
    frozen parameters stayed home, e.g. ``"weights sent 12.3 KiB per round (full
    fine-tuning: 1.2 MiB, 1.0 %)"``; without the comparison where nothing is frozen (the
    run is full fine-tuning), ``"weights sent 1.2 MiB per round"``; None for a round
    without them (a failed round)."""
    sent, full = row.weights_sent_bytes, row.full_weights_bytes
    if sent is None or not full:
        return None
    if sent >= full:  # every entry sent: no frozen parameter, nothing to compare
        return f"weights sent {human_bytes(sent)} per round"
    return (
        f"weights sent {human_bytes(sent)} per round "
        f"(full fine-tuning: {human_bytes(full)}, {100 * sent / full:.1f} %)"
    )


def session_line(row: RoundRecord) -> str | None:
    """A ``stream`` round's stage-session figures: its place in the session, the
    Flower messages it cost, the session's set-up measured against predicted (in the
    round that set it up: charged once per session) and the round's time measured
    against predicted, e.g. ``"session: round 1 of the session, 3 Flower messages;
    set-up measured 18.200 s (predicted 17.500 s); round measured 20.100 s (predicted
    19.000 s)"``. None for a round without a session (another transport, sessions off,
    a failed round)."""
    if row.session_round is None:
        return None
    messages = row.flower_messages or 0
    line = (
        f"session: round {row.session_round} of the session, {messages} Flower "
        f"message{'' if messages == 1 else 's'}"
    )
    measured, predicted = row.setup_s or 0.0, row.predicted_setup_s or 0.0
    if measured > 0:  # a session was set up in this round
        line += f"; set-up measured {measured:.3f} s (" + (
            f"predicted {predicted:.3f} s)" if predicted > 0 else "not predicted)"
        )
    if row.predicted_round_time_s is not None:
        line += (
            f"; round measured {row.round_time_s:.3f} s (predicted "
            f"{row.predicted_round_time_s:.3f} s)"
        )
    return line


def pipeline_table(row: RoundRecord) -> str:
    """A round's pipelines (``row.pipelines``), one row each: owner, samples trained,
    steps, mean loss, predicted and measured time (s), and the error of one that failed."""
    head = ("owner", "trained", "steps", "loss", "predicted s", "measured s", "outcome")
    rows = [
        (
            p.owner,
            p.samples_trained,
            p.steps,
            tables.num(p.train_loss, ".4f"),
            f"{p.predicted_time_s:.2f}",
            f"{p.measured_time_s:.2f}",
            "ok" if p.error is None else f"FAILED (dropped from the average): {p.error}",
        )
        for p in row.pipelines or []
    ]
    return tables.text(head, rows, align="lrrrrrl")


def log_final(plans: Sequence[Plan], allocation: str, result: Result) -> None:
    """Log the plan and the final results the way Flower's ``Strategy.start`` ends
    (``Final results:`` and the ``Result``; ``sky_flower.deploy`` reads it), after
    Sky's own per-round table. ``plans``: one per data owner's pipeline."""
    log(INFO, "")
    for plan in plans:
        stages = ", ".join(f"{st.node} [{st.first_layer}-{st.last_layer}]" for st in plan.stages)
        log(INFO, "Plan (%s): %s", allocation, stages)
    log(INFO, "Final results:")
    log(INFO, "")
    for line in io.StringIO(str(result)):
        log(INFO, "\t%s", line.strip("\n"))
    log(INFO, "")
