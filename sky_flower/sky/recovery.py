"""What the Sky strategy does when a round's pipelines fail: record the round, end the
run after ``max_failed_rounds`` failed rounds in a row, else drop the helpers that
caused it and re-plan (a data owner is never dropped: stage 0 of its pipeline needs
its data). A mixin of :class:`sky_flower.strategies.sky.SkyStrategy`, split out of it
to keep the strategy's module short."""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING
from typing import Any

from flwr.supercore import log

from sky_flower.core.profile import NodeProfile
from sky_flower.sky.runner import SkyNodeError


class RoundRecovery:
    """Failed-round handling for a strategy with ``node_profiles``, ``_ids``,
    ``make_plan``, ``rounds``, ``failed_rounds``, ``max_failed_rounds`` and
    ``on_event`` (see :class:`sky_flower.strategies.sky.SkyStrategy`)."""

    node_profiles: list[NodeProfile]
    _ids: dict[str, int]
    rounds: list[dict[str, Any]]
    failed_rounds: list[dict[str, Any]]
    max_failed_rounds: int
    on_event: Callable[[str, dict], None]
    make_plan: Callable[..., Any]

    def _failed(self, rnd: int, row: dict[str, Any], failures: int) -> None:
        """Record failed round ``rnd`` (``row["error"]``: the :class:`SkyNodeError` of
        every pipeline); end the run at ``max_failed_rounds``, else drop the nodes that
        caused it and re-plan (:meth:`_recover`).

        Raises
        ------
        SkyNodeError
            If ``failures`` consecutive rounds have failed (``max_failed_rounds``).
        """
        err: SkyNodeError = row["error"]
        log(
            WARNING,
            "Round %d failed: %s. The last good global model is kept (%d consecutive "
            "failed round(s) of at most max_failed_rounds=%d).",
            rnd,
            err,
            failures,
            self.max_failed_rounds,
        )
        failed = {
            "round": rnd,
            "error": f"round {rnd} failed: {err}",
            "round_time_s": row["round_time_s"],
        }
        self.rounds.append(failed)
        self.on_event("round", failed)
        if failures >= self.max_failed_rounds:  # the round that ends the run is listed too
            self.failed_rounds.append({"round": rnd, "error": str(err), "dropped_nodes": []})
            raise SkyNodeError(
                f"round {rnd} failed: {err} ({failures} consecutive failed round(s): "
                f"max_failed_rounds={self.max_failed_rounds} reached)",
                nodes=err.nodes,
                node_ids=err.node_ids,
            ) from err
        self._recover(rnd, err)

    def _recover(self, rnd: int, err: SkyNodeError, partial: bool = False) -> list[str]:
        """After round ``rnd`` failed with ``err`` (and the run goes on): drop the nodes
        that caused it (``err.node_ids``, else ``err.nodes`` by name) and re-plan on the
        others (the configured allocation only); return the names dropped. The data
        owner is never dropped (stage 0 needs its data): a round it failed is simply
        retried, as is one whose nodes cannot be dropped (the others cannot hold the
        model). Records ``failed_rounds`` unless ``partial`` (some pipelines finished
        the round: their FedAvg is kept and the round row names the failed ones)."""
        if err.node_ids is not None:
            failed = [n for n in self.node_profiles if n.node_id in err.node_ids]
        else:
            failed = [n for n in self.node_profiles if n.name in (err.nodes or ())]
        failed = [n for n in failed if not n.holds_data]  # stage 0 of its own pipeline
        names = [n.name for n in failed]
        dropped: list[str] = []
        if failed:
            old = self.node_profiles
            self.node_profiles = [n for n in old if n not in failed]
            try:
                self.make_plan(alternatives=False)
                dropped = names
            except ValueError as plan_err:  # e.g. the others cannot hold the model
                self.node_profiles = old
                self.make_plan(alternatives=False)
                log(WARNING, "Cannot re-plan without %s: %s", ", ".join(names), plan_err)
        for name in dropped:
            self._ids.pop(name, None)
        if not partial:  # a round some pipelines finished is recorded in its row
            self.failed_rounds.append({"round": rnd, "error": str(err), "dropped_nodes": dropped})
        if dropped:
            log(
                WARNING,
                "Round %d failed; dropped %s and re-planned on %d node(s)",
                rnd,
                ", ".join(dropped),
                len(self.node_profiles),
            )
        return dropped
