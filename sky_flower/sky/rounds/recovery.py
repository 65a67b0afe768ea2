"""What the Sky strategy does when a round's pipelines fail: record the round, end the
run after ``max_failed_rounds`` failed rounds in a row, else act on the verdict of
:func:`sky_flower.sky.rounds.blame.judge`: drop the nodes whose own fault it was (silence, an
error or malformed reply, a crash) and re-plan; set aside for one round a helper whose
output alone went non-finite (dropped if the next round trains without it, put back if
it goes non-finite again); or, when the training diverged, drop nobody and say so,
naming the learning rate and the round. A data owner is never dropped (stage 0 of its
pipeline needs its data). One part of :class:`sky_flower.strategies.sky.SkyStrategy`
(:class:`Recovery`), testable alone on a :class:`sky_flower.sky.rounds.state.RunState`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from logging import WARNING
from typing import Any

from flwr.supercore import log

from sky_flower.core.profile import NodeProfile
from sky_flower.sky.rounds.blame import Failure, Verdict, diverged_text, judge
from sky_flower.sky.rounds.hooks import SkyHooks
from sky_flower.sky.rounds.records import RoundRecord
from sky_flower.sky.rounds.state import RunState
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.runner import SkyNodeError


class TrainingDiverged(SkyNodeError):
    """The run ended because its training diverged (``max_failed_rounds`` diverged or
    failed rounds in a row): no node is to blame (``nodes`` and ``node_ids`` empty)."""


class Recovery:
    """What a Sky run does after a failed round (the failure policy).

    Parameters
    ----------
    state : RunState
        Read: ``runs``, ``node_profiles``, ``ids``; written: ``node_profiles``
        (nodes left out or put back), ``ids``, ``rounds`` and ``failed_rounds``
        (failed rounds), ``dropped``, ``rejoin_asked``.
    settings : SkySettings
        ``failure.max_failed_rounds`` and ``train.lr`` (named when training diverged).
    make_plan : callable
        ``(alternatives=False) -> plan``: re-plans on ``state.node_profiles``
        (:meth:`sky_flower.sky.rounds.planner.Planner.make_plan`); raises
        ``ValueError`` if the nodes left cannot hold the model.
    hooks : SkyHooks
        ``on_round`` is called with every failed round's record.
    """

    def __init__(
        self,
        state: RunState,
        settings: SkySettings,
        make_plan: Callable[..., Any],
        hooks: SkyHooks,
    ) -> None:
        self.state, self.make_plan, self.hooks = state, make_plan, hooks
        self.lr = settings.train.lr
        self.max_failed_rounds = settings.failure.max_failed_rounds
        # name -> (profile, its index in node_profiles, the failed round's record)
        self._set_aside: dict[str, tuple[NodeProfile, int, dict[str, Any]]] = {}
        self._diverging = False  # a divergence was found and no round has trained since
        self._dropped_in: dict[str, int] = {}  # name -> the round it was dropped after
        self._left_out_profiles: dict[str, tuple[NodeProfile, int]] = {}

    def _failures_of(self, err: SkyNodeError) -> list[Failure]:
        """The failed pipelines ``err`` reports (:class:`sky_flower.sky.rounds.blame.Failure`)."""
        failures = getattr(err, "failures", None)
        if failures is not None:
            return list(failures)
        owner = self.state.runs[0].owner if self.state.runs else ""
        names = list(err.nodes or ())
        if err.node_ids:  # by id where known (a name may be only "node <id>")
            names = [n.name for n in self.state.node_profiles if n.node_id in err.node_ids] or names
        return [Failure(owner, tuple(names), tuple(getattr(err, "stages", ())))]

    def failed(self, rnd: int, row: RoundRecord, failures: int) -> None:
        """Record failed round ``rnd`` (``row.exception``: the :class:`SkyNodeError` of
        every pipeline); end the run at ``max_failed_rounds``, else act on the verdict
        (:func:`sky_flower.sky.rounds.blame.judge`; :meth:`_recover`).

        Raises
        ------
        TrainingDiverged
            If the training diverged in this round and ``failures`` consecutive rounds
            have failed (``max_failed_rounds``): names the learning rate and the round.
        SkyNodeError
            If ``failures`` consecutive rounds have failed (``max_failed_rounds``).
        """
        err: SkyNodeError = row.exception  # type: ignore[assignment]
        verdict = judge(
            self._failures_of(err), len(self.state.runs), self._diverging, list(self._set_aside)
        )
        if getattr(err, "diverged", ""):  # RoundGuard: a non-finite aggregate or loss
            verdict = Verdict(diverged=err.diverged)  # type: ignore[attr-defined]
        if verdict.diverged:
            self._diverged(rnd, row, failures, verdict)
            return
        log(
            WARNING,
            "Round %d failed: %s. The last good global model is kept (%d consecutive "
            "failed round(s) of at most max_failed_rounds=%d).",
            rnd,
            err,
            failures,
            self.max_failed_rounds,
        )
        failed = RoundRecord(rnd, row.round_time_s, error=f"round {rnd} failed: {err}")
        self.state.rounds.append(failed)
        self.hooks.on_round(failed)
        if failures >= self.max_failed_rounds:  # the round that ends the run is listed too
            self.state.failed_rounds.append({"round": rnd, "error": str(err), "dropped_nodes": []})
            raise SkyNodeError(
                f"round {rnd} failed: {err} ({failures} consecutive failed round(s): "
                f"max_failed_rounds={self.max_failed_rounds} reached)",
                nodes=err.nodes,
                node_ids=err.node_ids,
            ) from err
        self._recover(rnd, err, verdict=verdict)

    def _diverged(self, rnd: int, row: RoundRecord, failures: int, verdict: Verdict) -> None:
        """Round ``rnd`` failed because the training diverged: record it naming the
        learning rate, put back the helpers set aside (they were not at fault), drop
        nobody; end the run at ``max_failed_rounds``.

        Raises
        ------
        TrainingDiverged
            If ``failures`` consecutive rounds have failed (``max_failed_rounds``).
        """
        err: SkyNodeError = row.exception  # type: ignore[assignment]
        cause = "" if str(err) == verdict.diverged else str(err)
        text = diverged_text(rnd, verdict.diverged, self.lr, cause)
        self._diverging = True
        restored = self._put_back()
        log(WARNING, "Round %d failed: %s. The last good global model is kept.", rnd, text)
        failed = RoundRecord(
            rnd, row.round_time_s, error=f"round {rnd} failed: {text}", diverged=True
        )
        self.state.rounds.append(failed)
        self.hooks.on_round(failed)
        record: dict[str, Any] = {"round": rnd, "error": text, "dropped_nodes": []}
        record["diverged"] = True
        if restored:
            record["restored_nodes"] = restored
        self.state.failed_rounds.append(record)
        if failures >= self.max_failed_rounds:
            raise TrainingDiverged(
                f"{text} ({failures} consecutive failed round(s): "
                f"max_failed_rounds={self.max_failed_rounds} reached)",
                nodes=[],
                node_ids=[],
            ) from None  # shown as it is (jobs.common.shown_error shows a __cause__)

    def _put_back(self) -> list[str]:
        """Return the helpers set aside to the fleet and re-plan; their names."""
        if not self._set_aside:
            return []
        names = list(self._set_aside)
        old = list(self.state.node_profiles)
        for name, (prof, index, record) in sorted(self._set_aside.items(), key=lambda kv: kv[1][1]):
            self.state.node_profiles.insert(min(index, len(self.state.node_profiles)), prof)
            record["restored_nodes"] = [*record.get("restored_nodes", []), name]
        self._set_aside.clear()
        try:
            self.make_plan(alternatives=False)
        except ValueError as plan_err:  # cannot happen: they held the model before
            self.state.node_profiles = old
            log(WARNING, "Cannot re-plan with %s put back: %s", ", ".join(names), plan_err)
            return []
        log(
            WARNING,
            "Put %s back (set aside after a non-finite round, but the training itself "
            "diverged) and re-planned on %d node(s)",
            ", ".join(names),
            len(self.state.node_profiles),
        )
        return names

    def round_trained(self, rnd: int) -> list[str]:
        """After round ``rnd`` trained: the helpers set aside before it are confirmed
        at fault (the round trained finite without them) and dropped; returns them."""
        self._diverging = False
        names = list(self._set_aside)
        for name, (_, _, record) in self._set_aside.items():
            record["dropped_nodes"] = [*record["dropped_nodes"], name]
            nid = self.state.ids.pop(name, None)
            if nid is not None:
                self.state.dropped[name] = nid
                self._dropped_in[name] = rnd
                # re-admitted only after it leaves the node list and comes back (a
                # restart), not on the next profile: a profile does not show NaN output
                self.state.rejoin_asked.add(nid)
        self._set_aside.clear()
        if names:
            log(
                WARNING,
                "Round %d trained finite without %s: its non-finite output was its own "
                "fault; dropped",
                rnd,
                ", ".join(names),
            )
        return names

    def partial_failure(self, rnd: int, row: RoundRecord) -> list[str]:
        """Round ``rnd`` trained but some pipelines failed (``row.failed_pipelines``):
        their FedAvg is kept; act on the verdict for the failed ones (a pipeline that
        diverged drops nobody; see :meth:`_recover`). Returns the names dropped."""
        from sky_flower.sky.rounds import federation

        err = federation.pipelines_error(row.failed_pipelines or [])
        verdict = judge(self._failures_of(err), len(self.state.runs))
        if verdict.diverged:
            log(WARNING, "Round %d: %s", rnd, diverged_text(rnd, verdict.diverged, self.lr))
            row.diverged = verdict.diverged
        return self._recover(rnd, err, partial=True, verdict=verdict)

    def _recover(
        self,
        rnd: int,
        err: SkyNodeError,
        partial: bool = False,
        verdict: Verdict | None = None,
    ) -> list[str]:
        """After round ``rnd`` failed with ``err`` (and the run goes on): drop the nodes
        whose own fault it was (``verdict.drop``; default: ``err.node_ids``, else
        ``err.nodes`` by name), set aside ``verdict.set_aside`` for the next round, and
        re-plan on the others (the configured allocation only); return the names dropped
        or set aside. The data owner is never dropped (stage 0 needs its data): a round
        it failed is simply retried, as is one whose nodes cannot be left out (the
        others cannot hold the model). Records ``failed_rounds`` unless ``partial`` (some
        pipelines finished the round: their FedAvg is kept and the round row names the
        failed ones)."""
        if verdict is None:
            if err.node_ids is not None:
                drop = [n.name for n in self.state.node_profiles if n.node_id in err.node_ids]
            else:
                drop = [n.name for n in self.state.node_profiles if n.name in (err.nodes or ())]
            verdict = Verdict(drop=tuple(drop))
        out = self._leave_out(verdict.drop, verdict.set_aside)
        dropped = [n for n in out if n in verdict.drop]
        aside = [n for n in out if n in verdict.set_aside]
        for name in dropped:
            nid = self.state.ids.pop(name, None)
            if nid is not None:
                self.state.dropped[name] = nid
                self._dropped_in[name] = rnd
        record = {"round": rnd, "error": str(err), "dropped_nodes": dropped}
        if aside:
            record["set_aside"] = aside
        for name in aside:
            prof, index = self._left_out_profiles[name]
            self._set_aside[name] = (prof, index, record)
        if not partial:  # a round some pipelines finished is recorded in its row
            self.state.failed_rounds.append(record)
        if out:
            log(
                WARNING,
                "Round %d failed; %s and re-planned on %d node(s)",
                rnd,
                "; ".join(
                    part
                    for part in (
                        f"dropped {', '.join(dropped)}" if dropped else "",
                        f"set aside {', '.join(aside)} for one round (non-finite output on "
                        "finite input: dropped if the next round trains without it, put "
                        "back if it goes non-finite again)"
                        if aside
                        else "",
                    )
                    if part
                ),
                len(self.state.node_profiles),
            )
        return out

    def _leave_out(self, drop: Sequence[str], aside: Sequence[str]) -> list[str]:
        """Remove the helpers named in ``drop`` and ``aside`` from ``node_profiles`` and
        re-plan; keep them (and the plan) when the others cannot hold the model. Returns
        the names left out; ``_left_out_profiles`` maps each to (profile, index)."""
        names = set(drop) | set(aside)
        failed = [n for n in self.state.node_profiles if n.name in names and not n.holds_data]
        self._left_out_profiles = {n.name: (n, self.state.node_profiles.index(n)) for n in failed}
        if not failed:
            return []
        old = self.state.node_profiles
        self.state.node_profiles = [n for n in old if n not in failed]
        try:
            self.make_plan(alternatives=False)
        except ValueError as plan_err:  # e.g. the others cannot hold the model
            self.state.node_profiles = old
            self.make_plan(alternatives=False)
            log(
                WARNING,
                "Cannot re-plan without %s: %s",
                ", ".join(n.name for n in failed),
                plan_err,
            )
            return []
        return [n.name for n in failed]
