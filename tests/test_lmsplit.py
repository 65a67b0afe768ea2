"""A Llama-style transformer (root rotary buffers every block reads, a dynamic batch
size its reshapes read) brought as a plain ``nn.Module`` through
:func:`sky_flower.pipeline.graph.sequential_of`: cut between every block, trained split
(relay on an in-process Grid, and the local ``torch.distributed.pipelining`` engine)
exactly as unsplit, its weights mapped back to exactly the user's ``state_dict`` keys;
and a raw ``nn.Module`` as ``model._target_`` refused naming ``sequential_of``.

Exactness: every stage runs the same aten ops on the same tensors as the whole converted
model, per micro-batch and in the same order (the relay's stage recomputes its forward
from the stashed input; the direct engine's schedule runs each micro-batch once), and
the 1 / M scaling of M = 2 micro-batches is a power of two (exact in floating point
whether applied to each micro-batch's loss or to the accumulated gradient). So the
trained weights are compared with ``torch.equal``.
"""

from __future__ import annotations

import copy
import warnings
from functools import cache
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from flwr.common.config import parse_config_args
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from reference import ProcessPerMessageGrid, reference_rounds, sky_app_run_config
from torch import nn

from sky_flower.app import load_fleet, register_sky_client, sky_strategy
from sky_flower.core.profile import as_layers
from sky_flower.deploy import node_config
from sky_flower.jobs.common import conf_dir
from sky_flower.pipeline.data import Split, owner_partition
from sky_flower.pipeline.graph import as_sequential, original_state_dict, sequential_of
from sky_flower.pipeline.llama import LlamaLM
from sky_flower.pipeline.lm import lm_cross_entropy, token_correct
from sky_flower.pipeline.local import run_local
from sky_flower.pipeline.models import build_model
from sky_flower.pipeline.text import load_python_source

CONF = Path(conf_dir())  # registers the settings' defaults (sky_base) to compose
T = 8
SMALL = {"vocab_size": 256, "seq_len": T, "d_model": 16, "n_heads": 2, "n_layers": 3}
UNITS = [["embed"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["norm"], ["head"]]
MODEL_CFG = {
    "_target_": "sky_flower.pipeline.graph.sequential_of",
    "module": {"_target_": "sky_flower.pipeline.llama.LlamaLM", **SMALL},
    "input_shape": [T],
    "input_dtype": "int64",
}


def user_lm() -> LlamaLM:
    """The user's own module, seeded (the same weights every call)."""
    torch.manual_seed(0)
    return LlamaLM(**SMALL)


@cache
def _converted() -> nn.Sequential:
    """The user's module converted once (each conversion traces it, about a second; the
    relay builds a model for every message)."""
    return sequential_of(user_lm(), [T], "int64")


def converted() -> nn.Sequential:
    """A fresh copy of the converted model (what a ``model_fn`` seeding and converting
    the user's module each time gives)."""
    return copy.deepcopy(_converted())


def _top(name: str) -> str:
    """``blocks.1.qkv.weight`` -> ``blocks.1``; ``embed.weight`` -> ``embed``."""
    atoms = name.split(".")
    return ".".join(atoms[:2]) if atoms[0] == "blocks" else atoms[0]


def test_units_are_cut_between_every_block():
    """[embed], one unit per block, [norm], [head]: the rotary tables (non-persistent
    buffers of the root, sliced by the root) are copied into each block's unit instead of
    crossing every cut; the composition is the user's function, outputs and gradients."""
    model, seq = user_lm(), _converted()
    assert [sorted({_top(k) for k, _ in u.named_parameters()}) for u in seq] == UNITS
    for j in range(1, 4):
        assert {k for k, _ in seq[j].named_buffers()} == {"cos", "sin"}
    ids = torch.randint(0, 256, (5, T))  # a batch size the trace never saw
    y, y_seq = model(ids), seq(ids)
    torch.testing.assert_close(y_seq, y, rtol=0, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    y_seq.backward(g)
    grads = original_state_dict({k: p.grad for k, p in seq.named_parameters()})
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=0, atol=1e-6, msg=k)


class MaskBlock(nn.Module):
    """Attention over a mask and a scale the root hands in, besides the activation."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x, mask, scale):
        att = (x @ x.transpose(1, 2)).masked_fill(~mask, float("-inf")).softmax(-1)
        return x + self.proj(att @ x) * scale


class RootStateLM(nn.Module):
    """What else a root feeds every block: a causal mask it builds, a constant it makes
    in the forward (``torch.tensor``: a lifted constant), a persistent buffer."""

    def __init__(self, d: int = 8, n_layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(20, d)
        self.blocks = nn.ModuleList(MaskBlock(d) for _ in range(n_layers))
        self.head = nn.Linear(d, 20)
        self.register_buffer("pos", torch.randn(T, d))

    def forward(self, ids):
        T_ = ids.shape[1]
        mask = torch.ones(T_, T_, dtype=torch.bool, device=ids.device).tril()
        scale = torch.tensor(0.5)
        x = self.embed(ids) + self.pos[:T_]
        for block in self.blocks:
            x = block(x, mask, scale)
        return self.head(x)


def test_masks_constants_and_persistent_buffers_cross_no_cut():
    torch.manual_seed(0)
    model, ids = RootStateLM(), torch.randint(0, 20, (4, T))
    seq = as_sequential(model, ids)
    held = [sorted({_top(k) for k, _ in u.named_parameters()}) for u in seq]
    assert held == [["embed"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["head"]]
    assert torch.equal(seq(ids), model(ids))
    back = original_state_dict(seq.state_dict(), like=model)
    assert list(back) == list(model.state_dict())  # "pos" kept: it is persistent
    model.load_state_dict(back, strict=True)


def test_chosen_split_points_between_blocks_are_kept():
    seq = as_sequential(user_lm(), torch.zeros(2, T, dtype=torch.long), ["blocks.1", "norm"])
    held = [sorted({_top(k) for k, _ in u.named_parameters()}) for u in seq]
    assert held == [["blocks.0", "embed"], ["blocks.1", "blocks.2"], ["head", "norm"]]


def test_weights_map_back_to_exactly_the_users_keys():
    """Replicas fold into one key, the non-persistent tables are no key: strict load."""
    seq = converted()
    with torch.no_grad():  # "train" the converted model
        for p in seq.parameters():
            p.add_(torch.randn_like(p))
    user = user_lm()
    back = original_state_dict(seq.state_dict(), like=user)
    assert list(back) == list(user.state_dict())
    assert "cos" not in back
    user.load_state_dict(back, strict=True)
    ids = torch.randint(0, 256, (3, T))
    torch.testing.assert_close(user(ids), seq(ids), rtol=0, atol=0)
    state = seq.state_dict()
    state["2.cos"] = state["2.cos"] + 1  # copies that drifted apart are refused by name
    with pytest.raises(ValueError, match="'cos' is held by units 1 and 2"):
        original_state_dict(state, like=user)


def test_a_tie_across_blocks_is_named_when_it_merges_them():
    # one block (tracing is per op; three blocks trace about twice as long): the tie
    # still spans embed ... head, across blocks.0, norm
    model = LlamaLM(**{**SMALL, "n_layers": 1}, tie_head=True)
    with pytest.warns(UserWarning, match=r"embed.weight and head.weight .*no cut before blocks.0"):
        seq = as_sequential(model, torch.zeros(2, T, dtype=torch.long))
    assert len(seq) == 1 and seq[0].embed.weight is seq[0].head.weight


def test_a_raw_module_as_target_is_refused_naming_sequential_of():
    cfg = {"_target_": "sky_flower.pipeline.llama.LlamaLM", **SMALL}
    with pytest.raises(ValueError, match=r"LlamaLM.*not an nn.Sequential.*sequential_of") as err:
        build_model(cfg)
    assert "module: {_target_: sky_flower.pipeline.llama.LlamaLM" in str(err.value)
    with pytest.raises(TypeError, match="sequential_of"):
        as_layers(user_lm())


def test_sequential_of_as_target_takes_the_input_keys():
    """``input_shape`` / ``input_dtype`` reach sequential_of (they describe the input for
    every other builder): the shipped config builds through them and cuts between
    blocks (one trace: each costs about a second)."""
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["model=llama_lm"])
    assert cfg.dataset.seq_len == cfg.model.module.seq_len == 64
    assert cfg.objective.loss.endswith("lm_cross_entropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no tie: nothing merged
        full = build_model(OmegaConf.to_container(cfg.model, resolve=True))
    assert len(full) == cfg.model.module.n_layers + 3


@pytest.mark.slow
def test_planner_cuts_between_blocks_where_memory_forces_it(tmp_path):
    """fleet=lm_mem4 (4 x 64 MiB) cannot hold llama_lm (about 208 MiB at batch 64) on
    one node: every stage boundary the plan places falls between two units, one block
    per node."""
    from sky_flower.plan import plan_job

    overrides = [
        "model=llama_lm",
        "fleet=lm_mem4",
        "schedule.batch_size=64",
        "benchmark.repeats=1",
        "benchmark.warmup=0",
    ]
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("plan", overrides=overrides)
    plan = plan_job(cfg, tmp_path)["plan"]
    bounds = [(s["first_layer"], s["last_layer"]) for s in plan["stages"]]
    assert len(bounds) == 4
    blocks = [sum(1 <= j <= 4 for j in range(a, b + 1)) for a, b in bounds]
    assert blocks == [1, 1, 1, 1]


@cache
def corpus() -> tuple[Split, Split]:
    return load_python_source(0.1, seed=0, seq_len=T, max_chars=60_000)


def lm_data(partition_id: int, num_partitions: int) -> Split:
    return owner_partition(corpus()[0], partition_id, num_partitions)


def lm_client() -> ClientApp:
    return register_sky_client(
        ClientApp(),
        model_fn=converted,
        load_data=lm_data,
        loss_fn=lm_cross_entropy,
        metric_fn=token_correct,
    )


RUN = {
    "fleet": "edge3",
    "allocation": "even",
    "transport": "relay",
    "schedule-kind": "gpipe",
    "microbatches": 2,
    "steps-per-round": 2,
    "batch-size": 8,
    "lr": 3e-3,
    "benchmark-repeats": 1,
    "benchmark-warmup": 0,
    "echo-repeats": 1,
    "state-probe-mb": 0.0,
    "num-server-rounds": 2,
}


# e2e: make test; the llama's cuts and their composition (outputs, gradients) are checked
# in the fast tier above, the relay's exactness on a converted model in test_lm_sky
@pytest.mark.e2e
def test_relay_trains_the_split_llama_exactly_as_unsplit(server_identity):
    """Three stages on the relay, cuts between blocks, 2 rounds of 2 steps of 2
    micro-batches (Adam): the weights equal the whole converted model's and the user's
    own module's unsplit training, bit for bit; they load strictly into the user's
    module."""
    run_config = {**sky_app_run_config(), **RUN}
    fleet = load_fleet("edge3")
    configs = [parse_config_args([node_config(n, i, len(fleet))]) for i, n in enumerate(fleet)]
    grid = ProcessPerMessageGrid(lm_client, configs, run_config)
    run_config |= {
        "loss": "sky_flower.pipeline.lm:lm_cross_entropy",
        "metric": "sky_flower.pipeline.lm:token_correct",
    }
    strategy = sky_strategy(run_config, model_fn=converted, input_shape=[T], input_dtype="int64")
    initial = converted().state_dict()
    strategy.start(grid=grid, initial_arrays=ArrayRecord(initial), num_rounds=2)
    bounds = [(s.first_layer, s.last_layer) for s in strategy.plan.stages]
    assert bounds == [(0, 1), (2, 3), (4, 5)]  # a cut between blocks.0 and blocks.1
    trained = strategy.global_arrays.to_torch_state_dict()
    args = (lm_data(0, len(fleet)), 2, 2, 3e-3)
    kw = {"batch_size": 8, "microbatches": 2, "loss_fn": lm_cross_entropy}
    expected = reference_rounds(converted, *args, weights=initial, **kw)[-1][0]
    assert trained.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(trained[key], value), key
    user = user_lm()
    user.load_state_dict(original_state_dict(trained, like=user), strict=True)
    start = original_state_dict(initial, like=user)
    own = reference_rounds(user_lm, *args, weights=start, **kw)[-1][0]
    for key, value in own.items():
        assert torch.equal(user.state_dict()[key], value), key


@pytest.mark.slow  # a process per stage; the relay test above splits the same llama in make test
def test_local_engine_trains_the_split_llama_exactly_as_unsplit():
    """``torch.distributed.pipelining`` (GPipe, one spawned process per stage) on three
    stages cut between blocks, 2 steps of 2 micro-batches: the weights equal unsplit
    training of the same model config, bit for bit."""
    torch.manual_seed(1)
    weights = build_model(MODEL_CFG).state_dict()
    data = lm_data(0, 1)
    batches = [
        (torch.from_numpy(data.x[i : i + 8]), torch.from_numpy(data.y[i : i + 8])) for i in (0, 8)
    ]
    trained, _ = run_local(
        MODEL_CFG,
        [(0, 1), (2, 3), (4, 5)],
        weights,
        batches,
        kind="gpipe",
        microbatches=2,
        optimizer="adam",
        lr=3e-3,
        timeout_s=120.0,
        loss_fn=lm_cross_entropy,
        metric_fn=token_correct,
    )
    expected = reference_rounds(
        lambda: build_model(MODEL_CFG),
        batches,
        1,
        2,
        3e-3,
        microbatches=2,
        weights=weights,
        loss_fn=lm_cross_entropy,
    )[-1][0]
    assert trained.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(trained[key], value), key
