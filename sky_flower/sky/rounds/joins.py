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

A mixin of :class:`sky_flower.strategies.sky.SkyStrategy`, as
:class:`sky_flower.sky.rounds.replan_hook.RoundReplanning`.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import INFO, WARNING
from typing import Any

from flwr.serverapp import Grid
from flwr.supercore import log

from sky_flower.core.profile import NodeProfile
from sky_flower.sky import protocol as P
from sky_flower.sky.planning.benchmark import BenchmarkResult, BenchmarkRound, BenchmarkSettings
from sky_flower.sky.transport.runner import SkyNodeError

#: What an emulated node not yet in the federation says (``NodeAbsent``'s message).
NOT_JOINED = "is not in the federation"


class NodeJoins:
    """Benchmark round and mid-run joins for :class:`sky_flower.strategies.sky.SkyStrategy`
    (a mixin): :meth:`benchmark_round` builds the benchmark, :meth:`remember_benchmark`
    keeps what it found, :meth:`admit_joiners` adds the nodes that joined since."""

    node_profiles: list[NodeProfile]
    _ids: dict[str, int]
    _names: dict[int, str]
    _handler_rate: dict[str, float]
    num_examples: int
    samples: dict[str, int]
    tracker: Any
    run_settings: Callable[[], Any]
    profile_model: Callable[[], Any]

    def benchmark_round(self, grid: Grid, server_round: int = 0) -> BenchmarkRound:
        """The benchmark round of this strategy's settings over ``grid``; its messages
        belong to ``server_round`` (0: the benchmark round; a round: a join's profile)."""
        s: Any = self
        run = self.run_settings()
        settings = BenchmarkSettings(
            warmup=s.benchmark_warmup,
            repeats=s.benchmark_repeats,
            echo_bytes=s.echo_bytes,
            echo_repeats=s.echo_repeats,
            echo_jitter_s=s.echo_jitter_s,
            state_probe_bytes=s.state_probe_bytes,
            peer_links=s.runner_cls.peer_links,
            calibrate=s.runner_cls.calibrate,
            stream=self.run_settings().stream_endpoint()
            if s.runner_cls.label == "stream"
            else None,
        )
        run = self.run_settings()
        return BenchmarkRound(
            run.exchange(grid, run.deadline("benchmark")),
            self.profile_model(),
            s.schedule,
            s.input_shape,
            s.optimizer,
            s.lr,
            settings,
            self._names,
            seed=s.seed,
            link_cache=s.link_cache,
            input_dtype=s.input_dtype,
            server_round=server_round,
        )

    def remember_benchmark(self, grid: Grid, found: BenchmarkResult) -> None:
        """Keep the benchmark round's profiles, node ids and samples, and which nodes
        it did not admit: those that said they have not joined yet are asked again."""
        self.node_profiles, self._ids = found.nodes, found.node_ids
        self.num_examples, self._handler_rate = found.num_examples, found.handler_rate
        self.samples = dict(found.samples)
        self._join_grid = grid
        self._seen_ids = set(found.node_ids.values()) | set(found.left_out)
        self._waiting_ids = {nid for nid, why in found.left_out.items() if NOT_JOINED in why}
        self.joins: list[dict[str, Any]] = []
        self._rejoin_asked: set[int] = set()  # dropped ids profiled since they were dropped
        self._went_missing: set[int] = set()  # dropped ids seen missing from the node list

    def _returned(self, listed: set[int]) -> dict[int, str]:
        """Dropped nodes (``self.dropped``, name -> id) listed now that may have come
        back: not yet asked since they were dropped, or missing from a listing since
        they were last asked. Notes which dropped nodes are missing now."""
        dropped: dict[str, int] = getattr(self, "dropped", {})
        back = {}
        for name, nid in dropped.items():
            if nid not in listed:
                self._went_missing.add(nid)
            elif nid not in self._rejoin_asked or nid in self._went_missing:
                back[nid] = name
        return back

    def note_returns(self, next_round: int, replan_mode: str) -> list[str]:
        """Under ``replan.mode=off``: report the dropped nodes listed again after they
        went missing (a restarted SuperNode), which a fixed plan does not admit back
        (logged, recorded in ``joins`` with ``admitted: false``). Returns their names."""
        grid = getattr(self, "_join_grid", None)
        if replan_mode != "off" or grid is None or not getattr(self, "dropped", None):
            return []
        try:
            listed = set(grid.get_node_ids())
        except Exception:  # noqa: BLE001 - a Grid that cannot list: nothing to report
            return []
        back = {n: nm for n, nm in self._returned(listed).items() if n in self._went_missing}
        for nid, name in back.items():
            self._went_missing.discard(nid)
            self._rejoin_asked.add(nid)
            self.joins.append(
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
        ``node_profiles`` (and the re-planning tracker). Returns their names; each is
        recorded in ``joins`` (``round``, ``node``, ``node_id``)."""
        grid = getattr(self, "_join_grid", None)
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
        bench = self.benchmark_round(grid, next_round)
        taken = BenchmarkResult(
            nodes=list(self.node_profiles), node_ids=dict(self._ids), num_examples=0
        )
        joined: list[str] = []
        for nid in ask:
            self._seen_ids.add(nid)
            if nid in returned:
                self._rejoin_asked.add(nid)
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
            self._handler_rate.update(taken.handler_rate)
            if self.tracker is not None:
                self.tracker.base.append(node)
                node = self.tracker.profiles([node])[0]
            self.node_profiles.append(node)
            self._ids[node.name] = nid
            taken.node_ids[node.name] = nid
            join: dict[str, Any] = {"round": next_round, "node": node.name, "node_id": nid}
            if nid in returned:  # dropped earlier, back (e.g. a restarted SuperNode)
                getattr(self, "dropped", {}).pop(returned[nid], None)
                join |= {"rejoined": True, "admitted": True}
            self.joins.append(join)
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
