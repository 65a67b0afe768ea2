"""A frozen base with LoRA adapters (issue 41): a tiny random ``transformers`` Llama
wrapped by ``peft`` (LoRA r=4 on ``q_proj`` and ``v_proj``, ``lora_dropout=0.1``),
converted by :func:`sky_flower.pipeline.graph.sequential_of`, trains split exactly as
unsplit on the relay, stream and direct transports: the frozen base weights come back
bit for bit unchanged, the adapters equal unsplit training's bit for bit (the same ops
in the same order per micro-batch, as ``tests/test_user_models.py`` compares).

Frozen parameters (``requires_grad=False``) get no optimizer state, stay out of the
stages' replies (trainable parameters and buffers travel) and out of FedAvg (the global
model keeps its own), and cost the planner their weight bytes only (no gradient, no
optimizer state). Nothing here special-cases adapter names: what trains is read from
``requires_grad``.
"""

from __future__ import annotations

import copy
from functools import cache

import pytest
import torch
from factories import runner_settings
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from reference import ProcessPerMessageGrid, reference_rounds
from torch import nn
from user_models import data_for

from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.memory import measure_stage_memory
from sky_flower.core.partition import InfeasibleMemoryError, feasible_stages
from sky_flower.core.partition.plan import Plan, StagePlan
from sky_flower.core.profile import NodeProfile, profile_layers
from sky_flower.pipeline.graph import original_state_dict
from sky_flower.pipeline.lm import lm_cross_entropy, token_correct
from sky_flower.pipeline.stage import (
    build_stage,
    frozen_keys,
    model_frozen_keys,
    slice_state,
    stage_optimizer,
    trained_state,
)
from sky_flower.sky import protocol as P
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.rounds.federation import fedavg, round_row
from sky_flower.sky.rounds.records import RoundRecord
from sky_flower.sky.rounds.report import weights_sent_line
from sky_flower.sky.transport.relay import RelayRunner
from sky_flower.sky.transport.runner import (
    Pipeline,
    RoundOutcome,
    RunSettings,
    SkyNodeError,
    merge_weights,
)
from sky_flower.sky.transport.stream import StreamRunner

peft = pytest.importorskip("peft")

SEED, ROUND, STEPS, BATCH, MICRO, LR = 3, 1, 2, 8, 2, 1e-2
T = 8  # tokens per sample (the zoo's llama data)
BOUNDS = [(0, 1), (2, 3), (4, 5)]  # embeddings + layer 0 | layers 1-2 | norm + head


@cache
def _lora_converted() -> nn.Sequential:
    from sky_flower.pipeline.graph import sequential_of

    return sequential_of(_lora_module(), [T], "int64")


def _lora_module() -> nn.Module:
    """The user's model: the zoo's tiny Llama, ``hf`` wrapped by peft (seeded)."""
    from sky_flower.bench.zoo import HF_CONFIGS
    from sky_flower.pipeline.hf import hf_module

    config_class, keys = HF_CONFIGS["llama"]
    module = hf_module(config_class, keys, task="causal-lm", seed=0)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)  # lora_A's init
        module.hf = peft.get_peft_model(module.hf, config)
    return module


def lora_model() -> nn.Sequential:
    """A fresh copy of the converted LoRA Llama (traced once per process)."""
    return copy.deepcopy(_lora_converted())


def _data():  # noqa: ANN202 - a Split
    return data_for("llama")


def _unsplit() -> dict[str, torch.Tensor]:
    ((weights, _),) = reference_rounds(
        lora_model,
        _data(),
        1,
        STEPS,
        LR,
        BATCH,
        MICRO,
        SEED,
        weights=lora_model().state_dict(),
        loss_fn=lm_cross_entropy,
    )
    return weights


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """``got`` equals unsplit training bit for bit; the frozen base is the start's and
    every adapter moved (so the comparison is not of two untrained models)."""
    start = lora_model().state_dict()
    frozen = frozen_keys(lora_model())
    assert got.keys() == want.keys() == start.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), (key, float((got[key] - value).abs().max()))
    assert frozen and all(torch.equal(got[k], start[k]) for k in frozen)
    trainable = {n for n, p in lora_model().named_parameters() if p.requires_grad}
    assert trainable and all(not torch.equal(got[k], start[k]) for k in trainable)


# -- conversion ----------------------------------------------------------------------------
def test_requires_grad_survives_conversion_and_dropout_masks_match():
    """The converted units' parameters are frozen exactly where peft froze them (under
    the user's keys), and in training mode (``lora_dropout`` 0.1 active) the units give
    the peft model's output bit for bit under one seed: the same dropout masks."""
    module, seq = _lora_module(), lora_model()
    want = {f"hf.{n}" for n, p in module.hf.named_parameters() if p.requires_grad}
    got = {n: p for n, p in seq.named_parameters() if p.requires_grad}
    assert set(original_state_dict(got)) == want
    assert len(want) == 4 * 3  # lora_A, lora_B of q_proj and v_proj, 3 layers
    assert frozen_keys(seq) == {n for n, p in seq.named_parameters() if not p.requires_grad}
    # peft starts lora_B at 0 (the adapters' path, dropout included, adds nothing):
    # the same random adapters on both, so their dropout masks show in the output
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in got.items():
            p.copy_(torch.randn(p.shape, generator=gen))
            module.get_parameter(name.split(".", 1)[1]).copy_(p)
    x = torch.randint(1, 64, (4, T), generator=torch.Generator().manual_seed(0))
    module.train(), seq.train()
    torch.manual_seed(7)
    a = module(x)
    torch.manual_seed(7)
    b = seq(x)
    torch.manual_seed(8)
    c = seq(x)
    assert torch.equal(a, b)
    assert not torch.equal(b, c)  # the adapters' dropout is live in training mode
    # a stage rebuilt from the meta device keeps what is frozen
    stage = build_stage(lora_model, 1, 2, slice_state(seq.state_dict(), 1, 2))
    assert frozen_keys(stage) == {k for k in frozen_keys(seq) if k.split(".")[0] in "12"}
    assert model_frozen_keys(lora_model) == frozen_keys(seq)


# -- optimizer state -------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_frozen_parameters_get_no_optimizer_state(optimizer):
    """A stage's optimizer holds the trainable parameters only; after a step its state
    has an entry for each of them and none for a frozen one; the profile's optimizer
    bytes are those of the trainable parameters' state."""
    seq = lora_model()
    stage = build_stage(lora_model, 1, 1, slice_state(seq.state_dict(), 1, 1))
    opt = stage_optimizer(stage, optimizer, LR)
    held = [p for g in opt.param_groups for p in g["params"]]
    trainable = [p for p in stage.parameters() if p.requires_grad]
    assert {id(p) for p in held} == {id(p) for p in trainable}
    for p in stage.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.step()
    assert {id(p) for p in opt.state} == {id(p) for p in trainable}
    state_bytes = sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
    )
    (prof,) = [p for p in profile_layers(seq, [T], 2, dtype=torch.int64) if p.index == 1]
    if optimizer == "adam":
        assert prof.optimizer_state_bytes == state_bytes


# -- the relay -----------------------------------------------------------------------------
def _app() -> ClientApp:
    data = _data()
    owner = lambda ctx: data if int(ctx.node_config["partition-id"]) == 0 else None  # noqa: E731
    client = SkyClient(
        model_fn=lora_model, load_data=owner, loss_fn=lm_cross_entropy, metric_fn=token_correct
    )
    return client.register(ClientApp())


def _pipeline(grid) -> Pipeline:  # noqa: ANN001
    nodes = [f"n{k}" for k in range(3)]
    stages = [
        StagePlan(node, k, a, b, 0.0, 0.0, 0.0, 0.0)
        for k, (node, (a, b)) in enumerate(zip(nodes, BOUNDS, strict=True))
    ]
    pred = [{"node": n, "messages": 0, "compute_s": 0.0, "busy_s": 0.0} for n in nodes]
    return Pipeline(
        Plan("even", stages, 0.0, 0.0, 0.0), tuple(grid.ids), 1, tuple(pred), (0.0,) * 3,
        ((0.0, 0.0),) * 3,
    )  # fmt: skip


def _settings(**kw) -> RunSettings:  # noqa: ANN003
    paths = kw.pop("paths", {})
    return RunSettings(
        model_fn=lora_model,
        input_shape=(T,),
        input_dtype="int64",
        num_layers=len(lora_model()),
        settings=runner_settings(
            {
                "schedule.batch_size": BATCH,
                "schedule.microbatches": MICRO,
                "schedule.kind": "gpipe",
                "train.optimizer": "adam",
                "train.lr": LR,
                "seed": SEED,
                **paths,
            }
        ),
        loss_fn=lm_cross_entropy,
        metric_fn=token_correct,
        **kw,
    )


class _RecordingGrid(ProcessPerMessageGrid):
    """Keeps the replies to ``train.sky_collect`` (what the stages send back)."""

    collected: list[Message]

    def deliver(self, node_id: int, message: Message) -> Message:
        reply = super().deliver(node_id, message)
        if message.metadata.message_type == P.COLLECT:
            self.collected.append(reply)
        return reply


def _reply_keys(replies, node_ids) -> list[set[str]]:  # noqa: ANN001
    """The weight keys of each stage's reply, in stage order (stage k on node_ids[k])."""
    by_node = {r.metadata.src_node_id: r for r in replies}
    assert len(by_node) == len(replies) == len(node_ids)
    return [set(by_node[nid].content.array_records[P.ARRAYS].keys()) for nid in node_ids]


def _assert_replies_carry_no_frozen_entry(per_stage: list[set[str]]) -> None:
    """Each stage sent back exactly its trainable parameters and buffers (the last
    stage, norm and head, all frozen: nothing)."""
    seq = lora_model()
    frozen = frozen_keys(seq)
    for k, keys in enumerate(per_stage):
        mine = set(slice_state(seq.state_dict(), *BOUNDS[k]))
        assert keys == mine - frozen, k
    buffers = {n for n, _ in seq.named_buffers()}  # the rotary tables
    assert buffers and buffers <= set().union(*per_stage)
    assert per_stage[-1] == set()


def test_relay_trains_lora_exactly_and_sends_back_only_what_trains(server_identity):
    """Three stages on the relay (GPipe, 2 micro-batches, Adam), 2 steps: the frozen base
    is unchanged, the adapters equal unsplit training's bit for bit; the collect replies
    carry each stage's adapters and buffers only, and the outcome counts their bytes
    against the whole model's."""
    want = _unsplit()
    configs = [{"sky-node": f"n{k}", "partition-id": k} for k in range(3)]
    grid = _RecordingGrid(_app, configs, {})
    grid.collected = []
    start = ArrayRecord(lora_model().state_dict())
    outcome = RelayRunner(_settings()).run_round(grid, _pipeline(grid), start, STEPS, ROUND)
    _assert_exact(outcome.arrays.to_torch_state_dict(), want)
    _assert_replies_carry_no_frozen_entry(_reply_keys(grid.collected, grid.ids))
    sent = trained_state(lora_model().state_dict(), frozen_keys(lora_model()))
    assert outcome.weights_bytes == ArrayRecord(sent).count_bytes()
    assert outcome.full_weights_bytes == start.count_bytes()
    assert outcome.weights_bytes < outcome.full_weights_bytes / 5
    assert list(outcome.arrays.keys()) == list(start.keys())  # the model's key order


def test_stream_trains_lora_exactly_and_sends_back_only_what_trains(server_identity):
    """The same round on ``transport=stream`` (TLS, each node's handler on a thread)."""
    from test_stream import ThreadedGrid

    want = _unsplit()
    names = [f"n{k}" for k in range(3)]
    configs = {n: {"sky-node": n, "partition-id": k} for k, n in enumerate(names)}
    grid = ThreadedGrid({n: _app() for n in names}, configs)
    replies: list[Message] = []
    pull = grid.pull_messages

    def recording_pull(ids):  # noqa: ANN001, ANN202
        got = pull(ids)
        replies.extend(r for r in got if r.metadata.message_type == P.STREAM)
        return got

    grid.pull_messages = recording_pull  # type: ignore[method-assign]
    settings = _settings(
        paths={"failure.message_timeout_s": 60.0, "stream.timeout_s": 60.0},
        describe=grid.names.get,
    )
    start = ArrayRecord(lora_model().state_dict())
    try:
        outcome = StreamRunner(settings).run_round(grid, _pipeline(grid), start, STEPS, ROUND)
    finally:
        grid.join()
    _assert_exact(outcome.arrays.to_torch_state_dict(), want)
    _assert_replies_carry_no_frozen_entry(_reply_keys(replies, grid.ids))
    assert outcome.weights_bytes < outcome.full_weights_bytes / 5


# -- direct --------------------------------------------------------------------------------
def _direct_worker(rdv, shape: tuple, dtype: str, queue) -> None:  # noqa: ANN001
    from sky_flower.pipeline.direct import run_stage
    from sky_flower.pipeline.stage import RngKey, step_batch

    torch.set_num_threads(1)
    a, b = BOUNDS[rdv.rank]
    module = build_stage(lora_model, a, b, slice_state(lora_model().state_dict(), a, b))
    data = _data()
    try:
        run_stage(
            rdv,
            module,
            stage_optimizer(module, "adam", LR),
            "gpipe",
            MICRO,
            STEPS,
            BATCH,
            shape,
            batch_fn=lambda s: step_batch(data, BATCH, ROUND, SEED, s),
            rng=RngKey(SEED, ROUND),
            input_dtype=dtype,
            loss_fn=lm_cross_entropy,
            metric_fn=token_correct,
        )
        # what the direct node replies (sky_flower.sky.node.direct_node)
        sent = trained_state(module.state_dict(), frozen_keys(module))
        queue.put((rdv.rank, {k: v.numpy().copy() for k, v in sent.items()}))
    except Exception as err:  # noqa: BLE001 - reported to the test
        queue.put((rdv.rank, repr(err)))


@pytest.mark.processes
def test_direct_trains_lora_exactly_and_sends_back_only_what_trains():
    """``torch.distributed.pipelining`` (GPipe) peer to peer, one process per stage: the
    stages send back no frozen entry; merged with the start's frozen base they equal
    unsplit training bit for bit."""
    from reference import run_direct_stages

    from sky_flower.pipeline.direct import stage_input_shapes

    shapes = stage_input_shapes(lora_model, (T,), BOUNDS, "int64")
    dtypes = ["int64"] + ["float32"] * (len(BOUNDS) - 1)
    merged = run_direct_stages(_direct_worker, [(shapes[k], dtypes[k]) for k in range(len(BOUNDS))])
    start = lora_model().state_dict()
    frozen = frozen_keys(lora_model())
    assert not frozen & set(merged)
    assert set(merged) | frozen == set(start)
    _assert_exact({k: merged.get(k, v) for k, v in start.items()}, _unsplit())


# -- the server: merging the replies, FedAvg, the round's bytes ----------------------------
class _Ex:
    """What ``merge_weights`` asks of an Exchange."""

    def raise_errors(self, replies) -> None:  # noqa: ANN001
        pass

    def name(self, node_id: int) -> str:
        return f"node{node_id}"

    def fail(self, text: str, nodes=None) -> SkyNodeError:  # noqa: ANN001
        return SkyNodeError(text, nodes=nodes)


def _reply(state: dict[str, torch.Tensor]) -> Message:
    ask = Message(RecordDict({}), dst_node_id=7, message_type=P.COLLECT, group_id="1")
    return Message(RecordDict({P.ARRAYS: ArrayRecord(state)}), reply_to=ask)


def _tiny() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    return model


def test_merge_takes_frozen_entries_from_the_start_and_refuses_a_frozen_reply(
    server_identity,
):
    model = _tiny()
    start = ArrayRecord(model.state_dict())
    frozen = frozen_keys(model)
    assert frozen == {"0.weight"}
    trained = {k: v + 1 for k, v in model.state_dict().items() if k not in frozen}
    halves = [
        {k: v for k, v in trained.items() if k.startswith("0.")},
        {k: v for k, v in trained.items() if not k.startswith("0.")},
    ]
    expected = set(model.state_dict())
    arrays, sent, full = merge_weights(
        [_reply(h) for h in halves], _Ex(), expected, P.ARRAYS, start, frozen
    )
    got = arrays.to_torch_state_dict()
    assert list(got) == list(model.state_dict())
    assert torch.equal(got["0.weight"], model.state_dict()["0.weight"])
    assert all(torch.equal(got[k], v) for k, v in trained.items())
    assert sent == sum(ArrayRecord(h).count_bytes() for h in halves) < full == start.count_bytes()
    with pytest.raises(SkyNodeError, match=r"node7: reply carries 0\.weight, a parameter"):
        merge_weights([_reply(model.state_dict())], _Ex(), expected, P.ARRAYS, start, frozen)
    with pytest.raises(SkyNodeError, match="missing"):  # a trainable entry is missing
        merge_weights([_reply(halves[0])], _Ex(), expected, P.ARRAYS, start, frozen)


def _outcome(state: dict[str, torch.Tensor], seen: int, sent: int = 0, full: int = 0):  # noqa: ANN202
    return RoundOutcome(
        ArrayRecord(state), [1.0], 0, seen, [0.1], [], weights_bytes=sent, full_weights_bytes=full
    )


def test_fedavg_keeps_the_global_models_frozen_entries_bit_for_bit():
    """Two pipelines (3 and 1 samples): trainable entries are their weighted mean (as
    without frozen parameters), frozen entries the global model's, whatever the
    pipelines hold (no float mean of equal values, which need not give them back)."""
    model = _tiny()
    start = model.state_dict()
    frozen = frozen_keys(model)
    a = {k: v + 1 if v.is_floating_point() else v for k, v in start.items()}
    b = {k: v + 3 if v.is_floating_point() else v for k, v in start.items()}
    a["0.weight"] = b["0.weight"] = start["0.weight"] / 3  # differs from the start
    outs = [_outcome(a, 3), _outcome(b, 1)]
    got = fedavg(outs, frozen, ArrayRecord(start)).to_torch_state_dict()
    full = fedavg(outs).to_torch_state_dict()  # as before, nothing frozen
    assert torch.equal(got["0.weight"], start["0.weight"])
    for key in set(start) - frozen:
        assert torch.equal(got[key], full[key]), key
    assert torch.allclose(got["0.bias"], start["0.bias"] + 1.5)
    with pytest.raises(ValueError, match="give start"):
        fedavg(outs, frozen)


def test_the_round_reports_bytes_sent_against_full_fine_tuning():
    from types import SimpleNamespace

    from sky_flower.sky.rounds.federation import PipelineResult

    def result(sent: int, full: int) -> PipelineResult:
        plan = Plan("even", [StagePlan("n0", 0, 0, 0, 0.0, 0.0, 0.0, 0.0)], 0.0, 0.0, 0.0)
        pipeline = Pipeline(plan, (1,), 1, ({},), (0.0,), ((0.0, 0.0),))
        run = SimpleNamespace(
            owner="n0", pipeline=pipeline, samples=4, steps=1, time_s=0.0, start_s=0.0, after=()
        )
        return PipelineResult(run=run, outcome=_outcome({}, 4, sent, full))  # type: ignore[arg-type]

    row = round_row(1, [result(12_595, 1_258_291), result(12_595, 1_258_291)], 1.0)
    assert (row.weights_sent_bytes, row.full_weights_bytes) == (25_190, 2_516_582)
    assert row.to_dict()["weights_sent_bytes"] == 25_190
    assert weights_sent_line(row) == (
        "weights sent 24.6 KiB per round (full fine-tuning: 2.4 MiB, 1.0 %)"
    )
    assert weights_sent_line(RoundRecord(1, 1.0)) is None
    # nothing frozen: the run is full fine-tuning, no comparison (it read "(full
    # fine-tuning: 2.4 MiB, 100.0 %)" on a run that fine-tunes nothing)
    row = round_row(1, [result(1_258_291, 1_258_291), result(1_258_291, 1_258_291)], 1.0)
    assert weights_sent_line(row) == "weights sent 2.4 MiB per round"


# -- the planner's memory --------------------------------------------------------------------
def _half_frozen(freeze: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    for layer in model[:2] if freeze else ():
        layer.requires_grad_(False)
    return model


def _cost(model: nn.Module, memory: list[int]) -> CostModel:
    layers = profile_layers(model, (64,), microbatch_size=2)
    nodes = [
        NodeProfile(f"n{i}", (0.01,) * 4, (0.02,) * 4, memory_bytes=m, holds_data=i == 0)
        for i, m in enumerate(memory)
    ]
    return CostModel(layers, nodes, Schedule(batch_size=2, microbatches=1))


def test_a_frozen_parameter_costs_its_weight_bytes_only():
    """Per layer, the profile counts a frozen layer's weights (``frozen_bytes``) and no
    gradient or optimizer state; the cost model's static memory of the whole model is
    what a training step really holds in weights, gradients and optimizer state
    (:func:`measure_stage_memory`), frozen or not, and less for the half-frozen model."""
    weights = 64 * 65 * 4
    frozen, full = _half_frozen(True), _half_frozen(False)
    prof = profile_layers(frozen, (64,), microbatch_size=2)
    assert [(p.param_bytes, p.frozen_bytes) for p in prof] == [(0, weights)] * 2 + [
        (weights, 0)
    ] * 2
    assert [p.optimizer_state_bytes for p in prof[:2]] == [0, 0]
    for model in (frozen, full):
        cost = _cost(model, [2**40])
        peaks = measure_stage_memory(list(model), torch.randn(2, 64), 1).category_peaks
        held = peaks["parameters"] + peaks["gradients"] + peaks["optimizer_state"]
        assert float(cost.static_prefix[-1]) == held
    assert _cost(frozen, [2**40]).stage_memory(0, 3) < _cost(full, [2**40]).stage_memory(0, 3)


def test_a_node_too_small_for_full_fine_tuning_holds_a_frozen_slice():
    """Two nodes sized for the half-frozen model's stages (the frozen half on the data
    owner, the trainable half after it) plan; the same fleet cannot fine-tune the whole
    model; and one byte less on the owner than its frozen slice needs, weights
    included, is refused (frozen weights are held, not free)."""
    cost = _cost(_half_frozen(True), [1, 1])
    caps = [int(cost.stage_memory(0, 1)), int(cost.stage_memory(2, 3))]
    # the frozen weights and nothing else: a backward through frozen layers keeps only
    # the weights it multiplies by (no gradient, no optimizer state, no stash)
    assert cost.stage_memory(0, 1) == 2 * 64 * 65 * 4
    stages = feasible_stages(_cost(_half_frozen(True), caps))
    assert [(i, a, b) for i, a, b in stages] == [(0, 0, 1), (1, 2, 3)]
    with pytest.raises(InfeasibleMemoryError):
        feasible_stages(_cost(_half_frozen(False), caps))
    with pytest.raises(InfeasibleMemoryError):
        feasible_stages(_cost(_half_frozen(True), [caps[0] - 1, caps[1]]))


def test_the_strategy_reads_what_is_frozen_from_the_model():
    """Sky's strategy (its round executor, whose FedAvg keeps the frozen entries) and
    its runners read the frozen parameters from ``model_fn()``; a model that trains
    every parameter has none (full fine-tuning, as before)."""
    from reference import sky_app_run_config

    from sky_flower.app import sky_strategy

    strategy = sky_strategy(
        {**sky_app_run_config(), "fleet": "edge3"}, model_fn=_tiny, input_shape=[4]
    )
    assert strategy.executor.frozen == {"0.weight"}
    assert RelayRunner(strategy.run_settings()).frozen == {"0.weight"}
    full = sky_strategy(
        {**sky_app_run_config(), "fleet": "edge3"},
        model_fn=lambda: nn.Sequential(nn.Linear(4, 2)),
        input_shape=[4],
    )
    assert full.executor.frozen == frozenset()
