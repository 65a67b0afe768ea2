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

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING

from flwr.serverapp import Grid
from flwr.supercore import log

from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.sky import protocol as P
from sky_flower.sky.planning.benchmark import (
    BenchmarkResult,
    BenchmarkRound,
    Link,
    LinkTiming,
)
from sky_flower.sky.rounds.records import JoinRecord
from sky_flower.sky.settings import SkySettings
from sky_flower.sky.transport.runner import RunSettings, SkyNodeError

#: What an emulated node not yet in the federation says (``NodeAbsent``'s message).
NOT_JOINED = "is not in the federation"


@dataclass(frozen=True)
class Fleet:
    """The fleet as the run knows it now (read only): the nodes planned with, node name
    -> id (``ids``) and back (``names``), the nodes ``dropped`` for their own fault
    (name -> id), and the dropped ids asked again since (``rejoin_asked``)."""

    nodes: Sequence[NodeProfile]
    ids: Mapping[str, int]
    names: Mapping[int, str]
    dropped: Mapping[str, int] = field(default_factory=dict)
    rejoin_asked: frozenset[int] | set[int] = frozenset()


@dataclass
class Joined:
    """What :meth:`Benchmarker.admit_joiners` or :meth:`Benchmarker.note_returns` found:
    the helpers admitted (``nodes``, in the order they answered; ``ids`` name -> id), node
    id -> name of every node that told its name (``names``), the admitted nodes'
    ``handler_rate``, one :class:`JoinRecord` per node admitted or (``replan.mode=off``)
    reported back, the dropped ids ``asked`` now (not asked again until they go missing),
    and the dropped nodes admitted back (``rejoined``)."""

    nodes: list[NodeProfile] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    handler_rate: dict[str, float] = field(default_factory=dict)
    joins: list[JoinRecord] = field(default_factory=list)
    asked: set[int] = field(default_factory=set)
    rejoined: list[str] = field(default_factory=list)


class Benchmarker:
    """The benchmark round and mid-run joins of a Sky run: once the nodes are there,
    :meth:`run` the benchmark round (it returns what it found), then before each round
    :meth:`admit_joiners` (``replan.mode`` on) or :meth:`note_returns` (off). It keeps
    only which node ids it has seen; the strategy keeps the fleet.

    Parameters
    ----------
    settings : SkySettings
        Its ``benchmark`` group (what to measure), ``seed``, ``train`` (the optimizer
        timed), ``messaging`` (``node_wait_s``), ``schedule`` (micro-batch size, ``M``).
    input_shape, input_dtype : sequence of int, str
        One sample's shape and dtype (the model's input).
    link_cache : dict[int, Link], optional
        Node id -> a link timed by an earlier benchmark round on the same grid.
    """

    def __init__(
        self,
        settings: SkySettings,
        input_shape: Sequence[int],
        input_dtype: str,
        link_cache: dict[int, Link] | None = None,
    ) -> None:
        self.settings, self.schedule = settings, settings.schedule_object()
        self.input_shape, self.input_dtype = list(input_shape), input_dtype
        self.link_cache = link_cache
        self._join_grid: Grid | None = None
        self._seen_ids: set[int] = set()
        self._waiting_ids: set[int] = set()
        self._went_missing: set[int] = set()  # dropped ids seen missing from the node list

    def round(  # noqa: PLR0913
        self,
        grid: Grid,
        layers: Sequence[LayerProfile],
        run: RunSettings,
        links: LinkTiming,
        names: dict[int, str],
        server_round: int = 0,
    ) -> BenchmarkRound:
        """The benchmark round of these settings over ``grid`` (``layers``: the model's;
        ``run``: the exchange and deadlines; ``links``: how links are timed; ``names``:
        filled with node id -> name as nodes answer); its messages belong to
        ``server_round`` (0: the benchmark round; a round: a join's profile)."""
        run = dataclasses.replace(run, describe=names.get)
        return BenchmarkRound(
            run.exchange(grid, run.deadline("benchmark")),
            layers,
            self.schedule,
            self.input_shape,
            self.settings.train.optimizer,
            self.settings.train.lr,
            self.settings.benchmark,
            names,
            seed=self.settings.seed,
            link_cache=self.link_cache,
            input_dtype=self.input_dtype,
            links=links,
            server_round=server_round,
        )

    def run(  # noqa: PLR0913
        self,
        grid: Grid,
        node_ids: list[int],
        node_order: Sequence[str],
        layers: Sequence[LayerProfile],
        run: RunSettings,
        links: LinkTiming,
        names: Mapping[int, str] = {},  # noqa: B006 - read only
    ) -> BenchmarkResult:
        """Run the benchmark round on ``node_ids`` (a node whose reply is an error is
        left out with a warning): what it found, the fleet (its ``names``: node id ->
        name of every node known by name; ``names``: those known before).

        Raises
        ------
        SkyNodeError
            If no data owner answered.
        """
        known = dict(names)
        found = self.round(grid, layers, run, links, known).run(node_ids, node_order)
        self._join_grid = grid
        self._seen_ids = set(found.node_ids.values()) | set(found.left_out)
        self._waiting_ids = {nid for nid, why in found.left_out.items() if NOT_JOINED in why}
        found.names = known
        return found

    def _returned(self, listed: set[int], fleet: Fleet) -> dict[int, str]:
        """Dropped nodes (``fleet.dropped``, name -> id) listed now that may have come
        back: not yet asked since they were dropped, or missing from a listing since
        they were last asked. Notes which dropped nodes are missing now."""
        back = {}
        for name, nid in fleet.dropped.items():
            if nid not in listed:
                self._went_missing.add(nid)
            elif nid not in fleet.rejoin_asked or nid in self._went_missing:
                back[nid] = name
        return back

    def note_returns(self, next_round: int, replan_mode: str, fleet: Fleet) -> Joined:
        """Under ``replan.mode=off``: report the dropped nodes listed again after they
        went missing (a restarted SuperNode), which a fixed plan does not admit back
        (logged, in ``joins`` with ``admitted: false``)."""
        out = Joined()
        grid = self._join_grid
        if replan_mode != "off" or grid is None or not fleet.dropped:
            return out
        try:
            listed = set(grid.get_node_ids())
        except Exception:  # noqa: BLE001 - a Grid that cannot list: nothing to report
            return out
        back = {n: nm for n, nm in self._returned(listed, fleet).items() if n in self._went_missing}
        for nid, name in back.items():
            self._went_missing.discard(nid)
            out.asked.add(nid)
            out.joins.append(JoinRecord(next_round, name, nid, rejoined=True, admitted=False))
            log(
                WARNING,
                "Node %s (node %d), dropped earlier, is listed again before round %d; "
                "replan.mode=off keeps the plan fixed, so it is not admitted back (set "
                "replan.mode=on to admit nodes that rejoin)",
                name,
                nid,
                next_round,
            )
        return out

    def admit_joiners(  # noqa: PLR0913
        self,
        next_round: int,
        layers: Sequence[LayerProfile],
        run: RunSettings,
        links: LinkTiming,
        fleet: Fleet,
    ) -> Joined:
        """Profile the nodes that joined before ``next_round`` (new node ids, and nodes
        that had not joined at the benchmark round, and dropped nodes back): the helpers
        that answer, to be added to the fleet (each with a :class:`JoinRecord`)."""
        out = Joined()
        grid = self._join_grid
        if grid is None:
            return out
        try:
            listed = set(grid.get_node_ids())
        except Exception as err:  # noqa: BLE001 - a Grid that cannot list: nobody joins
            log(WARNING, "Could not list the nodes before round %d: %s", next_round, err)
            return out
        returned = self._returned(listed, fleet)  # dropped nodes that may have come back
        ask = sorted((listed - self._seen_ids) | (listed & self._waiting_ids) | set(returned))
        if not ask:
            return out
        out.names = dict(fleet.names)
        bench = self.round(grid, layers, run, links, out.names, next_round)
        taken = BenchmarkResult(nodes=list(fleet.nodes), node_ids=dict(fleet.ids), num_examples=0)
        for nid in ask:
            self._seen_ids.add(nid)
            if nid in returned:
                out.asked.add(nid)
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
            out.handler_rate.update(taken.handler_rate)
            out.nodes.append(node)
            out.ids[node.name] = nid
            taken.node_ids[node.name] = nid
            join = JoinRecord(next_round, node.name, nid)
            if nid in returned:  # dropped earlier, back (e.g. a restarted SuperNode)
                out.rejoined.append(returned[nid])
                join = JoinRecord(next_round, node.name, nid, rejoined=True, admitted=True)
            out.joins.append(join)
            log(
                INFO,
                "Node %s %s before round %d (%s)",
                node.name,
                "rejoined (dropped earlier)" if nid in returned else "joined",
                next_round,
                prof.emulation,
            )
        return out
