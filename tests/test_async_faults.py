"""Issue 17 on the asynchronous strategies (Hermes, BSP, ASP, SSP) and the decentralized
ones, in this process through Flower's real ClientApps (the grids of ``test_exchange.py``):
a non-finite reply is discarded by name and the global model stays finite; a worker
silent past its deadline leaves the member set by name, BSP's barrier stops waiting for
it, and the run goes on or fails by ``min_live_workers``; a removed worker's late reply
is dropped or kept by ``staleness_policy``; a non-finite gossip gradient stops the run by
name."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import numpy as np
import pytest
from flwr.app import Message
from sky_flower.strategies.decentralized import DecentralizedNodeError, DPSGDStrategy
from sky_flower.strategies.hermes import STRATEGIES, HermesNodeError
from test_exchange import HoldingGrid, ThreadedGrid, _decentralized, _hermes, server_identity

from sky_flower.flower.finite import NonFiniteError
from sky_flower.flower.vectors import vector_record
from sky_flower.gossip.matrices import gossip_matrix
from sky_flower.hermes.server import LossWeightedMerger

__all__ = ["server_identity"]  # the autouse fixture of test_exchange.py, used here too

ROUND = "train.hermes_round"


class FaultyGrid(ThreadedGrid):
    """:class:`test_exchange.ThreadedGrid` with two faults on ``train.hermes_round``:
    ``nan[node] = r``: the model in node's reply to its round ``r`` is all ``NaN``
    (``"all"``: in every reply);
    ``stall[node] = r``: from its round ``r`` on, node's reply is held back until
    ``release`` is set (or ``stall_s`` seconds have passed)."""

    def __init__(self, app, num_nodes, nan=None, stall=None, stall_s=None) -> None:  # noqa: ANN001
        super().__init__(app, num_nodes)
        self.nan, self.stall, self.stall_s = dict(nan or {}), dict(stall or {}), stall_s
        self.release = threading.Event()

    def _handle(self, msg: Message) -> Message:
        reply = super()._handle(msg)
        if msg.metadata.message_type != ROUND or reply.has_error():
            return reply
        nid, rnd = msg.metadata.dst_node_id, int(msg.content.config_records["cfg"]["round"])
        bad = self.nan.get(nid) in (rnd, "all")
        if bad and "model" in reply.content.array_records:
            dim = reply.content.array_records["model"]["x"].shape[0]
            reply.content["model"] = vector_record("x", np.full(dim, np.nan))
        if nid in self.stall and rnd >= self.stall[nid]:
            self.release.wait(self.stall_s)
        return reply


def _run(name: str, grid_faults: dict, **settings):  # noqa: ANN003, ANN202
    """``name`` on 3 workers (slowdowns 0, 1, 2) on a :class:`FaultyGrid`; returns the
    strategy and the grid (the caller releases a stall)."""
    model, plain, common, val_loss = _hermes(3)
    grid = FaultyGrid(plain.app_fn(), 3, **grid_faults)
    extra = {"val_loss_fn": val_loss, "profile_repeats": 1} if name == "hermes" else {}
    base = {**common, "batch_size": 32, "max_time_s": 20.0}
    strategy = STRATEGIES[name](**{**base, **settings}, **extra)
    strategy.ready_hold_s, strategy.ready_limit_s = 0.1, 0.5  # a short readiness barrier
    return strategy, grid, model


def _start(strategy, grid, model, num_rounds: int = 3):  # noqa: ANN001, ANN202
    try:
        return strategy.start(
            grid=grid, initial_arrays=vector_record("x", model.initial(0)), num_rounds=num_rounds
        )
    finally:
        grid.release.set()


# --- non-finite updates ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bsp", "asp", "hermes"])  # SSP applies as ASP
def test_a_nan_update_is_discarded_by_name_and_the_global_model_stays_finite(name, caplog):
    """Worker 1's first reply is all NaN (once: BSP, ASP and SSP made the global model NaN,
    Hermes raised a bare ValueError from its merge). Now: discarded with a warning naming
    worker 1, recorded, and the run goes on with worker 1 (it gets the global model)."""
    strategy, grid, model = _run(name, {"nan": {102: 0}})
    with caplog.at_level(logging.WARNING):
        result = _start(strategy, grid, model, num_rounds=2)
    assert np.isfinite(strategy.global_vec).all()
    assert np.isfinite(result.arrays["x"].numpy()).all()
    (row,) = strategy.members.rejected
    assert (row["worker"], row["round"], row["name"]) == (1, 0, "worker 1 (node 102)")
    assert "non-finite" in row["reason"] and "worker 1 (node 102)'s update" in row["reason"]
    assert "worker 1 (node 102): update of its round 0 discarded" in caplog.text
    rows = strategy.worker_rows()
    assert rows[1]["rejected"] == 1 and strategy.clock == [2, 2, 2]
    assert all(r["rounds"] == r["updates_sent"] + r["minor_rounds"] + r["rejected"] for r in rows)
    assert not strategy.members.removals


@pytest.mark.parametrize("min_live", [None, 2])
def test_a_worker_whose_updates_are_always_nan_is_removed(min_live, caplog):
    """Worker 1 diverges in every round (its update is NaN although it starts from the
    finite global model): once, it stayed in the run forever with every update rejected.
    Now three rejections in a row remove it like a failed worker: by default the run fails
    naming it; with min_live_workers=2 the others go on and the model stays finite."""
    strategy, grid, model = _run("asp", {"nan": {102: "all"}}, min_live_workers=min_live)
    with caplog.at_level(logging.WARNING):
        if min_live is None:
            with pytest.raises(
                HermesNodeError, match=r"3 rejected in a row: worker 1 \(node 102\)"
            ):
                _start(strategy, grid, model, num_rounds=6)
        else:
            _start(strategy, grid, model, num_rounds=6)
            assert np.isfinite(strategy.global_vec).all()
    assert [r["worker"] for r in strategy.members.rejected] == [1, 1, 1]
    (row,) = strategy.members.removals
    assert row["worker"] == 1 and "3 rejected in a row" in row["reason"]


def test_hermes_merge_takes_a_zero_loss_and_refuses_a_nan_loss_by_name():
    """The merger once raised on a validation loss of exactly 0; now the zero-loss model
    is taken (the limit of the 1 / loss weights). A NaN loss is a NonFiniteError, and the
    global model and its cached loss stay."""
    g, u = np.zeros(3), np.ones(3)
    perfect = LossWeightedMerger(lambda v: 0.0 if v.sum() == 3 else 0.5)
    np.testing.assert_array_equal(perfect.merge(g, u), u)
    broken = LossWeightedMerger(lambda v: float("nan") if v.sum() == 3 else 0.5)
    with pytest.raises(NonFiniteError, match="update's validation loss"):
        broken.merge(g, u)
    assert broken.global_loss == 0.5


# --- membership ------------------------------------------------------------------------
@pytest.mark.realtime
@pytest.mark.parametrize("name", ["bsp"])  # SSP's bound counts the live workers the same way
def test_a_silent_worker_is_removed_by_name_and_the_barrier_stops_waiting(name, caplog):
    """Worker 1 answers round 0, then goes silent. With min_live_workers=2 it is removed
    after message_timeout_s, named, and the others finish their rounds (BSP's barrier and
    SSP's bound no longer count it); the removal is recorded."""
    strategy, grid, model = _run(  # a deadline far above a healthy round at load 12
        name, {"stall": {102: 1}}, message_timeout_s=4.0, min_live_workers=2, staleness=0
    )
    with caplog.at_level(logging.WARNING):
        _start(strategy, grid, model, num_rounds=4)
    assert strategy.clock == [4, 1, 4]
    (row,) = strategy.members.removals
    assert (row["worker"], row["round"]) == (1, 1)
    assert row["reason"] == "no reply within 4 s from worker 1 (node 102)"
    assert "removing worker 1 (node 102) from the run in its round 1" in caplog.text
    assert strategy.members.live == {0, 2} and hasattr(strategy, "wall_time_s")
    assert np.isfinite(strategy.global_vec).all()


@pytest.mark.realtime
@pytest.mark.parametrize(("name", "max_time_s", "stall_round"), [("asp", 20.0, 1), ("bsp", 0.8, 0)])
def test_a_silent_worker_fails_the_run_by_default_naming_it(name, max_time_s, stall_round):
    """Default min_live_workers (all): the first removal fails the run, naming the worker
    (docs/hermes.md's promise for message_timeout_s). BSP with max_time_s below the deadline
    once waited at its barrier until max_time_s and returned normally: now the rounds still
    running at the end get their deadline too. BSP's worker 1 stalls from its first round,
    which is running at 0.8 s on any machine (from its second, a loaded machine had not
    sent it by then and the run ended cleanly)."""
    strategy, grid, model = _run(
        name, {"stall": {102: stall_round}}, message_timeout_s=4.0, max_time_s=max_time_s
    )  # a deadline far above a healthy round (worker 2 took over 1 s at load 12)
    with pytest.raises(HermesNodeError, match=r"4 s from worker 1 \(node 102\).*2 of 3") as e:
        _start(strategy, grid, model, num_rounds=50)
    assert e.value.node_ids == [102] and e.value.nodes == ["worker 1"]
    assert [r["worker"] for r in strategy.members.removals] == [1]


@pytest.mark.realtime
@pytest.mark.parametrize("policy", ["discard", "keep"])
def test_a_removed_workers_late_update_follows_the_staleness_policy(policy):
    """Worker 1's round 1 comes back 3.9 s late (deadline 3 s, far above a healthy round
    on a loaded machine, where 1 s was not): it is removed either way; its late update is
    applied only under ``keep``."""
    strategy, grid, model = _run(
        "asp",
        {"stall": {102: 1}, "stall_s": 3.9},
        message_timeout_s=3.0,
        min_live_workers=1,
        staleness_policy=policy,
        max_time_s=6.0,  # the late update (at about 3.9 s) lands well before the end
    )
    _start(strategy, grid, model, num_rounds=10**6)
    # worker 1 is removed for its late round 1; on a loaded machine a healthy worker can
    # miss the 1 s deadline too (also removed, by the same rule), which this test is not about
    removed = {r["worker"]: r["round"] for r in strategy.members.removals}
    assert removed.get(1) == 1, strategy.members.removals
    assert strategy.updates_sent[1] == (2 if policy == "keep" else 1)
    assert strategy.clock[1] == (2 if policy == "keep" else 1)


def test_membership_settings_are_checked():
    with pytest.raises(ValueError, match=r"min_live_workers must be an integer in \[1, 3\]"):
        _run("bsp", {}, min_live_workers=4)
    with pytest.raises(ValueError, match="staleness_policy must be one of discard, keep"):
        _run("bsp", {}, staleness_policy="forever")


# --- decentralized -----------------------------------------------------------------------
class NaNGradGrid(HoldingGrid):
    """:class:`test_exchange.HoldingGrid` whose node ``node``'s gradient of step ``step``
    is all ``NaN``."""

    def __init__(self, app, num_nodes, node: int, step: int) -> None:  # noqa: ANN001
        super().__init__(app, num_nodes)
        self.node, self.step = node, step

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages, strict=True):
            cfg = msg.content.config_records.get("cfg")
            if msg.metadata.dst_node_id == self.node and cfg and cfg["step"] == self.step:
                dim = self.replies[mid].content.array_records["grad"]["grad"].shape[0]
                self.replies[mid].content["grad"] = vector_record("grad", np.full(dim, np.nan))
        return ids


def test_a_nan_gossip_gradient_stops_the_run_by_name_with_finite_models():
    model, app = _decentralized(3, 3)
    strategy = DPSGDStrategy(gossip=gossip_matrix("complete", 3), poll_interval_s=0.0)
    grid = NaNGradGrid(app, 3, node=102, step=1)
    with pytest.raises(DecentralizedNodeError, match=r"position 1 \(node 102\)'s gradient") as e:
        strategy.start(grid=grid, initial_arrays=vector_record("x", model.initial(0)), num_rounds=3)
    assert e.value.node_ids == [102] and isinstance(e.value.__cause__, NonFiniteError)
    assert np.isfinite(strategy.algorithm.x).all()
    assert [r["round"] for r in strategy.rounds] == [0, 1]  # step 1 was not taken
