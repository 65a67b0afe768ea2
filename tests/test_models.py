"""A user's own model, data, loss and metric: ``_target_`` configs, the shipped models
trained end to end through Flower messages, and layer patterns refused by name before
Flower starts (or handled)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp
from omegaconf import OmegaConf, open_dict
from reference import ProcessPerMessageGrid
from simhelpers import make_cfg
from torch import nn

from sky_flower.core.profile import check_layers, profile_layers
from sky_flower.pipeline.data import Split, load_dataset, load_split
from sky_flower.pipeline.models import FirstOutput, build_mlp, build_model
from sky_flower.pipeline.objective import check_objective, mse, rounded_correct
from sky_flower.sky.settings import SkySettings

# ---- a user's own model, data and objective (importable: this module) -----------------


def user_net(width: int = 32, num_classes: int = 10) -> nn.Sequential:
    """The torchvision pattern flattened: Linear, BatchNorm, ReLU(inplace=True) entries."""
    return nn.Sequential(
        nn.Linear(64, width),
        nn.BatchNorm1d(width),
        nn.ReLU(inplace=True),
        nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(inplace=True)),
        nn.Linear(width, num_classes),
    )


def lstm_net() -> nn.Sequential:
    """An LSTM as an entry of its own: it returns a tuple."""
    return nn.Sequential(
        nn.Unflatten(1, (8, 8)),
        nn.LSTM(8, 16, batch_first=True),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def half_digits(test_fraction: float, seed: int, keep: float = 0.5) -> tuple[Split, Split]:
    """A user's loader: the first ``keep`` of digits' train split."""
    train, test = load_split("digits", test_fraction, seed)
    n = int(len(train) * keep)
    return Split(train.x[:n], train.y[:n]), test


def not_a_loader(test_fraction: float, seed: int) -> list[int]:
    return [1, 2, 3]


class SkipSequential(nn.Sequential):
    """An nn.Sequential subclass whose forward adds a skip across its entries."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x


class TwoOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, 2 * x


USER_MODEL = {"_target_": "test_models.user_net", "width": 32, "input_shape": [64]}


def _cfg(overrides: list[str], model: dict | None = None, dataset: dict | None = None):
    cfg = make_cfg(overrides)
    with open_dict(cfg):
        if model is not None:
            cfg.model = OmegaConf.create(model)
        if dataset is not None:
            cfg.dataset = OmegaConf.create(dataset)
    return cfg


def _checked(cfg):
    from sky_flower.jobs.sky import _checked_inputs

    return _checked_inputs(cfg, SkySettings.from_hydra(cfg))


# ---- configs by _target_ ----------------------------------------------------------------


def test_shipped_configs_build_and_mlp_is_unchanged():
    cfg = make_cfg([])
    assert cfg.model._target_ == "sky_flower.pipeline.models.build_mlp"
    model = build_model(OmegaConf.to_container(cfg.model))
    torch.manual_seed(0)
    a = build_model(OmegaConf.to_container(cfg.model)).state_dict()
    torch.manual_seed(0)
    b = build_mlp(64, 1024, 8, 10).state_dict()
    assert len(model) == 9 and all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(0)
    old = build_model({"name": "mlp", "hidden_width": 1024, "hidden_layers": 8})  # old spelling
    assert all(torch.equal(old.state_dict()[k], b[k]) for k in b)
    for name, entries in (("cnn_bn", 5), ("resnet", 5)):
        m = build_model(OmegaConf.to_container(make_cfg([f"model={name}"]).model))
        assert isinstance(m, nn.Sequential) and len(m) == entries
        assert any(isinstance(x, nn.BatchNorm2d) for x in m.modules())
        assert m(torch.randn(4, 64)).shape == (4, 10)
    lm = make_cfg(["model=transformer_lm"])  # the names slice `lm` creates
    assert lm.model._target_ == "sky_flower.pipeline.lm.build_transformer_lm"
    assert lm.dataset._target_ == "sky_flower.pipeline.text.load_python_source"
    assert lm.objective.loss == "sky_flower.pipeline.lm:lm_cross_entropy"
    assert list(lm.model.input_shape) == [lm.model.seq_len] == [lm.dataset.seq_len]


def test_model_and_dataset_refusals_name_the_key():
    with pytest.raises(ValueError, match=r"model\._target_=nowhere\.net"):
        build_model({"_target_": "nowhere.net"})
    with pytest.raises(ValueError, match=r"model\._target_=.*build_mlp.*bogus"):
        build_model({"_target_": "sky_flower.pipeline.models.build_mlp", "bogus": 1})
    with pytest.raises(ValueError, match=r"model\.name=cnn_bn does not choose.*model=cnn_bn"):
        build_model(OmegaConf.to_container(make_cfg(["model.name=cnn_bn"]).model))
    with pytest.raises(ValueError, match=r"unknown model 'conv'.*model=<name>.*_target_"):
        build_model({"name": "conv"})
    with pytest.raises(ValueError, match=r"model\.name=conv does not.*model=<one of mlp, cnn"):
        build_model(OmegaConf.to_container(make_cfg(["model.name=conv"]).model))
    with pytest.raises(ValueError, match=r"returned int, not an nn.Module"):
        build_model({"_target_": "builtins.int"})
    with pytest.raises(ValueError, match=r"dataset\._target_=test_models\.not_a_loader"):
        load_dataset({"_target_": "test_models.not_a_loader"})
    with pytest.raises(ValueError, match=r"dataset\._target_=nowhere\.load"):
        load_dataset({"_target_": "nowhere.load"})
    train, _ = load_dataset({"_target_": "test_models.half_digits", "keep": 0.25}, seed=0)
    assert len(train) == int(1437 * 0.25)
    assert load_dataset({"name": "digits", "float_labels": True})[0].y.dtype == np.float32


@pytest.mark.parametrize(
    ("overrides", "model", "dataset", "message"),
    [
        (["model.name=resnet"], None, None, r"model\.name=resnet does not choose"),
        ([], {"_target_": "nowhere.net"}, None, r"model\._target_=nowhere\.net"),
        ([], None, {"_target_": "nowhere.load"}, r"dataset\._target_=nowhere\.load"),
        (["model.input_shape=[8,8]"], None, None, r"model\.input_shape=\[8, 8\].*\[64\]"),
        (["objective.loss=torch:nothing"], None, None, r"objective\.loss: cannot import"),
        (["objective.loss=cross_entropy"], None, None, r"objective\.loss must be"),
        # float labels with cross-entropy: refused before Flower, naming the key
        (["dataset.float_labels=true"], None, None, r"objective\.loss=.*cross_entropy fails"),
        (["task=regression"], None, None, r"objective\.loss=.*mse fails.*\(\d, 10\)"),
        ([], {"_target_": "test_models.lstm_net"}, None, r"layer 1 \(LSTM\) returns a tuple"),
        (
            ["schedule.batch_size=4", "schedule.microbatches=4", "transport=direct"],
            USER_MODEL,
            None,
            r"layer 1 \(BatchNorm1d\) gets micro-batches of 1.*GroupNorm",
        ),
    ],
)
def test_job_refuses_before_flower_starts(overrides, model, dataset, message, tmp_path):
    from sky_flower.run import run_job

    cfg = _cfg(["fleet=uniform3", *overrides], model, dataset)
    with pytest.raises(ValueError, match=message):
        run_job(cfg, tmp_path)
    assert not (tmp_path / "benchmark.json").exists()


# ---- layer patterns (profile and the planning precheck) ---------------------------------


def test_tuple_output_refused_naming_the_layer_and_the_fix():
    for model, name in (
        (lstm_net(), "LSTM"),
        (nn.Sequential(nn.Linear(64, 64), TwoOutputs(), nn.Linear(64, 10)), "TwoOutputs"),
    ):
        with pytest.raises(ValueError, match=rf"layer 1 \({name}\) returns a tuple.*FirstOutput"):
            profile_layers(model, (64,), 4)
    grouped = nn.Sequential(
        nn.Unflatten(1, (8, 8)),
        nn.Sequential(nn.LSTM(8, 16, batch_first=True), FirstOutput()),  # the fix
        nn.Flatten(),
        nn.Linear(128, 10),
    )
    assert [p.name for p in profile_layers(grouped, (64,), 4)][1] == "1:Sequential"


def test_sequential_subclass_with_own_forward_refused():
    model = SkipSequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"SkipSequential.*own forward.*plain chain"):
        profile_layers(model, (64,), 4)
    with pytest.raises(ValueError, match="own forward"):
        check_layers(model, torch.randn(2, 64), 2)


def test_inplace_relu_after_batchnorm_works_via_build_model_and_is_named_otherwise():
    raw = user_net()  # the Python API path: ReLU(inplace=True) as an entry of its own
    with pytest.raises(ValueError, match=r"layer 2 \(ReLU\) modifies its input in place"):
        profile_layers(raw, (64,), 4)
    built = build_model(USER_MODEL)  # the config path: the entry runs out of place
    assert built[2].inplace is False and built[3][2].inplace is True  # inside a block: kept
    profiles = profile_layers(built, (64,), 4)
    assert len(profiles) == 5
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    raw.load_state_dict(built.state_dict())
    assert torch.equal(raw(x), built(x))  # the same function
    profile_layers(build_model({"_target_": "sky_flower.pipeline.models.build_resnet"}), (64,), 4)


def test_batchnorm_with_single_sample_microbatches_names_layer_and_fix():
    model = nn.Sequential(nn.Linear(64, 8), nn.Sequential(nn.BatchNorm1d(8), nn.ReLU()))
    with pytest.raises(ValueError, match=r"layer 1\.0 \(BatchNorm1d\).*1 sample.*GroupNorm"):
        profile_layers(model, (64,), 1)
    assert len(profile_layers(model, (64,), 2)) == 2
    cnn = build_model({"_target_": "sky_flower.pipeline.models.build_cnn_bn"})
    with pytest.raises(ValueError, match=r"layer 0\.2 \(BatchNorm2d\)"):
        check_layers(cnn, torch.randn(2, 64), 1)


def test_regression_objective_checks():
    out, y = torch.tensor([[1.2], [2.6], [3.0]]), torch.tensor([1.0, 3.0, 5.0])
    assert float(mse(out, y)) == pytest.approx((0.04 + 0.16 + 4.0) / 3)
    assert rounded_correct(out, y) == 2
    with pytest.raises(ValueError, match=r"objective\.loss=.*cross_entropy fails.*float32"):
        check_objective(
            nn.Linear(4, 3), torch.randn(2, 4), y[:2], nn.functional.cross_entropy, rounded_correct
        )


# ---- end to end through Flower messages (in process: each message a fresh ClientApp) ----

FAST = [
    "fleet=uniform3",
    "num_rounds=1",
    "allocation=even",
    "benchmark.warmup=0",
    "benchmark.repeats=1",
    "benchmark.echo_repeats=1",
    "benchmark.echo_jitter_s=0",
    "benchmark.state_probe_mb=0",
]


def _train_in_process(cfg) -> tuple[dict, list[dict]]:
    """The Hydra job's inputs (model, data, objective by ``_target_``, checked as
    ``run_job`` checks them) trained by ``SkyStrategy`` with the job's ``SkyClient`` on an
    in-process Grid; returns the job's inputs and the strategy's round rows."""
    from sky_flower.strategies.sky import SkyModel, SkyStrategy

    from sky_flower.jobs.sky import evaluate_fn_for
    from sky_flower.sky.node.client import SkyClient, fleet_emulation, owner_data_fn

    settings = SkySettings.from_hydra(cfg)
    inputs = _checked(cfg)
    fleet, model_fn = inputs["fleet"], inputs["model_fn"]
    strategy = SkyStrategy(
        SkyModel.from_settings(model_fn, inputs["input_shape"], settings),
        settings,
        node_order=[n.name for n in fleet],
        min_nodes=len(fleet),
    )
    strategy.precheck([n.name for n in fleet], [None] * len(fleet))
    app = SkyClient(
        model_fn=model_fn,
        load_data=owner_data_fn(fleet, inputs["dataset"], seed=settings.seed),
        emulation_fn=fleet_emulation(fleet),
    ).register(ClientApp())
    nodes = [{"partition-id": i, "num-partitions": len(fleet)} for i in range(len(fleet))]
    torch.manual_seed(settings.seed)
    strategy.start(
        grid=ProcessPerMessageGrid(lambda: app, nodes, {}),
        initial_arrays=ArrayRecord(model_fn().state_dict()),
        num_rounds=settings.num_rounds,
        evaluate_fn=evaluate_fn_for(
            model_fn, inputs["test"], inputs["loss_fn"], inputs["metric_fn"]
        ),
    )
    assert strategy.plan is not None and len(strategy.plan.stages) == 3
    return inputs, strategy.rounds


@pytest.mark.parametrize(
    ("overrides", "model", "target"),
    [
        (["model=cnn_bn", "train.lr=0.005", "train.local_epochs=2"], None, 0.9),
        # slow (make test-all): the same relay path as [cnn_bn], which keeps a shipped
        # convolutional model with BatchNorm2d trained end to end in make test; the
        # resnet's entries are built and profiled by the tests above
        pytest.param(
            ["model=resnet", "train.lr=0.005", "train.local_epochs=2"],
            None,
            0.9,
            marks=pytest.mark.slow,
        ),
        (["train.lr=0.01", "train.local_epochs=2"], USER_MODEL, 0.9),
    ],
    ids=["cnn_bn", "resnet", "user_target"],
)
# e2e (make test): convergence. In make test-fast, a BatchNorm and Dropout model's relay
# rounds equal unsplit training in tests/test_replan.py
@pytest.mark.e2e
def test_model_trains_end_to_end(overrides, model, target, server_identity, capsys):
    cfg = _cfg([*FAST, "schedule.batch_size=128", *overrides], model)
    inputs, rounds = _train_in_process(cfg)
    (row,) = rounds
    with capsys.disabled():
        print(f"\n{inputs['model_cfg'].get('_target_')}: test accuracy {row.test['accuracy']:.4f}")
    assert row.error is None
    assert row.test["accuracy"] > target


# e2e (make test): convergence. In make test-fast, any loss's split training equals
# unsplit training in tests/test_exact_objective.py
@pytest.mark.e2e
def test_regression_trains_end_to_end(server_identity, capsys):
    cfg = _cfg(
        [
            *FAST,
            "task=regression",
            "dataset.float_labels=true",
            "model.num_classes=1",
            # 44 steps (wider, batches of 64, two epochs): test MSE 2.63, rounded 0.28
            "model.hidden_width=256",
            "model.hidden_layers=2",
            "schedule.batch_size=64",
            "train.lr=0.003",
            "train.local_epochs=2",
        ]
    )
    inputs, rounds = _train_in_process(cfg)
    assert inputs["train"].y.dtype == np.float32
    (row,) = rounds
    with capsys.disabled():
        print(f"\nregression: test MSE {row.test['loss']:.3f}, rounded {row.test['accuracy']:.3f}")
    assert row.error is None
    # the untrained MLP's test MSE is about 29, the labels' variance about 8.3; rounded to
    # the nearest digit, chance is about 0.1
    assert row.test["loss"] < 3.0
    assert row.test["accuracy"] > 0.2


# ---- the Flower app: hydra_parts and the run config's loss / metric ----------------------


def test_flower_app_parts_and_run_config_objective():
    from sky_flower.app import hydra_parts, sky_strategy, validate_run_config

    parts = hydra_parts(["model=cnn_bn"])
    assert parts.input_shape == [64] and len(parts.model_fn()) == 5
    a, b = parts.load_data(0, 2), parts.load_data(1, 2)
    assert len(a) + len(b) == 1437 and not set(map(bytes, a.x)) & set(map(bytes, b.x))
    user = hydra_parts(["~model", "+model._target_=test_models.user_net", "+model.width=8"])
    assert user.input_shape == [64] and user.model_fn()[0].out_features == 8
    regression = {"loss": "sky_flower.pipeline.objective:mse", "metric": "m:n"}
    with pytest.raises(ValueError, match=r"run config metric: cannot import 'm:n'"):
        validate_run_config(regression)
    regression["metric"] = "sky_flower.pipeline.objective:rounded_correct"
    strategy = sky_strategy(
        {"fleet": "edge3", **regression}, model_fn=lambda: build_mlp(64, 8, 3, 1), input_shape=[64]
    )
    assert (strategy.model.loss_fn, strategy.model.metric_fn) == (mse, rounded_correct)
    with pytest.raises(ValueError, match=r"run config loss must be \"module:qualname\""):
        validate_run_config({"loss": "mse"})


# cnn_bn in the simulation engine: test_model_trains_end_to_end[cnn_bn] trains it to 0.9 in
# process; the engine's relay path is tests/test_simulation.py's (its arrays travel alike)


def test_even_over_the_default_fleets_memory_caps_is_refused_before_flower_starts(tmp_path):
    """edge4 (the default fleet, ``make run``'s) caps its phone owner's memory below
    ``even``'s equal share, whatever the sample counts: refused before the benchmark
    round, not after it."""
    from sky_flower.run import run_job

    cfg = _cfg(["fleet=edge4", "allocation=even"])
    with pytest.raises(ValueError, match=r"even cannot fit .* before the benchmark round.*'phone'"):
        run_job(cfg, tmp_path)
    assert not (tmp_path / "benchmark.json").exists()
