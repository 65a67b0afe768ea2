"""Nodes that join a Sky run after its benchmark round: benchmarked, then planned with.

A node joins when the Grid lists a node id the benchmark round never saw (a SuperNode
connected mid-run), or when a node that answered the benchmark round "not in the
federation yet" (an emulated fleet's ``join_round``, :class:`NodeAbsent`) answers now.
Before every round after the first, with ``replan.mode`` ``on`` or ``force``, the
strategy profiles such nodes exactly as the benchmark round does (the same profile and
echo messages, tagged with the coming round) and adds each helper that answers to the
fleet's profiles; the re-planning decision (:func:`sky_flower.sky.planning.replan.decide`) then
weighs the plan re-made over the larger fleet like any other (the join is its reason).
A node that fails its profile for another reason is left out and not asked again.

A data owner that joins mid-run is not admitted (logged): its data would need a
pipeline of its own, planned at the start. Under ``replan.mode=off`` the plan is fixed
and nobody joins (as before).

A node that was *dropped* (its own fault: silence, an error reply, a crash;
:mod:`sky_flower.sky.rounds.recovery`) and is listed again, e.g. a SuperNode restarted with the
same node id, is a joiner too: with ``replan.mode`` ``on`` / ``force`` it is profiled
again once after it was dropped, and again each time it has been missing from the
Grid's node list and comes back (a SuperLink lists only online nodes, so a restart shows
as missing, then listed); when it answers it is admitted back (``joins`` records it with
``rejoined: true``). Under ``replan.mode=off`` such a return is reported (logged and
recorded in ``joins`` with ``admitted: false``), not admitted.

The benchmark round and the joins are one part of the strategy
(:class:`Benchmarker`): a join is profiled exactly as the benchmark round profiles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from logging import INFO, WARNING
from typing import Any

from flwr.serverapp import Grid
from flwr.supercore import log

from sky_flower.core.cost import Schedule
from sky_flower.sky import protocol as P
from sky_flower.sky.planning.benchmark import (
    BenchmarkResult,
    BenchmarkRound,
    Link,
    LinkTiming,
    benchmark_event,
)
from sky_flower.sky.rounds.hooks import SkyHooks
from sky_flower.sky.rounds.state import RunState
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.runner import RunSettings, SkyNodeError

#: What an emulated node not yet in the federation says (``NodeAbsent``'s message).
NOT_JOINED = "is not in the federation"


class Benchmarker:
    """The benchmark round and mid-run joins of a Sky run: once the nodes are there,
    :meth:`run` the benchmark round (its profiles go to ``state``), then before each
    round :meth:`admit_joiners` (``replan.mode`` on) or :meth:`note_returns` (off).

    Parameters
    ----------
    state : RunState
        Written: ``node_profiles``, ``ids``, ``names``, ``handler_rate``, ``samples``,
        ``num_examples``, ``joins``; read: ``layer_profiles``, ``dropped``,
        ``rejoin_asked``, ``tracker``.
    settings : SkySettings
        Its ``benchmark`` group (what to measure), ``seed``, ``train`` (the optimizer
        timed), ``messaging`` (``node_wait_s``).
    schedule : Schedule
        The run's schedule (micro-batch size, ``M``).
    input_shape, input_dtype : sequence of int, str
        One sample's shape and dtype (the model's input).
    run_settings : callable
        ``() -> RunSettings``: the exchange and deadlines every message uses.
    links : callable
        ``() -> LinkTiming``: how the transport's links are timed (read when a round
        starts).
    hooks : SkyHooks
        ``on_benchmark`` is called with the benchmark round's event.
    link_cache : dict[int, Link], optional
        Node id -> a link timed by an earlier benchmark round on the same grid.
    """

    def __init__(  # noqa: PLR0913
        self,
        state: RunState,
        settings: SkySettings,
        schedule: Schedule,
        input_shape: Sequence[int],
        input_dtype: str,
        run_settings: Callable[[], RunSettings],
        links: Callable[[], LinkTiming],
        hooks: SkyHooks,
        link_cache: dict[int, Link] | None = None,
    ) -> None:
        self.state, self.settings, self.schedule = state, settings, schedule
        self.input_shape, self.input_dtype = list(input_shape), input_dtype
        self.run_settings, self.links, self.hooks = run_settings, links, hooks
        self.link_cache = link_cache
        self._join_grid: Grid | None = None
        self._seen_ids: set[int] = set()
        self._waiting_ids: set[int] = set()
        self._went_missing: set[int] = set()  # dropped ids seen missing from the node list

    def round(self, grid: Grid, server_round: int = 0) -> BenchmarkRound:
        """The benchmark round of these settings over ``grid``; its messages belong to
        ``server_round`` (0: the benchmark round; a round: a join's profile)."""
        run = self.run_settings()
        return BenchmarkRound(
            run.exchange(grid, run.deadline("benchmark")),
            self.state.layer_profiles,
            self.schedule,
            self.input_shape,
            self.settings.train.optimizer,
            self.settings.train.lr,
            self.settings.benchmark,
            self.state.names,
            seed=self.settings.seed,
            link_cache=self.link_cache,
            input_dtype=self.input_dtype,
            links=self.links(),
            server_round=server_round,
        )

    def run(self, grid: Grid, node_ids: list[int], node_order: Sequence[str] = ()) -> None:
        """Run the benchmark round on ``node_ids`` (a node whose reply is an error is
        left out with a warning), keep what it found in ``state``, and call the hooks'
        ``on_benchmark``.

        Raises
        ------
        SkyNodeError
            If no data owner answered.
        """
        found = self.round(grid).run(node_ids, node_order)
        st = self.state
        st.node_profiles, st.ids = found.nodes, found.node_ids
        st.num_examples, st.handler_rate = found.num_examples, found.handler_rate
        st.samples = dict(found.samples)
        self._join_grid = grid
        self._seen_ids = set(found.node_ids.values()) | set(found.left_out)
        self._waiting_ids = {nid for nid, why in found.left_out.items() if NOT_JOINED in why}
        self.hooks.on_benchmark(benchmark_event(st.layer_profiles, found))

    def _returned(self, listed: set[int]) -> dict[int, str]:
        """Dropped nodes (``state.dropped``, name -> id) listed now that may have come
        back: not yet asked since they were dropped, or missing from a listing since
        they were last asked. Notes which dropped nodes are missing now."""
        dropped = self.state.dropped
        back = {}
        for name, nid in dropped.items():
            if nid not in listed:
                self._went_missing.add(nid)
            elif nid not in self.state.rejoin_asked or nid in self._went_missing:
                back[nid] = name
        return back

    def note_returns(self, next_round: int, replan_mode: str) -> list[str]:
        """Under ``replan.mode=off``: report the dropped nodes listed again after they
        went missing (a restarted SuperNode), which a fixed plan does not admit back
        (logged, recorded in ``joins`` with ``admitted: false``). Returns their names."""
        grid = self._join_grid
        if replan_mode != "off" or grid is None or not self.state.dropped:
            return []
        try:
            listed = set(grid.get_node_ids())
        except Exception:  # noqa: BLE001 - a Grid that cannot list: nothing to report
            return []
        back = {n: nm for n, nm in self._returned(listed).items() if n in self._went_missing}
        for nid, name in back.items():
            self._went_missing.discard(nid)
            self.state.rejoin_asked.add(nid)
            self.state.joins.append(
                {"round": next_round, "node": name, "node_id": nid, "rejoined": True}
                | {"admitted": False}
            )
            log(
                WARNING,
                "Node %s (node %d), dropped earlier, is listed again before round %d; "
                "replan.mode=off keeps the plan fixed, so it is not admitted back (set "
                "replan.mode=on to admit nodes that rejoin)",
                name,
                nid,
                next_round,
            )
        return list(back.values())

    def admit_joiners(self, next_round: int) -> list[str]:
        """Profile the nodes that joined before ``next_round`` (new node ids, and nodes
        that had not joined at the benchmark round) and add the helpers that answer to
        ``state.node_profiles`` (and the re-planning tracker). Returns their names; each is
        recorded in ``joins`` (``round``, ``node``, ``node_id``)."""
        grid = self._join_grid
        if grid is None:
            return []
        try:
            listed = set(grid.get_node_ids())
        except Exception as err:  # noqa: BLE001 - a Grid that cannot list: nobody joins
            log(WARNING, "Could not list the nodes before round %d: %s", next_round, err)
            return []
        returned = self._returned(listed)  # dropped nodes that may have come back
        ask = sorted((listed - self._seen_ids) | (listed & self._waiting_ids) | set(returned))
        if not ask:
            return []
        st = self.state
        bench = self.round(grid, next_round)
        taken = BenchmarkResult(nodes=list(st.node_profiles), node_ids=dict(st.ids), num_examples=0)
        joined: list[str] = []
        for nid in ask:
            self._seen_ids.add(nid)
            if nid in returned:
                st.rejoin_asked.add(nid)
                self._went_missing.discard(nid)
            try:
                node, prof = bench.profile(nid, taken)
            except (SkyNodeError, P.ProtocolError, KeyError, TypeError, ValueError) as err:
                if nid in self._waiting_ids and NOT_JOINED in str(err):
                    continue  # still not in the federation: ask again next round
                self._waiting_ids.discard(nid)
                log(
                    WARNING,
                    "Node %s did not join before round %d: %s",
                    bench.ex.name(nid),
                    next_round,
                    err,
                )
                continue
            self._waiting_ids.discard(nid)
            if node.holds_data:
                log(
                    WARNING,
                    "Data owner %s joined before round %d and is not admitted: a data "
                    "owner's pipeline is planned at the start of the run",
                    node.name,
                    next_round,
                )
                continue
            st.handler_rate.update(taken.handler_rate)
            if st.tracker is not None:
                st.tracker.base.append(node)
                node = st.tracker.profiles([node])[0]
            st.node_profiles.append(node)
            st.ids[node.name] = nid
            taken.node_ids[node.name] = nid
            join: dict[str, Any] = {"round": next_round, "node": node.name, "node_id": nid}
            if nid in returned:  # dropped earlier, back (e.g. a restarted SuperNode)
                st.dropped.pop(returned[nid], None)
                join |= {"rejoined": True, "admitted": True}
            st.joins.append(join)
            joined.append(node.name)
            log(
                INFO,
                "Node %s %s before round %d (%s)",
                node.name,
                "rejoined (dropped earlier)" if nid in returned else "joined",
                next_round,
                prof.emulation,
            )
        return joined
