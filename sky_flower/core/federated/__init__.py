"""Joint planner for federated split training: one pipeline per data owner (pure, no Flower).

Every node with data (``NodeProfile.holds_data``) is a data owner and heads its own
pipeline: stage 0 runs on it, so its raw inputs never leave it. The other nodes are
helpers. :func:`plan_federation` chooses, for every owner, which helpers form its
pipeline and how its layers are cut (the single-pipeline partitioner,
:func:`sky_flower.core.partition.partition`, over ``[owner] + helpers``), minimising the
round's predicted makespan: owner ``k`` runs ``steps_k`` steps
(:func:`steps_in_round`: ``local_epochs`` passes over its samples, or
``steps_per_round``) of its plan's predicted step time, so owners with more data get
more help. A one-stage pipeline is a plain FedAvg client. A helper may serve several
pipelines one after another within a round: pipelines sharing a node are ordered
(``OwnerPipeline.after``), those running at once are node-disjoint, and the makespan
charges the wait.

Methods:

* ``even``: helpers dealt round-robin over the owners, most samples first
  (:func:`~sky_flower.core.federated.search.even_solution` says exactly how), ``even``
  cuts inside each pipeline.
* ``heuristic``: greedy, then local search (see
  :func:`~sky_flower.core.federated.search.heuristic_solution`); never worse than
  ``even`` when ``even`` fits.
* ``optimal``: exhaustive over every helper set per owner and every order of the
  pipelines that share a node, with ``optimal`` cuts per pipeline (see
  :func:`~sky_flower.core.federated.search.optimal_solution`); past its limits, the
  heuristic's plan with ``proven_optimal=False``.

``heuristic`` and ``optimal`` return the all-alone plan whenever FedAvg (every owner
trains the whole model alone) is predicted no slower and every owner fits, so Sky never
loses to FedAvg in prediction. Every plan carries FedAvg's predicted round time and a
lower bound (:func:`~sky_flower.core.federated.joint.lower_bounds`).

Modules: :mod:`.plan` (result types, :func:`steps_in_round`), :mod:`.instance` (the
checked input, per-pipeline plans, timelines), :mod:`.search` (the methods),
:mod:`.joint` (:func:`plan_federation`, the bounds).
"""

from __future__ import annotations

from sky_flower.core.federated.joint import lower_bounds, plan_federation
from sky_flower.core.federated.plan import FederatedPlan, OwnerPipeline, steps_in_round
from sky_flower.core.partition import InfeasibleMemoryError

__all__ = [
    "FederatedPlan",
    "InfeasibleMemoryError",
    "OwnerPipeline",
    "lower_bounds",
    "plan_federation",
    "steps_in_round",
]
