"""Finite or rejected on the Sky protocol (issue 17): a non-finite reply fails its round
by name where it arrives, the global model stays the last finite one, ``model.pt`` is
only ever finite and ``results.json`` is strictly valid JSON. In process (no Ray): the
example app's nodes on ``ProcessPerMessageGrid``."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, RecordDict
from reference import ProcessPerMessageGrid, sky_app_on_grid, sky_app_task
from sky_flower.strategies.sky import SkyNodeError

from sky_flower.jobs.common import SkyRecorder, save_model, write_json
from sky_flower.pipeline.stage import slice_state
from sky_flower.sky import protocol as P
from sky_flower.sky.rounds.recovery import TrainingDiverged
from sky_flower.sky.transport.direct import DirectRunner
from sky_flower.sky.transport.guard import RoundGuard
from sky_flower.sky.transport.runner import message

QUICK = {"benchmark-repeats": 1, "echo-repeats": 1, "state-probe-mb": 0.0, "allocation": "even"}
# plain SGD at lr 1e8 on uniform3 (three native nodes, one stage each): with 2 steps a
# round, round 1 ends finite (training loss ~4e25) and round 2's first forward overflows
HUGE_LR = {"fleet": "uniform3", "optimizer": "sgd", "lr": 1e8, "steps-per-round": 2}


def _strict(text: str) -> dict:
    """``json.loads`` refusing ``NaN`` / ``Infinity`` (Python accepts them by default)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _finite(state: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values())


def _start(run: dict, tmp_path) -> tuple:  # noqa: ANN001
    strategy, grid, start = sky_app_on_grid(ProcessPerMessageGrid, {**QUICK, **run})
    SkyRecorder(tmp_path / "results.json", "even", run["fleet"]).attach(strategy)
    return strategy, start


def test_huge_lr_fails_the_round_by_name_and_keeps_the_last_finite_model(tmp_path, server_identity):
    """Round 1 trains finite; in round 2 stage 0's activations overflow: the round fails
    saying the training diverged (the data owner's own stage, issue 30: no node is
    blamed), naming the stage, its node, the array and the learning rate; the global
    model stays round 1's, results.json parses strictly and model.pt is round 1's
    finite model."""
    run = {**HUGE_LR, "num-server-rounds": 2, "max-failed-rounds": 1}
    strategy, start = _start(run, tmp_path)
    initial = start["initial_arrays"].to_torch_state_dict()
    with pytest.raises(
        TrainingDiverged,
        match=r"diverged in round 2: the data owner node0's own stage 0 .*stage 0 on node0 "
        r".* non-finite .* in act\).*train\.lr.*now 1e\+08\), e\.g\. to 1e\+07",
    ) as err:
        strategy.start(**start)
    assert err.value.nodes == [] and err.value.node_ids == []  # nobody is to blame
    assert strategy.failed_rounds[-1].diverged is True
    first, second = strategy.rounds
    assert math.isfinite(first.train_loss) and first.train_loss > 1e10
    assert "train.sky_forward holds non-finite values" in second.error
    kept = strategy.global_arrays.to_torch_state_dict()
    assert _finite(kept) and any(not torch.equal(kept[k], initial[k]) for k in kept)
    results = _strict((tmp_path / "results.json").read_text())
    assert results["completed"] is False and "non-finite" in results["error"]
    assert results["rounds"][0]["train_loss"] == first.train_loss
    assert save_model(tmp_path / "model.pt", kept)
    saved = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(saved[k], kept[k]) for k in kept)


def test_divergence_guard_fails_a_round_whose_loss_grows_past_the_factor(tmp_path, server_identity):
    """lr 1e4, one step a round: round 1's loss is 2.3, round 2's about 7e9 (finite, so
    only the optional guard catches it; off by default): with divergence-factor 10 the
    second round fails, no node is blamed or dropped, and the model stays round 1's."""
    run = {**HUGE_LR, "lr": 1e4, "steps-per-round": 1, "num-server-rounds": 2}
    run |= {"max-failed-rounds": 2, "divergence-factor": 10.0}
    strategy, start = _start(run, tmp_path)
    result = strategy.start(**start)  # one failed round: the run goes on
    first, second = strategy.rounds
    assert "round 2 diverged: training loss" in second.error and "exceeds" in second.error
    assert "train.lr, run config 'lr'; now 10000" in second.error  # issue 30: lr named
    assert [f.to_dict() for f in strategy.failed_rounds] == [
        {
            "round": 2,
            "error": second.error.removeprefix("round 2 failed: "),
            "dropped_nodes": [],
            "diverged": True,
        }
    ]
    assert strategy.executor.guard.best_loss == first.train_loss < 3.0
    assert result.arrays is strategy.global_arrays  # round 1's model
    assert _strict((tmp_path / "results.json").read_text())["completed"] is True
    assert RoundGuard().divergence_factor == 0  # off by default
    with pytest.raises(ValueError, match="0 \\(off\\) or >= 1"):
        RoundGuard(0.5)


def test_nonfinite_aggregate_or_loss_fails_the_round():
    """The round-level check: a non-finite aggregate (naming its arrays) or training
    loss fails the round and leaves the best loss as it was."""
    guard = RoundGuard()
    ok = ArrayRecord({"w": torch.ones(2)})
    assert guard.check(1, 2.0, ok) == "" and guard.best_loss == 2.0
    bad = ArrayRecord({"w": torch.ones(2), "b": torch.tensor([float("inf")])})
    assert "FedAvg aggregate holds non-finite values (NaN or inf) in b" in guard.check(2, 1.0, bad)
    assert "training loss is nan" in guard.check(3, float("nan"), ok)
    assert guard.best_loss == 2.0


def _direct_replies(strategy, weights: dict, nan_stages: set[int]) -> list[Message]:  # noqa: ANN001
    """Each stage's reply to a ``train.sky_direct`` message as a node sends it (its
    weights and DirectMetrics for one step), NaN in the weights of ``nan_stages``."""
    replies = []
    for k, st in enumerate(strategy.pipeline.plan.stages):
        mine = slice_state(weights, st.first_layer, st.last_layer)
        if k in nan_stages:
            mine = {n: torch.full_like(v, float("nan")) for n, v in mine.items()}
        metrics = P.DirectMetrics((2.0,), 3, 64, (0.1,), 0.0, 0.1).to_record()
        ask = message(strategy.pipeline.node_ids[k], P.DIRECT, {}, "1")
        content = RecordDict({P.ARRAYS: ArrayRecord(mine), P.METRICS: metrics})
        replies.append(Message(content, reply_to=ask))
    return replies


def test_direct_round_blames_the_one_nonfinite_stage_or_names_all(tmp_path, server_identity):
    """A direct round's replies (weights and metrics, activations never reach the
    server): one non-finite stage is named and blamed; several are all named and none is
    blamed (the server cannot tell where divergence began)."""
    run = {**QUICK, "fleet": "uniform3", "transport": "direct", "schedule-kind": "gpipe"}
    strategy, grid, _ = sky_app_on_grid(ProcessPerMessageGrid, run | {"microbatches": 2})
    strategy.benchmark(grid, list(grid.get_node_ids()))
    strategy.make_plan()
    runner = strategy.runner()
    assert isinstance(runner, DirectRunner) and strategy.pipeline.num_stages == 3
    weights = sky_app_task().initial_weights()
    ex = runner.s.exchange(grid)

    def parse(nan: set[int]):  # noqa: ANN202
        replies = _direct_replies(strategy, weights, nan)
        return runner.parse(ex, strategy.pipeline, replies, ArrayRecord(weights), 1, 0.1)

    assert _finite(parse(set()).arrays.to_torch_state_dict())
    with pytest.raises(
        SkyNodeError, match=r"stage 1 on node1 .* in 2\.0\.weight, 2\.0\.bias$"
    ) as e:
        parse({1})
    assert e.value.nodes == ["node1"]
    with pytest.raises(SkyNodeError, match=r"stage 1 on .*; .*stage 2 on .*no single node") as e:
        parse({1, 2})
    assert e.value.nodes == []


def test_results_and_models_are_written_finite(tmp_path):
    """write_json writes NaN / inf as null, lists where (``nonfinite``) and is strict
    JSON; save_model refuses a non-finite model and keeps the last finite one."""
    payload = {"rounds": [{"train_loss": float("nan"), "test_loss": 1.5}], "x": float("inf")}
    back = write_json(tmp_path / "r.json", payload)
    assert _strict((tmp_path / "r.json").read_text()) == back
    assert back["rounds"][0]["train_loss"] is None and back["nonfinite"] == [
        "rounds[0].train_loss",
        "x",
    ]
    assert "nonfinite" not in write_json(tmp_path / "ok.json", {"a": 1.0})
    good = {"w": torch.ones(2)}
    assert save_model(tmp_path / "model.pt", good)
    assert not save_model(tmp_path / "model.pt", {"w": torch.tensor([float("nan")])})
    assert torch.equal(torch.load(tmp_path / "model.pt")["w"], good["w"])


class _BadProfile(ProcessPerMessageGrid):
    """Node ``target``'s benchmark reply carries ``bad`` (profile keys -> values)."""

    target, bad = 0, {}

    def deliver(self, node_id: int, message: Message) -> Message:
        reply = super().deliver(node_id, message)
        if node_id == self.target and message.metadata.message_type == P.PROFILE:
            rec = reply.content.config_records[P.PROFILE_KEY]
            for key, value in self.bad.items():
                rec[key] = [value] * len(rec[key]) if isinstance(rec[key], list) else value
        return reply


@pytest.mark.e2e  # two benchmark rounds of edge3 and one training round: ~2 s
def test_a_nodes_unusable_benchmark_figures_leave_it_out_not_crash_the_server(
    caplog, server_identity
):
    """A helper whose profile reply holds NaN layer times (or negative memory) is left out
    of the plan by name and the others train; a data owner's such reply leaves no owner:
    the run stops naming it and the figure, not with the planner's bare ValueError."""
    import logging

    run = {**QUICK, "fleet": "edge3", "num-server-rounds": 1, "steps-per-round": 1}
    helper = type("Bad", (_BadProfile,), {"target": 102, "bad": {"layer_fwd_s": math.nan}})
    strategy, grid, start = sky_app_on_grid(helper, run)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.start(**start)
    left = "leaving cloud (node 102) out of the plan: its benchmark reply is unusable"
    assert left in caplog.text
    assert "layer_fwd_s[0] must be a finite number >= 0, got nan" in caplog.text
    assert [r.error for r in strategy.rounds] == [None]
    assert "cloud" not in {s.node for r in strategy.rounds for s in r.stages}
    owner = type("Bad", (_BadProfile,), {"target": 101, "bad": {"memory_bytes": -5}})
    strategy, grid, start = sky_app_on_grid(owner, run)
    with pytest.raises(SkyNodeError, match=r"no data owner answered.*phone.*memory_bytes must be"):
        strategy.start(**start)


class _BadReply(ProcessPerMessageGrid):
    """The first reply of node ``target`` to ``mtype`` changed by ``change(content)``."""

    target, mtype, done = 0, "", False

    @staticmethod
    def change(content: RecordDict) -> None: ...

    def deliver(self, node_id: int, message: Message) -> Message:
        reply = super().deliver(node_id, message)
        hit = (node_id, message.metadata.message_type) == (self.target, self.mtype)
        if hit and not self.done and not reply.has_error():
            self.done = True
            self.change(reply.content)
        return reply


def _collect_as(dtype: str | None = None, grow: int = 0):  # noqa: ANN202
    def change(content: RecordDict) -> None:
        rec = content.array_records[P.ARRAYS]
        for name in list(rec):
            a = rec[name].numpy()
            a = a.astype(dtype) if dtype else a
            rec[name] = Array(np.resize(a, a.size + grow) if grow else a)

    return change


def _last_stage_counts(content: RecordDict) -> None:
    content.metric_records[P.METRICS]["n"] = -64  # its step's other group makes it sum 0


@pytest.mark.e2e  # three in-process runs of uniform3, two rounds each: ~5 s
@pytest.mark.parametrize(
    ("target", "mtype", "change", "said"),
    [
        (102, P.COLLECT, _collect_as(grow=3), r"returned 2\.0\.weight as float32 \(65539,\), "),
        (102, P.COLLECT, _collect_as("float64"), r"returned 2\.0\.weight as float64 \(256, 256\)"),
        (103, P.FORWARD, _last_stage_counts, r"n=-64 labels and correct=\d+ are no count"),
    ],
    ids=["weights-shape", "weights-dtype", "negative-count"],
)
def test_a_malformed_weight_or_count_fails_its_round_by_node_not_the_model_or_server(
    target, mtype, change, said, server_identity
):
    """A stage's weights of another shape or dtype than the model's used to enter the
    global model (the next round failed on a node that had done nothing, or model.pt
    held float64); a last stage's negative sample count crashed the ServerApp with
    numpy's ZeroDivisionError. Each now fails its round naming the sender, which is
    dropped, and the next round trains on the last good model."""
    grid_cls = type(
        "Bad", (_BadReply,), {"target": target, "mtype": mtype, "change": staticmethod(change)}
    )
    run = {**QUICK, "fleet": "uniform3", "num-server-rounds": 2, "steps-per-round": 2}
    strategy, grid, start = sky_app_on_grid(grid_cls, run)
    result = strategy.start(**start)
    first, second = strategy.rounds
    assert first.error is not None and first.error.startswith("round 1 failed: node")
    assert f"(node {target})" in first.error and re.search(said, first.error)
    assert second.error is None and math.isfinite(second.train_loss)
    model = result.arrays.to_torch_state_dict()
    assert all(v.dtype in (torch.float32, torch.int64) for v in model.values())
