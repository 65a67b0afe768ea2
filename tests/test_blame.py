"""Faults blamed on their real cause (issue 30). In process (no Ray): the example app's
nodes on ``ProcessPerMessageGrid`` (node faults as error replies through ``ChaosGrid``).

- ``train.lr=1e8``: every stage goes non-finite in turn; the run says the training
  diverged, naming the learning rate and the round, and drops no node (it dropped the
  healthy helpers one after another);
- a helper whose own reply alone is non-finite is set aside for one round and dropped
  once the round without it trains finite;
- a node dropped for its own fault (a crash) that is listed again is profiled and
  admitted back with ``replan.mode=on`` (it stayed dropped), and reported with
  ``replan.mode=off``;
- :func:`sky_flower.sky.rounds.blame.judge`, the verdict, case by case.
"""

from __future__ import annotations

import pytest
from reference import ChaosGrid, ProcessPerMessageGrid, sky_app_on_grid

from sky_flower.sky import protocol as P
from sky_flower.sky.rounds.blame import Failure, judge
from sky_flower.sky.rounds.records import JoinRecord
from sky_flower.sky.rounds.recovery import TrainingDiverged

QUICK = {"benchmark-repeats": 1, "echo-repeats": 1, "state-probe-mb": 0.0, "allocation": "even"}
EDGE3 = {**QUICK, "fleet": "edge3", "steps-per-round": 1, "message-timeout-s": 10.0}


def _fault(mode: str, message_type: str, server_round: int) -> dict:
    """A node's ``sky-fail-*`` node config (:mod:`sky_flower.emulation.faults`)."""
    return {
        "sky-fail-on": message_type,
        "sky-fail-mode": mode,
        "sky-fail-round": server_round,
        "sky-fail-step": 0,
    }


def test_verdict_cases():
    """Diverged: the owner's stage 0, several stages, every pipeline, again after a
    suspect was set aside, or no round trained since a divergence. A suspect: one
    helper alone. Drops: only the nodes of failures that are not non-finite."""
    helper = Failure("a", ("h1",), (2,))
    assert judge([helper], 1).set_aside == ("h1",) and not judge([helper], 1).diverged
    assert "data owner a's own stage 0" in judge([Failure("a", ("a",), (0,))], 1).diverged
    assert "stages 1, 2 of a's pipeline" in judge([Failure("a", (), (1, 2))], 1).diverged
    both = judge([helper, Failure("b", ("h2",), (1,))], 2)
    assert "every pipeline (a, b)" in both.diverged and both.set_aside == ()
    one_of_two = judge([helper], 2)  # the other pipeline trained: a suspect
    assert one_of_two.set_aside == ("h1",) and not one_of_two.diverged
    again = judge([Failure("a", ("h2",), (1,))], 1, set_aside=["h1"])
    assert "after h1 was set aside" in again.diverged and again.set_aside == ()
    assert "no round has trained" in judge([helper], 1, diverging=True).diverged
    crash = Failure("b", ("h3",))  # silence / error reply: that node's own fault
    mixed = judge([crash, Failure("a", ("a",), (0,))], 2)
    assert mixed.drop == ("h3",) and mixed.diverged  # the crash drops its node, still
    assert judge([crash], 1).drop == ("h3",) and not judge([crash], 1).diverged


def test_huge_lr_says_diverged_and_drops_no_healthy_helper(server_identity):
    """Adam at ``lr=1e8`` on uniform3 (node0 owns the data, node1 and node2 help):
    round 1's last stage (node2) returns a NaN loss, round 2's (node1, node2 set aside)
    too. The run used to drop node2, then node1, then fail on node0 without a word
    about the learning rate; now node2 is only set aside, put back when node1 goes
    non-finite too, nobody is dropped, and the run ends saying the training diverged,
    naming ``train.lr`` and the round."""
    run = {**QUICK, "fleet": "uniform3", "lr": 1e8, "steps-per-round": 2}
    run |= {"num-server-rounds": 3, "max-failed-rounds": 3}
    strategy, _, start = sky_app_on_grid(ProcessPerMessageGrid, run)
    with pytest.raises(TrainingDiverged, match=r"diverged in round 3.*train\.lr.*now 1e\+08"):
        strategy.start(**start)
    assert [f.dropped_nodes for f in strategy.failed_rounds] == [[], [], []]
    assert sorted(n.name for n in strategy.node_profiles) == ["node0", "node1", "node2"]
    first, second, _ = strategy.failed_rounds
    assert first.set_aside == ["node2"] and first.restored_nodes == ["node2"]
    assert second.diverged and "after node2 was set aside" in second.error
    assert "stage 1 on node1" in second.error  # the reply that showed it, named
    assert strategy.dropped == {}


def test_a_helper_alone_nonfinite_is_set_aside_then_dropped(server_identity):
    """cloud (stage 1 of edge3) fills its round-1 forward reply with NaN: it is set
    aside, round 2 trains finite without it, so it was its own fault: dropped."""
    run = {**EDGE3, "num-server-rounds": 2, "max-failed-rounds": 2}
    strategy, grid, start = sky_app_on_grid(
        ProcessPerMessageGrid, run, {1: _fault("nan", P.FORWARD, 1)}
    )
    start["grid"] = ChaosGrid(grid, "", lambda m: False)  # errors as error replies
    strategy.start(**start)
    (failed,) = strategy.failed_rounds
    assert failed.set_aside == ["cloud"] and failed.dropped_nodes == ["cloud"]
    assert "stage 1 on cloud" in failed.error and "non-finite" in failed.error
    assert strategy.rounds[-1].train_loss is not None and "cloud" in strategy.dropped


class HidingGrid(ChaosGrid):
    """Node faults as error replies (``ChaosGrid`` without a delivery fault) and one
    node missing from the node list while ``hidden()`` is true (a SuperLink lists only
    online nodes: a restarting SuperNode is missing, then back with its id)."""

    def __init__(self, inner: ProcessPerMessageGrid, node_id: int, hidden) -> None:  # noqa: ANN001
        super().__init__(inner, "", lambda m: False)
        self.node_id, self.hidden = node_id, hidden

    def get_node_ids(self):  # noqa: ANN201
        ids = list(self.inner.get_node_ids())
        return [n for n in ids if not (n == self.node_id and self.hidden())]


def test_a_dropped_node_that_comes_back_is_admitted_with_replan_on(server_identity):
    """box (the last stage) crashes on its round-1 forward: dropped (its own fault).
    It is listed again (the same node id) and answers: before round 3 it is profiled
    and admitted back (``joins``: ``rejoined``), no longer in ``dropped``. It used to
    stay dropped (its id counted as seen)."""
    run = {**EDGE3, "num-server-rounds": 3, "max-failed-rounds": 2, "replan": "on"}
    strategy, grid, start = sky_app_on_grid(
        ProcessPerMessageGrid, run, {2: _fault("raise", P.FORWARD, 1)}
    )
    start["grid"] = ChaosGrid(grid, "", lambda m: False)
    strategy.start(**start)
    box = list(grid.get_node_ids())[2]
    assert strategy.failed_rounds[0].dropped_nodes == ["box"]
    assert strategy.joins == [JoinRecord(3, "box", box, rejoined=True, admitted=True)]
    assert "box" in [n.name for n in strategy.node_profiles] and strategy.dropped == {}


def test_a_dropped_node_that_comes_back_is_reported_with_replan_off(server_identity):
    """The same crash with ``replan.mode=off`` (a fixed plan): box goes missing from
    the node list during round 2 and is back before round 3: reported in ``joins``
    (``admitted: false``), not admitted; the run trains on without it."""
    run = {**EDGE3, "num-server-rounds": 3, "max-failed-rounds": 2}
    strategy, grid, start = sky_app_on_grid(
        ProcessPerMessageGrid, run, {2: _fault("raise", P.FORWARD, 1)}
    )
    box = list(grid.get_node_ids())[2]
    start["grid"] = HidingGrid(grid, box, lambda: len(strategy.rounds) == 1)
    strategy.start(**start)
    assert strategy.failed_rounds[0].dropped_nodes == ["box"]
    assert strategy.joins == [JoinRecord(3, "box", box, rejoined=True, admitted=False)]
    assert "box" not in [n.name for n in strategy.node_profiles]
    assert len(strategy.rounds) == 3 and strategy.rounds[-1].train_loss is not None
