"""What the Sky strategy does when a round's pipelines fail: record the round, end the
run after ``max_failed_rounds`` failed rounds in a row, else act on the verdict of
:func:`sky_flower.sky.rounds.blame.judge`: drop the nodes whose own fault it was (silence, an
error or malformed reply, a crash) and re-plan; set aside for one round a helper whose
output alone went non-finite (dropped if the next round trains without it, put back if
it goes non-finite again); or, when the training diverged, drop nobody and say so,
naming the learning rate and the round. A data owner is never dropped (stage 0 of its
pipeline needs its data). One part of :class:`sky_flower.strategies.sky.SkyStrategy`
(:class:`Recovery`): it decides (:meth:`Recovery.decide` returns the verdict) and keeps
which helpers are set aside; the strategy's loop changes the fleet and re-plans."""

from __future__ import annotations

from collections.abc import Sequence
from logging import WARNING
from typing import Any

from flwr.supercore import log

from sky_flower.core.profile import NodeProfile
from sky_flower.sky.rounds.blame import Failure, Verdict, diverged_text, judge
from sky_flower.sky.rounds.records import FailedRound, RoundFailure
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.guard import NonFiniteReply
from sky_flower.sky.transport.runner import SkyNodeError


class TrainingDiverged(SkyNodeError):
    """The run ended because its training diverged (``max_failed_rounds`` diverged or
    failed rounds in a row): no node is to blame (``nodes`` and ``node_ids`` empty)."""


class Recovery:
    """What a Sky run does after a failed round (the failure policy): the verdict on
    each failure, the helpers set aside, and the errors that end the run.

    Parameters
    ----------
    settings : SkySettings
        ``failure.max_failed_rounds`` and ``train.lr`` (named when training diverged).
    """

    def __init__(self, settings: SkySettings) -> None:
        self.lr = settings.train.lr
        self.max_failed_rounds = settings.failure.max_failed_rounds
        # name -> (profile, its index in the fleet, the failed round's record)
        self._set_aside: dict[str, tuple[NodeProfile, int, FailedRound]] = {}
        self._diverging = False  # a divergence was found and no round has trained since

    def decide(
        self,
        failure: RoundFailure,
        fleet: Sequence[NodeProfile],
        runs: Sequence[Any],
        partial: bool = False,
    ) -> Verdict:
        """The verdict on ``failure`` (:func:`sky_flower.sky.rounds.blame.judge`) over
        the fleet ``fleet`` and the round's pipelines ``runs`` (``PipelineRun``);
        ``partial``: some pipelines of the round trained (earlier rounds do not count)."""
        failures = self._failures_of(failure, fleet, runs)
        if partial:
            return judge(failures, len(runs))
        verdict = judge(failures, len(runs), self._diverging, list(self._set_aside))
        if failure.diverged:  # RoundGuard: a non-finite aggregate or loss
            verdict = Verdict(diverged=failure.diverged)
        return verdict

    @staticmethod
    def _failures_of(
        failure: RoundFailure, fleet: Sequence[NodeProfile], runs: Sequence[Any]
    ) -> list[Failure]:
        """The failed pipelines ``failure`` reports (one pipeline's error: its nodes by
        id where known, else by name)."""
        if failure.pipelines is not None:
            return list(failure.pipelines)
        owner = runs[0].owner if runs else ""
        names = list(failure.nodes)
        if failure.node_ids:  # by id where known (a name may be only "node <id>")
            names = [n.name for n in fleet if n.node_id in failure.node_ids] or names
        return [Failure(owner, tuple(names), failure.nonfinite_stages)]

    def diverged(self, rnd: int, err: RoundFailure, verdict: Verdict) -> str:
        """Round ``rnd`` failed because the training diverged: the text that says so,
        naming the learning rate (what the stages reported, ``err``, where it adds)."""
        self._diverging = True
        cause = "" if str(err) == verdict.diverged else str(err)
        return diverged_text(rnd, verdict.diverged, self.lr, cause)

    def end(self, rnd: int, err: RoundFailure, failures: int) -> SkyNodeError:
        """The error that ends the run: ``failures`` consecutive failed rounds reached
        ``max_failed_rounds``, the last ``rnd`` with ``err`` (its cause: ``err``)."""
        out = SkyNodeError(
            f"round {rnd} failed: {err} ({failures} consecutive failed round(s): "
            f"max_failed_rounds={self.max_failed_rounds} reached)",
            nodes=list(err.nodes),
            node_ids=None if err.node_ids is None else list(err.node_ids),
        )
        out.__cause__ = as_error(err)
        return out

    def end_diverged(self, text: str, failures: int) -> TrainingDiverged:
        """The error that ends a run whose training diverged (``text``)."""
        return TrainingDiverged(
            f"{text} ({failures} consecutive failed round(s): "
            f"max_failed_rounds={self.max_failed_rounds} reached)",
            nodes=[],
            node_ids=[],
        )

    def set_aside(self, left_out: Sequence[tuple[NodeProfile, int]], record: FailedRound) -> None:
        """Helpers set aside after ``record``'s round (profile, index in the fleet)."""
        for prof, index in left_out:
            self._set_aside[prof.name] = (prof, index, record)

    def put_back(self) -> list[tuple[NodeProfile, int, FailedRound]]:
        """The helpers set aside, to return to the fleet (the training itself diverged),
        in the order they were set aside; none is set aside after."""
        back = list(self._set_aside.values())
        self._set_aside.clear()
        return back

    def round_trained(self, rnd: int) -> list[tuple[str, FailedRound]]:
        """After round ``rnd`` trained: the helpers set aside before it are confirmed
        at fault (the round trained finite without them), to drop, with the record of
        the round that set each aside."""
        self._diverging = False
        out = [(name, record) for name, (_, _, record) in self._set_aside.items()]
        self._set_aside.clear()
        if out:
            log(
                WARNING,
                "Round %d trained finite without %s: its non-finite output was its own "
                "fault; dropped",
                rnd,
                ", ".join(name for name, _ in out),
            )
        return out


def as_error(info: RoundFailure) -> SkyNodeError:
    """An exception of ``info``'s type (:class:`SkyNodeError` or
    :class:`sky_flower.sky.transport.guard.NonFiniteReply`) with its message and nodes:
    the cause the run's final error is raised from (what ``results.json`` shows)."""
    cls = NonFiniteReply if info.type == NonFiniteReply.__name__ else SkyNodeError
    ids = None if info.node_ids is None else list(info.node_ids)
    return cls(info.message, nodes=list(info.nodes), node_ids=ids)
