"""Stage sessions on ``direct`` (:mod:`sky_flower.sky.transport.session`): one
``train.sky_direct`` per stage for many rounds, the stages' process group living across
them, every round started and ended over a TLS control stream.

Real parts: Sky's strategy and ClientApps, every message in a fresh process
(``tests/reference.py``'s ``ConcurrentGrid``: a session's set-up runs beside the
node's other messages, as Flower 1.42's SuperExec launches a ClientApp process per
message), real gloo groups, a real gRPC endpoint with TLS on 127.0.0.1. A session runs
the same steps on the same weights as per-round messages, so the comparison is bit for
bit (``torch.equal``)."""

from __future__ import annotations

import pytest
import torch
from reference import ConcurrentGrid, run_sky_app, sky_app_on_grid
from sky_flower.strategies.sky import SkyNodeError

from sky_flower.sky import protocol as P

RUN = {
    "benchmark-repeats": 1,
    "echo-repeats": 1,
    "state-probe-mb": 0.0,
    "allocation": "even",
    "fleet": "uniform3",
    "transport": "direct",
    "microbatches": 4,
    "steps-per-round": 2,
    "direct-timeout-s": 20.0,
    "direct-join-timeout-s": 30.0,
}


def _direct_messages(grid: ConcurrentGrid) -> int:
    return sum(1 for _, t in grid.handled if t == P.DIRECT)


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_three_rounds_in_one_session_equal_a_set_up_per_round(kind, server_identity):
    """3 stages, 3 rounds: with sessions, one ``train.sky_direct`` per stage for the
    whole run (round 1's), none in rounds 2 and 3; the global model after every round
    and the losses equal those of per-round set-up messages, bit for bit."""
    run = {**RUN, "schedule-kind": kind, "num-server-rounds": 3}
    on, on_result, on_grid = run_sky_app(ConcurrentGrid, {**run, "stream-sessions": True})
    off, off_result, off_grid = run_sky_app(ConcurrentGrid, {**run, "stream-sessions": False})
    assert all(r.error is None for r in on.rounds + off.rounds), (on.rounds, off.rounds)
    assert _direct_messages(on_grid) == 3 and _direct_messages(off_grid) == 9
    assert [r.flower_messages for r in on.rounds] == [3, 0, 0]
    assert [r.session_round for r in on.rounds] == [1, 2, 3]
    assert [r.train_loss for r in on.rounds] == [r.train_loss for r in off.rounds]
    got, want = on_result.arrays.to_torch_state_dict(), off_result.arrays.to_torch_state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.processes
def test_a_stage_that_crashes_mid_session_fails_its_round_by_name(server_identity):
    """node1 (stage 1) crashes in round 2 before its step 1, inside its session: round 2
    fails naming it first, then the stages that saw their peer fail, within the peers'
    timeout; node1 is dropped and round 3 trains in a fresh session of the new plan."""
    run = {**RUN, "schedule-kind": "gpipe", "num-server-rounds": 3, "stream-sessions": True}
    run |= {"direct-timeout-s": 8.0}
    fault = {
        "sky-fail-on": P.DIRECT,
        "sky-fail-mode": "crash",
        "sky-fail-round": 2,
        "sky-fail-step": 1,
    }
    strategy, grid, start = sky_app_on_grid(ConcurrentGrid, run, {1: fault})
    try:
        try:
            strategy.start(**start)
        except SkyNodeError:
            pass
    finally:
        grid.close()
    rounds = strategy.rounds
    assert rounds[0].error is None
    error = rounds[1].error
    assert error.startswith("round 2 failed: stage 1 on node1"), error
    assert "stage 0 on node0" in error and "peer stage failed or stalled" in error
    assert rounds[1].round_time_s < 60  # bounded by the peers' 8 s, not the 120 s
    # node1 dropped (failure policy): a new plan, a fresh session of two set-ups
    third = rounds[2]
    assert third.error is None and [s.node for s in third.stages] == [
        "node0",
        "node2",
    ]
    assert third.flower_messages == 2 and third.session_round == 1


@pytest.mark.processes
@pytest.mark.slow
def test_a_session_keeps_the_optimizer_state_as_set_ups_per_round_do(server_identity):
    """``train.optimizer_state=keep``: each round of a session starts from the optimizer
    state it ended the last one with, as set-up messages per round start from the state
    the server kept; the global model after every round is the same, bit for bit."""
    run = {**RUN, "schedule-kind": "1f1b", "num-server-rounds": 3, "optimizer-state": "keep"}
    on, on_result, _ = run_sky_app(ConcurrentGrid, {**run, "stream-sessions": True})
    off, off_result, _ = run_sky_app(ConcurrentGrid, {**run, "stream-sessions": False})
    assert all(r.error is None for r in on.rounds + off.rounds), (on.rounds, off.rounds)
    assert [r.flower_messages for r in on.rounds] == [3, 0, 0]
    assert [r.train_loss for r in on.rounds] == [r.train_loss for r in off.rounds]
    got, want = on_result.arrays.to_torch_state_dict(), off_result.arrays.to_torch_state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
