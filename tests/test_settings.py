"""One settings source: every default of ``sky_flower.sky.settings.SkySettings`` is the
composed Hydra config's (``conf/config.yaml`` restates none), the run config's
(``sky_flower.app``) and ``examples/sky-app``'s; the settings reach ``SkyStrategy``; bad
values are refused naming the rule (fast, no engine)."""

import inspect
import tomllib
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sky_flower.app import RUN_CONFIG_KEYS, validate_run_config
from sky_flower.jobs.common import conf_dir
from sky_flower.sky.settings import (
    ALLOCATIONS,
    FLWR_RUN_POLL_INTERVAL_S,
    RENAMED_PATHS,
    SkySettings,
    run_config_keys,
    settings_fields,
)

ROOT = Path(__file__).resolve().parents[1]
SKY_APP = ROOT / "examples" / "sky-app" / "pyproject.toml"
# the example app's own choices (its documented figures are measured with them)
APP_CHOICES = {"num-server-rounds": 2, "lr": 0.001}


def _hydra(overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return compose("config", overrides=overrides or [])


def _same(a, b) -> bool:
    if isinstance(a, list | tuple):
        return list(a) == list(b)
    return a == b and type(a) is type(b) or (isinstance(a, int | float) and float(a) == b)


def test_every_default_is_the_hydra_yamls():
    cfg = _hydra()
    hydra_settings = [s for s in settings_fields() if s.hydra]
    assert len(hydra_settings) >= 25
    for s in hydra_settings:
        value = OmegaConf.select(cfg, s.path)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        assert value is not None, f"{s.path} is missing from conf/"
        assert _same(value, s.default), (s.path, value, s.default)
    assert SkySettings.from_hydra(cfg) == SkySettings()


def test_every_default_is_the_run_configs_and_the_sky_apps():
    app = tomllib.loads(SKY_APP.read_text())["tool"]["flwr"]["app"]["config"]
    keys = run_config_keys()
    assert RUN_CONFIG_KEYS == keys
    assert set(app) == set(keys), set(app) ^ set(keys)  # every key, and no other
    for s in settings_fields():
        key = s.key
        if key is None:
            continue
        kind, run_default = keys[key]
        assert run_default == s.field.metadata.get("run_default", s.default)
        assert type(run_default) is kind
        want = APP_CHOICES.get(key, run_default)
        assert app[key] == want and type(app[key]) is kind, (key, app[key], want)
    assert validate_run_config({}).settings == SkySettings.from_run_config({})
    assert SkySettings.from_run_config({}).messaging.poll_interval_s == FLWR_RUN_POLL_INTERVAL_S


def test_run_config_keys_follow_the_path_but_for_the_listed_exceptions():
    """A key is the path's name with ``-`` for ``_`` after its group's prefix; a field
    declares its key only where the published key differs, and the settings module's
    docstring lists every such exception."""
    from sky_flower.sky import settings

    for s in settings_fields():
        group, _, name = s.path.rpartition(".")
        rule = settings.KEY_PREFIXES.get(group, "") + name.replace("_", "-")
        if s.field.metadata["key"] == settings._DERIVED:
            assert s.key == rule, s.path
        elif s.key is not None:
            assert s.key != rule, f"{s.path}: its key {s.key!r} is the rule's, drop key="
            assert f"``{s.key}``" in settings.__doc__, f"{s.key} missing from the docstring"


def test_skystrategy_takes_the_settings_object_and_at_most_eight_parameters():
    """Issue 29: ``SkyStrategy(model, settings, *, ...)``, no mixin bases; its settings
    are the one settings object, so no default lives in its signature."""
    from flwr.serverapp.strategy import Strategy
    from sky_flower.strategies.sky import SkyStrategy

    from sky_flower.core.partition import METHODS

    assert tuple(METHODS) == ALLOCATIONS
    params = [p for p in inspect.signature(SkyStrategy.__init__).parameters if p != "self"]
    assert params[:2] == ["model", "settings"] and len(params) <= 8
    assert SkyStrategy.__bases__ == (Strategy,)
    s = SkySettings().replace({"train.lr": 0.5, "schedule.transport": "stream"})
    assert (s.train.lr, s.schedule.transport) == (0.5, "stream")
    assert s.replace({}) == s and SkySettings().train.lr != 0.5  # frozen: a copy
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['train.learning_rate'\]"):
        s.replace({"train.learning_rate": 0.1})
    with pytest.raises(ValueError, match=r"train\.lr must be > 0, got -1"):
        s.replace({"train.lr": -1})
    run = SkySettings.from_run_config({"fleet": "edge3", "lr": 0.5})
    with pytest.raises(ValueError, match=r"run config microbatches=3 must divide batch-size=64"):
        run.replace({"schedule.microbatches": 3})  # a run config's settings: its words


def test_hydra_overrides_and_refusals():
    s = SkySettings.from_hydra(_hydra(["transport=direct", "failure.max_failed_rounds=1"]))
    sched = s.schedule
    assert (sched.transport, sched.kind, sched.microbatches) == ("direct", "gpipe", 4)
    assert s.failure.max_failed_rounds == 1
    with pytest.raises(ValueError, match=r"train\.lr must be > 0, got -1"):
        SkySettings.from_hydra(_hydra(["train.lr=-1"]))
    with pytest.raises(ValueError, match=r"unknown allocation 'best'.*even, heuristic, optimal"):
        SkySettings.from_hydra(_hydra(["allocation.method=best"]))
    with pytest.raises(ValueError, match=r"benchmark\.repeats=1\.5 must be an integer"):
        SkySettings.from_hydra(_hydra(["benchmark.repeats=1.5"]))


@pytest.mark.parametrize(
    "run_config, words",
    [
        ({"max-failed-rounds": 0}, ["max-failed-rounds must be >= 1, got 0"]),
        ({"benchmark-warmup": -1}, ["benchmark-warmup must be >= 0"]),
        ({"poll-interval-s": 0.0}, ["poll-interval-s must be > 0"]),
        ({"results-path": 3}, ["results-path=3 must be a string"]),
        ({"optimizer": "lbfgs"}, ["optimizer", "adam, sgd, sgd_momentum"]),
    ],
)
def test_new_run_config_keys_are_checked(run_config, words):
    with pytest.raises(ValueError) as err:
        SkySettings.from_run_config(run_config)
    for word in words:
        assert word in str(err.value)


def test_run_config_reaches_the_strategy():
    import torch

    from sky_flower.app import sky_strategy

    strategy = sky_strategy(
        {"fleet": "edge3", "max-failed-rounds": 3, "node-wait-s": 9.0, "benchmark-warmup": 1},
        model_fn=lambda: torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3))),
        input_shape=[64],
    )
    s = strategy.settings
    assert s.failure.max_failed_rounds == 3 and s.messaging.node_wait_s == 9.0
    assert s.benchmark.warmup == 1
    assert strategy.run_settings().settings.messaging.poll_interval_s == FLWR_RUN_POLL_INTERVAL_S
    assert strategy.recovery.max_failed_rounds == 3


def test_old_keywords_and_wrong_arguments_are_refused_saying_where_they_went():
    """A user of the old 42-keyword constructor (or of ``sky_strategy``'s pass-through)
    is told where each keyword went, not a bare ``unexpected keyword``; a dict for the
    settings and a plan before the benchmark round are refused by name."""
    import torch
    from sky_flower.strategies.sky import SkyModel, SkyStrategy

    from sky_flower.app import sky_strategy
    from sky_flower.pipeline.objective import ref

    net = torch.nn.Sequential(torch.nn.Linear(4, 2))
    with pytest.raises(TypeError) as err:
        SkyStrategy(model_fn=lambda: net, input_shape=[4], lr=0.1, on_event=print, bogus=1)
    text = str(err.value)
    assert "model_fn: SkyModel(model_fn, input_shape)" in text
    assert "lr: SkySettings().replace({'train.lr': ...})" in text
    assert "on_event: hooks=[EventCallback(on_event)]" in text
    assert "bogus: not a SkyStrategy argument" in text
    with pytest.raises(TypeError, match=r"echo_jitter_s: run config key 'echo-jitter-s'"):
        sky_strategy({}, model_fn=lambda: net, input_shape=[4], echo_jitter_s=0.0)
    model = SkyModel(lambda: net, [4])
    with pytest.raises(TypeError, match=r"settings are a SkySettings, got dict.*replace"):
        SkyStrategy(model, {"train.lr": 0.1})
    with pytest.raises(ValueError, match="no node has been profiled yet: run the benchmark"):
        SkyStrategy(model).make_plan()
    with pytest.raises(ValueError, match="pass the function object itself"):
        SkyModel(lambda: net, [4], loss_fn="torch.nn.functional:cross_entropy")
    main_fn = type(ref)(ref.__code__, {"__name__": "__main__"}, "my_loss")
    assert main_fn.__module__ == "__main__"
    with pytest.raises(ValueError, match=r"script being run \(__main__\)"):
        ref(main_fn)


def test_a_renamed_hydra_path_is_refused_with_its_new_name():
    """Every old path of ``RENAMED_PATHS`` is no setting any more and its new path is
    one; ``replace`` names the new path."""
    paths = {s.path for s in settings_fields()}
    for old, new in RENAMED_PATHS.items():
        assert old not in paths and new in paths, (old, new)
    with pytest.raises(ValueError, match=r"schedule.stream_tls was renamed to stream.tls"):
        SkySettings().replace({"schedule.stream_tls": False})


def test_conf_restates_no_default_of_the_settings():
    """Each default is written once (issue 43): ``conf/config.yaml`` composes them from
    ``SkySettings`` (``sky_base``) and sets none itself; every setting is in the composed
    config, so a plain ``train.lr=...`` needs no ``+``."""
    from sky_flower.sky.settings import hydra_defaults

    own = OmegaConf.load(Path(conf_dir()) / "config.yaml")
    assert list(own.defaults)[0] == "sky_base"
    for s in settings_fields():
        assert OmegaConf.select(own, s.path) is None, f"{s.path} restated in conf/config.yaml"
    assert OmegaConf.to_container(_hydra(["transport=relay"]))["train"] == hydra_defaults()["train"]
    cfg = _hydra(["train.lr=0.5", "benchmark.echo_bytes=[10,20]", "transport=direct"])
    s = SkySettings.from_hydra(cfg)
    assert (s.train.lr, s.benchmark.echo_bytes, s.schedule.kind) == (0.5, (10, 20), "gpipe")


def test_an_unused_transport_setting_is_named_in_a_warning(caplog):
    """``transport=relay stream.timeout_s=5``: accepted (a sweep sets it across transports)
    and ignored, so a warning names the setting and the transport it applies to; none for
    a default value or a setting the transport reads."""
    with caplog.at_level("WARNING", logger="sky_flower"):
        SkySettings.from_hydra(_hydra(["transport=relay", "stream.timeout_s=5"]))
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "stream.timeout_s=5.0 is ignored: it applies to transport=stream (and direct's stage "
        "sessions), this run's schedule.transport is relay"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="sky_flower"):
        SkySettings.from_hydra(_hydra(["transport=stream", "stream.timeout_s=5"]))
        SkySettings.from_hydra(_hydra(["transport=relay", "stream.timeout_s=30"]))
        SkySettings.from_hydra(_hydra(["transport=direct", "stream.tls=false"]))  # sessions
        s = SkySettings.from_hydra(_hydra(["transport=direct", "stream.sessions=false"]))
    assert caplog.records == []
    assert s.replace({"stream.timeout_s": 9.0}).unread() == [
        "stream.timeout_s=9.0 is ignored: it applies to transport=stream (and direct's stage "
        "sessions), this run's schedule.transport is direct"
    ]
    run = SkySettings.from_run_config({"transport": "stream", "direct-host": "10.0.0.1"})
    assert run.unread() == [
        "direct-host='10.0.0.1' is ignored: it applies to transport=direct, this run's "
        "transport is stream"
    ]


def test_a_string_in_an_error_is_quoted():
    """``stream.host=''`` said ``got `` (nothing): a string value is shown with repr."""
    with pytest.raises(ValueError, match=r"stream\.host must be a non-empty address, got ''$"):
        SkySettings.from_hydra(_hydra(["stream.host=''"]))
    with pytest.raises(ValueError, match=r"run config stream-bind must be .*, got ' '$"):
        SkySettings.from_run_config({"stream-bind": " "})
    with pytest.raises(ValueError, match=r"objective\.loss must be .*, got 'nocolon'$"):
        SkySettings().replace({"objective.loss": "nocolon"})
    with pytest.raises(ValueError, match=r"echo_bytes must be a list of integers, got 'ab'$"):
        SkySettings().replace({"benchmark.echo_bytes": "ab"})
