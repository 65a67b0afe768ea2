"""Online re-planning: the plan follows the nodes as they drift.

After every round the measured per-stage times update each node's profile
(:class:`ProfileTracker`): per stage the round's robust compute per step (relay: the
median message's compute times messages per step; direct: the round's mean) against
what the plan predicted gives the node's compute factor, and (relay) the time a stage's
handlers spend beyond compute (link delay, payload, state) against its prediction gives
its link factor; a node in several pipelines takes the median of its stages; across
rounds each factor is smoothed exponentially (``replan.smoothing``: the newest round's
weight). A node's profile is its benchmark profile times its factors.

Then the configured allocation re-plans on the updated profiles (:func:`decide`). The
predicted times of the current plan and of the new one are both taken on the updated
profiles, and the new one is scaled by the current plan's measured / predicted ratio,
so a cost model that is off by the same factor for both plans (e.g. Flower's
per-message overhead) triggers nothing. The new plan is taken when its expected step,
plus the migration charged over the steps left in the run, beats the measured step by
more than ``replan.threshold``. The migration is what moving the stage state would take:
the weights (and, with ``train.optimizer_state=keep``, the optimizer state) of every
layer that changes node, over the old node's and the new node's links (through the
server). On the relay transport this is an upper bound: the global model is shipped to
the stages every round anyway.

Moving state: :mod:`sky_flower.sky.migration`. Asteroid (Ye et al., MobiCom 2024) and
FTPipeHD (Chen et al., arXiv 2110.02781) re-plan pipelines at run time outside federated
learning; SkyComputing (arXiv 2202.11836) lists it as future work.

``replan.mode``: ``off`` (default: the plan is fixed, as before), ``on``, or ``force``
(tests: every round runs a plan with other cuts, :func:`shifted_plan`, to check that
migration keeps training exact).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.supercore import log

from sky_flower.core.cost import CostModel
from sky_flower.core.partition import make_plan
from sky_flower.core.profile import LayerProfile, NodeProfile
from sky_flower.sky.planning import planning
from sky_flower.sky.settings import ReplanSettings
from sky_flower.sky.transport.records import RecordFields, StageRecord, optional

FACTOR_RANGE = (0.02, 200.0)  # a factor outside this is a measurement error, clipped


#: A stage's link factor is observed only where its predicted link time is at least this
#: (s) and this share of its predicted busy time: a ratio of two near-zero times is noise.
LINK_MIN_S, LINK_MIN_SHARE = 1e-3, 0.1


def _link_observable(stage: int, p_link: float, p_busy: float) -> bool:
    """Whether a stage row's link time says anything about its node's link: not the data
    owner's stage 0 (its handler also draws the batch, which no prediction holds), and a
    predicted link time that is a material part of the predicted busy time. Without this
    an owner with a native link (``bw inf``, 1 ms predicted) took a factor of about 100
    from its batch drawing, and every plan it headed was predicted 20 s slower."""
    return stage > 0 and p_link >= LINK_MIN_S and p_link >= LINK_MIN_SHARE * p_busy


def _clip(x: float) -> float:
    return float(min(max(x, FACTOR_RANGE[0]), FACTOR_RANGE[1]))


@dataclass
class ProfileTracker:
    """Each node's compute and link factors against its benchmark profile, smoothed
    across rounds.

    Parameters
    ----------
    base : sequence of NodeProfile
        The benchmark round's profiles (factor 1).
    smoothing : float
        Weight of the newest round (``f <- (1 - a) f + a observed``).
    """

    base: Sequence[NodeProfile]
    smoothing: float = 0.5
    compute: dict[str, float] = field(default_factory=dict)
    link: dict[str, float] = field(default_factory=dict)
    planned: dict[str, tuple[float, float]] = field(default_factory=dict)
    baselines: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.base = list(self.base)
        self.snapshot()

    def snapshot(self) -> None:
        """Remember the factors a plan's predictions are made with (call on every plan)."""
        self.planned = {n.name: self.factors(n.name) for n in self.base}

    def observe(self, stages: Sequence[StageRecord]) -> dict[str, tuple[float, float]]:
        """Update the factors from a round's stages (``node``, ``predicted_compute_s``,
        ``median_compute_s`` or ``measured_compute_s``; relay also ``measured_busy_s``,
        ``predicted_busy_s``). Returns node -> (compute factor before, after).

        A node not measured yet takes the run's calibration: the median over the
        helpers' stages (all stages if none) of the first round observed of measured /
        benchmark-predicted
        (``baselines``), so what the cost model misses on every node alike (e.g. the
        relay's per-message work) does not make an unmeasured node look faster than
        the measured ones."""
        seen: dict[str, list[float]] = {}
        links: dict[str, list[float]] = {}
        helpers: list[float] = []  # the baseline: a data owner's stage also loads its data
        for st in stages:
            node = st.node
            f_c, f_l = self.planned.get(node, (1.0, 1.0))
            pred, got = st.predicted_compute_s, st.median_compute_s
            got = st.measured_compute_s if got is None else got
            if pred and got and pred > 0 and got > 0:
                seen.setdefault(node, []).append(f_c * got / pred)
                if st.stage > 0:
                    helpers.append(f_c * got / pred)
            p_busy, m_busy = st.predicted_busy_s, st.measured_busy_s
            if p_busy is not None and m_busy is not None and pred and got:
                p_link, m_link = p_busy - pred, m_busy - st.measured_compute_s
                if _link_observable(st.stage, p_link, p_busy) and m_link > 0:
                    links.setdefault(node, []).append(f_l * m_link / p_link)
        old = {n: self.factors(n)[0] for n in seen}
        self._smooth(self.compute, seen, "compute", helpers)
        self._smooth(self.link, links, "link")
        return {n: (old[n], self.compute[n]) for n in seen}

    def _smooth(
        self,
        factors: dict[str, float],
        seen: dict[str, list[float]],
        kind: str,
        calibrate: list[float] | None = None,
    ) -> None:
        """``factors`` <- EMA with each node's median observation (a node's first
        observation starts from the baseline: the median of ``calibrate``, else of every
        observation, in the first round observed)."""
        if not seen:
            return
        if kind not in self.baselines:  # the first round observed calibrates the run
            every = calibrate or [v for obs in seen.values() for v in obs]
            self.baselines[kind] = float(np.median(every))
        a, base = self.smoothing, self.baselines[kind]
        for node, obs in seen.items():
            prior = factors.get(node, base)
            factors[node] = _clip((1 - a) * prior + a * float(np.median(obs)))

    def factors(self, name: str) -> tuple[float, float]:
        """``name``'s (compute, link) factors; the baselines for a node not measured."""
        b = self.baselines
        return self.compute.get(name, b.get("compute", 1.0)), self.link.get(
            name, b.get("link", 1.0)
        )

    def profiles(self, nodes: Sequence[NodeProfile]) -> list[NodeProfile]:
        """``nodes`` (by name) as their benchmark profiles times their factors."""
        base = {n.name: n for n in self.base}
        out = []
        for n in nodes:
            b = base.get(n.name, n)
            c, g = self.factors(n.name)
            out.append(
                replace(
                    b,
                    layer_fwd_s=tuple(t * c for t in b.layer_fwd_s),
                    layer_bwd_s=tuple(t * c for t in b.layer_bwd_s),
                    latency_s=b.latency_s * g,
                    bandwidth_bps=b.bandwidth_bps / g,
                    node_id=n.node_id,
                )
            )
        return out


# -- predicted times ---------------------------------------------------------------------
def round_time(fp: planning.FederatedPlanned, cost_of: Callable[[Any], float]) -> float:
    """The federated plan's round time (s) with each pipeline's step time from
    ``cost_of(owner_pipeline)``: a pipeline starts when those in its ``after`` end."""
    ends: list[float] = []
    for p in fp.fplan.pipelines:
        start = max((ends[j] for j in p.after), default=0.0)
        ends.append(start + p.steps * cost_of(p))
    return max(ends, default=0.0)


def step_on(
    layers: Sequence[LayerProfile],
    nodes: Sequence[NodeProfile],
    schedule: Any,
    plan: Any,  # noqa: ANN401
) -> float:
    """``plan``'s predicted step time (s) on the profiles ``nodes`` (by name)."""
    by_name = {n.name: n for n in nodes}
    group = [by_name[st.node] for st in plan.stages]
    spec = [(k, st.first_layer, st.last_layer) for k, st in enumerate(plan.stages)]
    return float(CostModel(list(layers), group, schedule).step_time(spec))


def moved_state(
    old: planning.FederatedPlanned,
    new: planning.FederatedPlanned,
    layers: Sequence[LayerProfile],
    nodes: Sequence[NodeProfile],
    optimizer_state: bool,
) -> tuple[int, float, list[dict[str, Any]]]:
    """What the migration from ``old`` to ``new`` moves: ``(bytes, seconds, moves)``;
    per pipeline and layer whose node changes, its weights (+ optimizer state) over the
    old node's link to the server and the server's to the new node (latency + bytes /
    bandwidth each)."""
    by_name = {n.name: n for n in nodes}

    def owner_map(fp: planning.FederatedPlanned) -> dict[str, dict[int, str]]:
        return {
            p.owner: {
                j: st.node for st in p.plan.stages for j in range(st.first_layer, st.last_layer + 1)
            }
            for p in fp.fplan.pipelines
        }

    before, after = owner_map(old), owner_map(new)
    total, seconds, moves = 0, 0.0, []
    for owner, layout in after.items():
        for j, dst in layout.items():
            src = before.get(owner, {}).get(j)
            if src is None or src == dst:
                continue
            nbytes = layers[j].weight_bytes + (
                layers[j].optimizer_state_bytes if optimizer_state else 0
            )
            for name in (src, dst):
                n = by_name.get(name)
                if n is not None:
                    bw = (
                        n.bandwidth_bps
                        if n.bandwidth_bps and math.isfinite(n.bandwidth_bps)
                        else math.inf
                    )
                    seconds += n.latency_s + nbytes / bw
            total += nbytes
            moves.append({"owner": owner, "layer": j, "from": src, "to": dst, "bytes": nbytes})
    return total, seconds, moves


# -- a plan with other cuts (replan.mode=force) ------------------------------------------
def shifted_plan(
    fp: planning.FederatedPlanned,
    layers: Sequence[LayerProfile],
    nodes: Sequence[NodeProfile],
    schedule: Any,  # noqa: ANN401 - sky_flower.core.cost.Schedule
    direction: int,
) -> planning.FederatedPlanned | None:
    """``fp`` with every pipeline's first cut moved by one layer (``direction`` +1: a
    layer from stage 1 to stage 0, -1: back), each stage keeping at least one layer and
    fitting its node's memory (else the other direction); None when no pipeline changes."""
    by_name = {n.name: n for n in nodes}
    pipes, changed = [], False
    for op in fp.fplan.pipelines:
        stages = op.plan.stages
        new = None
        for d in (direction, -direction) if len(stages) > 1 else ():
            cut = stages[0].last_layer + d
            if not stages[0].first_layer <= cut < stages[1].last_layer:
                continue
            bounds = [(st.first_layer, st.last_layer) for st in stages]
            bounds[0], bounds[1] = (bounds[0][0], cut), (cut + 1, bounds[1][1])
            group = [by_name[st.node] for st in stages]
            cost = CostModel(list(layers), group, schedule)
            try:
                plan = make_plan(
                    cost, op.plan.method, [(k, a, b) for k, (a, b) in enumerate(bounds)], 0.0
                )
            except ValueError:  # memory
                continue
            new = replace(plan, note=f"forced re-plan (replan.mode=force): first cut {d:+d}")
            break
        changed = changed or new is not None
        pipes.append(replace(op, plan=new) if new is not None else op)
    if not changed:
        return None
    fplan = replace(fp.fplan, pipelines=tuple(pipes))
    planned = tuple(planning.owner_planned(p, layers, nodes, schedule) for p in pipes)
    return planning.FederatedPlanned(fplan, planned, fp.alternatives, fp.alternative_rounds)


# -- the decision ------------------------------------------------------------------------
@dataclass
class ReplanRecord(RecordFields):
    """A re-plan weighed after a round (:func:`decide`): the round measured, the current
    and the new plan's round predicted on the updated profiles, their ratio, the new
    plan's expected round and gain, the migration (bytes, s, layers moved), both plans
    (:func:`layouts`). Those taken are ``results.json``'s ``replans``, with after which
    round, the drift, the nodes joined and the reason
    (:meth:`sky_flower.sky.rounds.planner.Planner.taken`); a candidate equal to the
    current plan has ``reason`` alone."""

    measured_round_s: float
    forced: bool
    predicted_current_round_s: float | None = optional()
    predicted_new_round_s: float | None = optional()
    measured_over_predicted: float | None = optional()
    expected_new_round_s: float | None = optional()
    predicted_gain: float | None = optional()
    migration_bytes: int | None = optional()
    migration_s: float | None = optional()
    moved_layers: list[dict[str, Any]] | None = optional()
    old_plan: dict[str, list[list[Any]]] | None = optional()
    new_plan: dict[str, list[list[Any]]] | None = optional()
    after_round: int | None = optional()
    drift: str | None = optional()
    joined: list[str] | None = optional()
    reason: str | None = optional()


@dataclass(frozen=True)
class Decision:
    """Whether to run ``new`` from the next round, and why (``record``: the
    ``replans`` entry of ``results.json``)."""

    take: bool
    new: planning.FederatedPlanned | None
    record: ReplanRecord


def layouts(fp: planning.FederatedPlanned) -> dict[str, list[list[Any]]]:
    """Owner -> ``[node, first, last]`` per stage (the ``replans`` entries' plans)."""
    return {
        p.owner: [[st.node, st.first_layer, st.last_layer] for st in p.plan.stages]
        for p in fp.fplan.pipelines
    }


def decide(  # noqa: PLR0913
    cfg: ReplanSettings,
    current: planning.FederatedPlanned,
    candidate: planning.FederatedPlanned | None,
    layers: Sequence[LayerProfile],
    nodes: Sequence[NodeProfile],
    schedule: Any,  # noqa: ANN401 - sky_flower.core.cost.Schedule
    measured_round_s: float,
    rounds_left: int,
    optimizer_state: bool,
) -> Decision:
    """Take ``candidate`` (planned on the updated profiles ``nodes``) instead of
    ``current``? See the module docstring: with ``r = measured / predicted`` of the
    current plan's round on ``nodes``, the candidate's expected round is ``r x`` its
    prediction plus the migration spread over ``rounds_left`` rounds; it is taken when
    that is below ``(1 - threshold) x measured`` (always under ``force``, if it differs)."""
    forced = cfg.mode == "force"
    if candidate is None or layouts(candidate) == layouts(current):
        why = "the re-planned plan is the current one"
        return Decision(False, None, ReplanRecord(measured_round_s, forced, reason=why))
    cur_pred = round_time(current, lambda p: step_on(layers, nodes, schedule, p.plan))
    new_pred = round_time(candidate, lambda p: step_on(layers, nodes, schedule, p.plan))
    ratio = measured_round_s / cur_pred if cur_pred > 0 else 1.0
    nbytes, mig_s, moves = moved_state(current, candidate, layers, nodes, optimizer_state)
    expected = ratio * new_pred + mig_s / max(rounds_left, 1)
    gain = 1.0 - expected / measured_round_s if measured_round_s > 0 else 0.0
    rec = ReplanRecord(
        measured_round_s,
        forced,
        predicted_current_round_s=cur_pred,
        predicted_new_round_s=new_pred,
        measured_over_predicted=ratio,
        expected_new_round_s=expected,
        predicted_gain=gain,
        migration_bytes=nbytes,
        migration_s=mig_s,
        moved_layers=moves,
        old_plan=layouts(current),
        new_plan=layouts(candidate),
    )
    take = forced or gain > cfg.threshold
    return Decision(take, candidate if take else None, rec)


def drift_text(drifted: Mapping[str, tuple[float, float]], top: int = 3) -> str:
    """The nodes whose compute factor moved most this round, as text."""
    order = sorted(drifted.items(), key=lambda kv: -abs(math.log(kv[1][1] / kv[1][0])))
    return ", ".join(f"{n} compute x{was:.2f} -> x{now:.2f}" for n, (was, now) in order[:top])


def joined_text(joined: Sequence[str] | None) -> str:
    """``"a, b joined"`` for the nodes admitted mid-run ("" for none)."""
    return f"{', '.join(joined)} joined" if joined else ""


def log_decision(rnd: int, d: Decision) -> None:
    """Log a re-plan with its reason: the nodes that drifted most, the gain, the
    migration."""
    r = d.record
    log(
        INFO if not r.forced else WARNING,
        "Re-plan after round %d%s: %s; measured round %.3f s, new plan expected %.3f s "
        "(gain %.1f %%), migration %d bytes (%.3f s): %s -> %s",
        rnd,
        " (forced)" if r.forced else "",
        "; ".join(x for x in (joined_text(r.joined), r.drift) if x) or "no drift measured",
        r.measured_round_s,
        r.expected_new_round_s,
        100 * r.predicted_gain,
        r.migration_bytes,
        r.migration_s,
        r.old_plan,
        r.new_plan,
    )
