"""The direct runner: one round peer to peer in a ``torch.distributed.pipelining``
schedule (GPipe or 1F1B, :mod:`sky_flower.pipeline.direct` runs it on the nodes).

The server hosts the round's TCPStore, pushes one ``train.sky_direct`` message per stage
(its layer slice, settings, rank, the node it is planned for and the round's
rendezvous: only these messages carry it), and waits for every stage's weights and
timings.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from sky_flower.core.cost import Schedule
from sky_flower.emulation.devices import EMULATED_S
from sky_flower.flower.exchange import Exchange, short_reason
from sky_flower.pipeline.device import direct_backend
from sky_flower.pipeline.direct import PEER_FAILURE, RoundHost, stage_input_shapes
from sky_flower.pipeline.engine import MULTI_CHUNK
from sky_flower.pipeline.stage import slice_state
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.guard import check_stages
from sky_flower.sky.transport.hops import migrated_state, optimizer_records, stage_config
from sky_flower.sky.transport.records import StageRecord
from sky_flower.sky.transport.runner import Pipeline, RoundOutcome, Runner, message


def plan_kind(plan: Pipeline, schedule: Schedule) -> str:
    """The schedule a pipeline runs: the one its plan records (``auto`` picked it), else
    the configured one."""
    return str(plan.plan.schedule.get("kind", schedule.kind))


def kinds_label(runner_cls: Any, runs: Sequence[Any], schedule: Schedule) -> str:  # noqa: ANN401
    """``"<runner_cls.label>, <kinds>"`` for the round log: the schedule kinds the pipelines of
    ``runs`` (each with a ``pipeline``) run, i.e. what ``auto`` picked, not ``auto``
    (``"direct, 1f1b"``, ``"direct, gpipe/1f1b"``)."""
    kinds = sorted({plan_kind(r.pipeline, schedule) for r in runs})
    return f"{runner_cls.label}, {'/'.join(kinds) or schedule.kind}"


def chunk_plan(plan: Pipeline, s: Any, S: int) -> list[dict[str, str]] | None:  # noqa: ANN401
    """Per rank, the :class:`~sky_flower.sky.protocol.DirectConfig` chunk fields of a
    chunked plan (``interleaved``, ``zero_bubble``: chunk ``c`` on rank ``c mod S``),
    or None for one stage per rank."""
    layers = plan.plan.schedule.get("chunk_layers")
    if plan_kind(plan, s.schedule) not in MULTI_CHUNK or not layers:
        return None
    bounds = [(int(a), int(b)) for a, b in layers]
    shapes = stage_input_shapes(s.model_fn, list(s.input_shape), bounds, s.input_dtype)
    out = []
    for k in range(S):
        mine = range(k, len(bounds), S)
        layers_k = [v for c in mine for v in (c, *bounds[c])]
        shapes_k = [v for c in mine for v in (len(shapes[c]), *shapes[c])]
        out.append(
            {
                "chunk_layers": " ".join(map(str, layers_k)),
                "chunk_shapes": " ".join(map(str, shapes_k)),
            }
        )
    return out


class DirectRunner(Runner):
    """Runs a round on the direct transport.

    Waits at most ``message_timeout_s`` plus ``stage_multiple`` x the predicted round
    (:mod:`sky_flower.sky.transport.deadlines`); once one stage
    has failed, at most ``direct_timeout_s`` + 5 s more for the others (they stop within
    ``direct_timeout_s`` mid-round: gloo's timeout, or at once when a peer's sockets
    close).

    """

    label = "direct"
    peer_links = True  # stages talk peer to peer: the benchmark takes the emulated links
    calibrate = True  # and times the gloo step's fixed costs (issue 16)

    @staticmethod
    def check_schedule(schedule: Schedule) -> None:
        """Refuse ``schedule.kind=sequential`` (torch's pipelining runs gpipe, 1f1b,
        interleaved, zero_bubble; ``auto`` picks one).

        Raises
        ------
        ValueError
            Naming every kind/transport pair that runs.
        """
        if schedule.kind == "sequential":
            raise ValueError(
                "schedule.kind=sequential runs on transport=relay, gpipe and 1f1b on "
                "transport=direct (torch.distributed.pipelining, with interleaved, "
                "zero_bubble and auto) and on relay: got "
                "kind=sequential, transport=direct"
            )

    def check_plan(self, plan: Pipeline) -> None:
        """Refuse ``1f1b`` with fewer micro-batches than stages.

        Raises
        ------
        ValueError
            Saying how to fix it.
        """
        S, M = plan.num_stages, self.s.schedule.microbatches
        if plan_kind(plan, self.s.schedule) == "1f1b" and M < S:
            raise ValueError(
                f"schedule.kind=1f1b needs at least as many micro-batches as stages: the "
                f"plan has {S} stages, schedule.microbatches={M}. Raise "
                f"schedule.microbatches to >= {S} (dividing schedule.batch_size) or use "
                "schedule.kind=gpipe"
            )

    def run_round(
        self, grid: Grid, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int
    ) -> RoundOutcome:
        """Host the rendezvous, run the round on the stages, merge their weights (see
        :meth:`Runner.run_round`). An error names the stage(s) that failed or did not
        answer first, then those that stopped waiting for them; ``nodes`` holds only
        the former."""
        s, S = self.s, plan.num_stages
        budget = s.deadline("stage", steps * plan.plan.predicted_step_time_s)
        ex = s.exchange(grid, timeout_s=budget)
        t0 = time.perf_counter()
        backend = direct_backend([d for _, d in plan.devices], [h for h, _ in plan.devices])
        with RoundHost(
            S, s.direct_timeout_s, s.direct_host, s.direct_join_timeout_s, backend
        ) as host:
            ids = ex.push(self.configure(plan, arrays, steps, server_round, host))
            got = self.collect(ex, ids)
        wall = time.perf_counter() - t0
        self.raise_failures(ex, plan, ids, got, budget)
        replies = [got[m] for m in ids]
        try:
            return self.parse(ex, plan, replies, arrays, steps, wall)
        except (KeyError, TypeError, ValueError, IndexError) as err:  # a malformed reply
            raise ex.fail(f"a stage sent a malformed reply: {type(err).__name__}: {err}") from err

    def configure(
        self, plan: Pipeline, arrays: ArrayRecord, steps: int, server_round: int, host: RoundHost
    ) -> list[Message]:
        """One ``train.sky_direct`` message per stage: :class:`DirectConfig` and its
        weights."""
        full = arrays.to_torch_state_dict()
        stages, session = plan.plan.stages, P.new_session()
        bounds = [(st.first_layer, st.last_layer) for st in stages]
        shapes = stage_input_shapes(
            self.s.model_fn, list(self.s.input_shape), bounds, self.s.input_dtype
        )

        def link(k: int) -> tuple[float, float]:
            return plan.links[k] if 0 <= k < len(stages) else (0.0, 0.0)

        kind = plan_kind(plan, self.s.schedule)
        chunked = chunk_plan(plan, self.s, S=len(stages))
        msgs = []
        for k, st in enumerate(stages):
            (lat, bw), (nlat, nbw), (plat, pbw) = link(k), link(k + 1), link(k - 1)
            cfg = P.DirectConfig(
                stage=stage_config(self.s, k, st.first_layer, st.last_layer, server_round, session),
                rendezvous=host.rendezvous(k),
                links=P.DirectLinks(lat, bw, nlat, nbw, plat, pbw),
                kind=kind,
                steps=steps,
                input_shape=tuple(shapes[k]),
                node_id=plan.node_ids[k],
                input_dtype=self.s.input_dtype if k == 0 else "float32",  # activations
                **(chunked[k] if chunked else {}),
            )
            parts = (
                [int(v) for v in chunked[k]["chunk_layers"].split()]
                if chunked
                else [k, st.first_layer, st.last_layer]
            )
            weights = ArrayRecord(
                {
                    key: v
                    for c in range(0, len(parts), 3)
                    for key, v in slice_state(full, parts[c + 1], parts[c + 2]).items()
                }
            )
            content = {P.ARRAYS: weights, P.CONFIG: cfg.to_config_record()}
            content.update(migrated_state(self.s, plan, k))  # train.optimizer_state=keep
            msgs.append(message(plan.node_ids[k], P.DIRECT, content, str(server_round)))
        return msgs

    def collect(self, ex: Exchange, ids: Sequence[str]) -> dict[str, Message]:
        """Every stage's reply, or those that came before the deadline (a stage's error
        shortens the others' deadlines to ``direct_timeout_s`` + 5 s)."""
        got: dict[str, Message] = {}
        while len(got) < len(ids):
            for reply in ex.poll(ids, raise_late=False):
                got[reply.metadata.reply_to_message_id] = reply
                if reply.has_error():  # the others stop within direct_timeout_s
                    ex.shorten(self.s.direct_timeout_s + 5.0)
            if ex.late(ids):  # the missing ones are named by the caller
                return got
            if len(got) < len(ids) and ex.poll_interval_s > 0:
                time.sleep(ex.poll_interval_s)
        return got

    @staticmethod
    def raise_failures(
        ex: Exchange, plan: Pipeline, ids: Sequence[str], got: dict[str, Message], budget: float
    ) -> None:
        """Raise one error naming the stages that failed or stayed silent, then those
        that stopped because of them (``nodes``: the former only)."""
        culprits, waited, causes = [], [], []
        for k, mid in enumerate(ids):
            nid = plan.node_ids[k]
            who = f"stage {k} on {ex.name(nid)}"
            if mid not in got:
                culprits.append(f"{who} did not answer within {budget:g} s")
                causes.append(nid)
            elif got[mid].has_error():
                reason = short_reason(got[mid].error.reason)
                peer = PEER_FAILURE in reason
                (waited if peer else culprits).append(f"{who} failed: {reason}")
                if not peer:
                    causes.append(nid)
            elif P.STAGE_ERROR in got[mid].content.config_records:  # the stage's, not the node's
                culprits.append(f"{who} raised {got[mid].content[P.STAGE_ERROR]['error']}")
        if culprits or waited:
            raise ex.fail("; ".join(culprits + waited), causes or None)

    def parse(
        self,
        ex: Exchange,
        plan: Pipeline,
        replies: list[Message],
        arrays: ArrayRecord,
        steps: int,
        wall: float,
    ) -> RoundOutcome:
        """Check and merge the stages' replies (weights of the shapes sent, metrics for
        every step).

        Raises
        ------
        SkyNodeError
            Naming the node whose reply is malformed.
        """
        sent = {k: tuple(v.shape) for k, v in arrays.items()}
        metrics, slept = [], []
        for reply in replies:
            src = reply.metadata.src_node_id
            rec = reply.content.array_records.get(P.ARRAYS)
            for key in rec.keys() if rec is not None else ():
                if key not in sent or tuple(rec[key].shape) != sent[key]:
                    raise ex.fail(
                        f"{ex.name(src)}: weight {key!r} has shape {tuple(rec[key].shape)}, "
                        f"expected {sent.get(key)}",
                        [src],
                    )
            try:
                rec = reply.content.metric_records.get(P.METRICS)
                metrics.append(P.DirectMetrics.from_record(rec))
                slept.append(rec.get(EMULATED_S) if rec is not None else None)
            except P.ProtocolError as err:
                raise ex.fail(f"{ex.name(src)}: reply lacks metrics ({err})", [src]) from err
        new_arrays, sent, full = self.merge(replies, ex, arrays)
        check_stages(ex, plan, replies)  # finite or rejected (sky_flower.sky.transport.guard)
        outcome = self.outcome(ex, plan, new_arrays, metrics, steps, wall, slept)
        outcome.weights_bytes, outcome.full_weights_bytes = sent, full
        if self.s.optimizer_store is not None:  # each layer's state, for the next set-up
            self.s.optimizer_store.put(plan.plan.stages[0].node, optimizer_records(ex, replies))
        return outcome

    def outcome(
        self,
        ex: Exchange,
        plan: Pipeline,
        new_arrays: ArrayRecord,
        metrics: list[P.DirectMetrics],
        steps: int,
        wall: float,
        slept: list | None = None,
    ) -> RoundOutcome:
        """The round's outcome from the stages' metrics (the last stage's losses);
        ``slept``: per stage, the seconds its emulated slowdown slept where it said (its
        slowdown this round), else its compute times the benchmark's slowdown."""
        S, last = plan.num_stages, metrics[-1]
        times = np.array([list(m.step_times_s) for m in metrics], dtype=float)
        if times.shape != (S, steps) or len(last.losses) != steps:
            raise ex.fail(
                f"stages reported {times.shape} step times and {len(last.losses)} losses "
                f"for {S} stages x {steps} steps"
            )
        M = self.s.schedule.microbatches
        stages = [
            StageRecord(
                stage=k,
                node=st.node,
                measured_compute_s=(
                    m.compute_s + slept[k]
                    if slept and slept[k] is not None
                    else m.compute_s * (1.0 + plan.slowdowns[k])
                )
                / steps,
                predicted_compute_s=M * st.compute_s,
                median_step_s=float(np.median(times[k])),
            )
            for k, (st, m) in enumerate(zip(plan.plan.stages, metrics, strict=True))
        ]
        return RoundOutcome(
            arrays=new_arrays,
            losses=list(last.losses),
            correct=last.correct,
            seen=last.n,
            step_times=[float(t) for t in times.max(axis=0)],
            stages=stages,
            extra={"setup_s": max(m.setup_s for m in metrics), "wall_s": wall},
        )
