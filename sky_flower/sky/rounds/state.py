"""A Sky run's state: the fleet as the run knows it now, the plan it runs, and what
happened so far (:class:`RunState`).

:class:`sky_flower.strategies.sky.SkyStrategy` owns one, and its loop is the only writer
(``tests/test_architecture.py`` checks it): the parts (:mod:`sky_flower.sky.rounds`) are
handed what they need as arguments and return what they found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.sky.rounds.records import FailedRound, JoinRecord, RoundRecord

if TYPE_CHECKING:
    from flwr.app import ArrayRecord

    from sky_flower.sky.planning.planning import FederatedPlanned, PipelineRun
    from sky_flower.sky.planning.replan import ReplanRecord


@dataclass
class RunState:
    """A Sky run's state (one per strategy, written by its loop only).

    Attributes
    ----------
    layer_profiles : list of LayerProfile
        The model's layers (FLOPs, bytes), profiled once on the server.
    node_profiles : list of NodeProfile
        The nodes planned with now (the benchmark round's, minus those dropped or set
        aside, plus those that joined; smoothed by the planner after rounds).
    ids, names : dict
        Node name -> Flower node id, and back (errors name nodes by ``names``).
    handler_rate : dict[str, float]
        Node name -> its message handler's measured rate (relay hops).
    samples : dict[str, int]
        Data owner -> training examples; ``num_examples`` their sum.
    federated : FederatedPlanned or None
        The plan the next round runs (:mod:`sky_flower.sky.planning.planning`); ``runs``
        its pipelines (one per data owner).
    rounds : list of RoundRecord
        Every round, trained or failed (:mod:`sky_flower.sky.rounds.records`).
    failed_rounds, joins : list of FailedRound, list of JoinRecord
        What recovery did after each failed round, each node that joined (or came
        back): the ``results.json`` lists of those names.
    replans : list of ReplanRecord
        Each re-plan taken (:class:`sky_flower.sky.planning.replan.ReplanRecord`).
    dropped : dict[str, int]
        Node name -> node id of every node dropped for its own fault.
    rejoin_asked : set of int
        Dropped node ids profiled (or not to be profiled) again since they were
        dropped: re-admitted only after they leave the node list and come back.
    global_arrays : ArrayRecord or None
        The last good global model.
    """

    layer_profiles: list[LayerProfile] = field(default_factory=list)
    node_profiles: list[NodeProfile] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    handler_rate: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    num_examples: int = 0
    federated: FederatedPlanned | None = None
    runs: list[PipelineRun] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    failed_rounds: list[FailedRound] = field(default_factory=list)
    replans: list[ReplanRecord] = field(default_factory=list)
    joins: list[JoinRecord] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    rejoin_asked: set[int] = field(default_factory=set)
    global_arrays: ArrayRecord | None = None
