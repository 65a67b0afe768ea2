"""What the parts of a Sky run share: the fleet as the run knows it now, the plan it
runs, and what happened so far (:class:`RunState`).

:class:`sky_flower.strategies.sky.SkyStrategy` owns one and hands it to each part
(:class:`sky_flower.sky.rounds.joins.Benchmarker`,
:class:`sky_flower.sky.rounds.planner.Planner`,
:class:`sky_flower.sky.rounds.executor.RoundExecutor`,
:class:`sky_flower.sky.rounds.recovery.Recovery`): a part reads what another wrote (the
planner the profiles the benchmark round found, recovery the plan) here, never through
the other part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sky_flower.core.profile import LayerProfile, NodeProfile


@dataclass
class RunState:
    """A Sky run's shared state (mutable; one per strategy).

    Attributes
    ----------
    layer_profiles : list of LayerProfile
        The model's layers (FLOPs, bytes), profiled once on the server.
    node_profiles : list of NodeProfile
        The nodes planned with now (the benchmark round's, minus those dropped or set
        aside, plus those that joined; updated by the re-planning tracker).
    ids, names : dict
        Node name -> Flower node id, and back (errors name nodes by ``names``).
    handler_rate : dict[str, float]
        Node name -> its message handler's measured rate (relay hops).
    samples : dict[str, int]
        Data owner -> training examples; ``num_examples`` their sum.
    federated : FederatedPlanned or None
        The plan the next round runs (:mod:`sky_flower.sky.planning.planning`); ``runs``
        its pipelines (one per data owner).
    tracker : ProfileTracker or None
        The re-planner's smoothed profiles (:mod:`sky_flower.sky.planning.replan`);
        ``None`` until a round trained with ``replan.mode`` on.
    rounds : list of RoundRecord
        Every round, trained or failed (:mod:`sky_flower.sky.rounds.records`).
    failed_rounds, replans, joins : list of dict
        What recovery did after each failed round, each re-plan taken, each node that
        joined (or came back): the ``results.json`` lists of those names.
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
    federated: Any = None  # sky_flower.sky.planning.planning.FederatedPlanned
    runs: list[Any] = field(default_factory=list)  # PipelineRun, one per data owner
    tracker: Any = None  # sky_flower.sky.planning.replan.ProfileTracker
    rounds: list[Any] = field(default_factory=list)  # RoundRecord
    failed_rounds: list[dict[str, Any]] = field(default_factory=list)
    replans: list[dict[str, Any]] = field(default_factory=list)
    joins: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    rejoin_asked: set[int] = field(default_factory=set)
    global_arrays: Any = None  # flwr.app.ArrayRecord
