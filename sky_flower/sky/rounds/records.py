"""The typed records of a Sky run's rounds: :class:`RoundRecord` (one per round,
trained or failed), its :class:`PipelineRecord` entries (one per data owner) and their
:class:`sky_flower.sky.transport.records.StageRecord` entries. The strategy, the
re-planner, recovery and the reports use their attributes; each also reads as the
mapping of its ``results.json`` row (``record["train_loss"]``), and
:meth:`RoundRecord.to_dict` is the JSON written there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sky_flower.sky.transport.records import RecordFields, StageRecord, optional

__all__ = ["PipelineRecord", "RoundRecord", "StageRecord"]


@dataclass
class PipelineRecord(RecordFields):
    """One data owner's pipeline in a round.

    Attributes
    ----------
    owner : str
        The data owner (stage 0).
    nodes : list of str
        The stages' nodes, in order.
    samples, steps, samples_trained : int
        The owner's examples, the steps planned, the samples trained this round.
    train_loss : float or None
        Its mean training loss (``None`` if it failed).
    predicted_time_s, measured_time_s, predicted_start_s, measured_start_s : float
        When it started and how long it ran, predicted and measured (s from the round's
        start; pipelines that share a node run one after another). In a round that set
        ``stream`` stage sessions up, the prediction carries their predicted set-up
        (:func:`sky_flower.sky.rounds.federation.predicted_setups`).
    predicted_step_time_s : float
        The cost model's step time.
    measured_step_time_s : float or None
        The median step's wall time (``None`` if it failed).
    error : str or None
        Why it failed.
    failed_nodes : list of str or None
        The nodes it failed on (absent unless it failed).
    """

    owner: str
    nodes: list[str]
    samples: int
    steps: int
    samples_trained: int
    train_loss: float | None
    predicted_time_s: float
    measured_time_s: float
    predicted_start_s: float
    measured_start_s: float
    predicted_step_time_s: float
    measured_step_time_s: float | None
    error: str | None = None
    failed_nodes: list[str] | None = optional()


@dataclass
class RoundRecord(RecordFields):
    """One round of a Sky run, trained or failed.

    Attributes
    ----------
    round : int
        The round (1-based).
    round_time_s : float
        Its wall time (s).
    train_loss, train_accuracy : float or None
        Over every sample trained (absent in a failed round).
    measured_step_time_s, predicted_step_time_s : float or None
        The slowest pipeline's median and predicted step time (s).
    steps, samples_trained : int or None
        The longest pipeline's steps; samples trained across pipelines.
    predicted_round_time_s : float or None
        The plan's round time (s); in a round that set ``stream`` stage sessions up,
        their predicted set-up included (once per session: the session's other rounds
        are charged none).
    weights_sent_bytes, full_weights_bytes : int or None
        Bytes of weights the finished pipelines' stages sent back this round (trainable
        parameters and buffers; frozen parameters stay on the server), and what they
        would have sent under full fine-tuning (every entry of the model), summed over
        the pipelines (:meth:`ArrayRecord.count_bytes`).
    microbatches_per_message, setup_s, wall_s : optional
        Transport figures (relay and stream: micro-batches per message; direct and
        stream: set-up and wall seconds), the largest over the pipelines.
    flower_messages, session_round : int or None
        ``stream``: Flower messages the round cost (set-up messages pushed and replies
        pulled; summed over the pipelines), and the round's place in its stage session
        (1: the session was set up for it; the largest over the pipelines).
    predicted_setup_s : float or None
        ``stream``: the cost model's set-up of the sessions this round set up (0: none;
        without sessions every round sets its stages up), against ``setup_s`` measured
        (the largest over the pipelines).
    stages : list of StageRecord or None
        Every pipeline's stages (each with its ``owner``).
    pipelines : list of PipelineRecord or None
        One per data owner.
    failed_pipelines : list of dict or None
        ``owner``, ``nodes``, ``error``, ``nonfinite_stages`` of each pipeline that
        failed in a round that trained.
    test : dict[str, float]
        The server's evaluation of the round's model (keys ``test_<metric>`` in the row).
    error : str or None
        A failed round: why (``round N failed: ...``).
    diverged : bool or str or None
        The training diverged (a failed round: ``True``; a round that trained with a
        pipeline that diverged: the reason).
    exception : Exception or None
        The error of a round that failed, before recovery records it (not in the row).
    """

    round: int
    round_time_s: float
    train_loss: float | None = optional()
    train_accuracy: float | None = optional()
    measured_step_time_s: float | None = optional()
    predicted_step_time_s: float | None = optional()
    steps: int | None = optional()
    samples_trained: int | None = optional()
    predicted_round_time_s: float | None = optional()
    weights_sent_bytes: int | None = optional()
    full_weights_bytes: int | None = optional()
    microbatches_per_message: int | None = optional()
    setup_s: float | None = optional()
    wall_s: float | None = optional()
    flower_messages: int | None = optional()
    session_round: int | None = optional()
    predicted_setup_s: float | None = optional()
    stages: list[StageRecord] | None = optional()
    pipelines: list[PipelineRecord] | None = optional()
    failed_pipelines: list[dict[str, Any]] | None = optional()
    test: dict[str, float] = field(default_factory=dict, metadata={"prefix": "test_"})
    error: str | None = optional()
    diverged: bool | str | None = optional()
    exception: Exception | None = field(default=None, metadata={"hidden": True})

    @property
    def trained(self) -> bool:
        """Whether the round trained (a failed round has no loss)."""
        return self.train_loss is not None
