"""The typed records of a Sky run: :class:`RoundRecord` (one per round, trained or
failed), its :class:`PipelineRecord` entries (one per data owner), their
:class:`sky_flower.sky.transport.records.StageRecord` entries and its
:class:`FailedPipeline` entries; :class:`FailedRound` and :class:`JoinRecord` (what
recovery did, who joined); :class:`RoundFailure` (a failure described, never an
exception) and :class:`RoundResult` (what a round returns). Readers use their
attributes; :meth:`RecordFields.to_dict` is the JSON written to ``results.json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sky_flower.sky.rounds.blame import Failure
from sky_flower.sky.transport.records import RecordFields, StageRecord, optional

__all__ = [
    "FailedPipeline",
    "FailedRound",
    "JoinRecord",
    "PipelineRecord",
    "RoundFailure",
    "RoundRecord",
    "RoundResult",
    "StageRecord",
    "pipelines_failure",
]


@dataclass(frozen=True)
class RoundFailure:
    """Why a round (or one pipeline) failed: its error described, not kept.

    Attributes
    ----------
    type, message : str
        The exception's class name (``SkyNodeError``, ``NonFiniteReply``) and text.
    stage : str
        Where it arose: ``pipeline`` (a runner), ``round`` (every pipeline of the
        round), ``guard`` (the round's aggregate or loss).
    nodes : tuple of str
        The nodes it names as the cause; ``node_ids`` their ids where known (``None``).
    nonfinite_stages : tuple of int
        The pipeline stages whose replies held ``NaN``/``inf`` (empty: another kind).
    pipelines : tuple of Failure or None
        The failed pipelines as :func:`sky_flower.sky.rounds.blame.judge` reads them
        (``None``: one pipeline's error, judged from the fields above and the fleet).
    diverged : str
        The guard's reason when the round's aggregate or loss failed (``""``: not).
    """

    type: str
    message: str
    stage: str = ""
    nodes: tuple[str, ...] = ()
    node_ids: tuple[int, ...] | None = None
    nonfinite_stages: tuple[int, ...] = ()
    pipelines: tuple[Failure, ...] | None = None
    diverged: str = ""

    def __str__(self) -> str:
        return self.message


@dataclass
class FailedRound(RecordFields):
    """What recovery did after a failed round (``failed_rounds``).

    Attributes
    ----------
    round : int
        The round.
    error : str
        Why it failed.
    dropped_nodes : list of str
        The nodes dropped for their own fault (a helper set aside: once the next round
        trained without it).
    set_aside : list of str or None
        Helpers set aside for the next round (non-finite output on finite input).
    diverged : bool or None
        The training diverged (nobody dropped).
    restored_nodes : list of str or None
        Helpers set aside earlier and put back (the training itself diverged).
    """

    round: int
    error: str
    dropped_nodes: list[str] = field(default_factory=list)
    set_aside: list[str] | None = optional()
    diverged: bool | None = optional()
    restored_nodes: list[str] | None = optional()


@dataclass
class JoinRecord(RecordFields):
    """A node that joined the run, or came back (``joins``).

    Attributes
    ----------
    round : int
        The round it joined before.
    node : str
        Its name.
    node_id : int
        Its Flower node id.
    rejoined : bool or None
        It was dropped earlier and is listed again.
    admitted : bool or None
        Whether a node that rejoined was admitted back (``replan.mode=off``: not).
    """

    round: int
    node: str
    node_id: int
    rejoined: bool | None = optional()
    admitted: bool | None = optional()


@dataclass
class FailedPipeline(RecordFields):
    """A pipeline that failed in a round that trained (``failed_pipelines``).

    Attributes
    ----------
    owner : str
        Its data owner.
    nodes : list of str
        The nodes that caused it.
    error : str
        Why it failed.
    nonfinite_stages : list of int
        Its stages whose replies held ``NaN``/``inf``.
    """

    owner: str
    nodes: list[str]
    error: str
    nonfinite_stages: list[int]

    def failure(self) -> Failure:
        """As :func:`sky_flower.sky.rounds.blame.judge` reads it."""
        return Failure(self.owner, tuple(self.nodes), tuple(self.nonfinite_stages))


def pipelines_failure(
    failed: Sequence[FailedPipeline], node_ids: Sequence[int] | None = None
) -> RoundFailure:
    """The failure of the pipelines ``failed``: one error naming every owner and node
    (``node_ids``: their Flower node ids where known), and each pipeline as
    :func:`sky_flower.sky.rounds.blame.judge` reads it."""
    text = "; ".join(f"pipeline of {f.owner} failed: {f.error}" for f in failed)
    nodes = tuple(sorted({n for f in failed for n in f.nodes}))
    ids = tuple(node_ids) if node_ids else None
    failures = tuple(f.failure() for f in failed)
    return RoundFailure("SkyNodeError", text, "round", nodes, ids, pipelines=failures)


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
    failed_pipelines : list of FailedPipeline or None
        Each pipeline that failed in a round that trained.
    test : dict[str, float]
        The server's evaluation of the round's model (keys ``test_<metric>`` in the row).
    error : str or None
        A failed round: why (``round N failed: ...``).
    diverged : bool or str or None
        The training diverged (a failed round: ``True``; a round that trained with a
        pipeline that diverged: the reason).
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
    failed_pipelines: list[FailedPipeline] | None = optional()
    test: dict[str, float] = field(default_factory=dict, metadata={"prefix": "test_"})
    error: str | None = optional()
    diverged: bool | str | None = optional()


@dataclass
class RoundResult:
    """What one round returns (:meth:`sky_flower.sky.rounds.executor.RoundExecutor.run`).

    Attributes
    ----------
    record : RoundRecord
        The round's record (a failed round: only ``round`` and ``round_time_s``).
    arrays : ArrayRecord or None
        The new global model (``None``: the round failed).
    failure : RoundFailure or None
        Why the round failed (``None``: it trained).
    """

    record: RoundRecord
    arrays: Any = None  # flwr.app.ArrayRecord
    failure: RoundFailure | None = None
