"""Sky in a Flower app: run-config validation, node-config emulation, the example apps'
diff and bundle size, the launcher's checks (no engine, no processes: fast)."""

import difflib
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk
from flwr.common.config import parse_config_args
from flwr.common.constant import FAB_MAX_SIZE
from flwr.serverapp import Grid

from sky_flower.app import (
    RUN_CONFIG_KEYS,
    emulation_from_node_config,
    fleet_names,
    load_fleet,
    sky_strategy,
    validate_run_config,
)
from sky_flower.deploy import (
    DeployError,
    app_run_config,
    check_run_config,
    make_credentials,
    node_config,
)

ROOT = Path(__file__).resolve().parents[1]
FEDAVG, SKY = ROOT / "examples" / "fedavg-app", ROOT / "examples" / "sky-app"


def test_defaults_are_the_hydra_defaults():
    cfg = validate_run_config({})
    assert (cfg.allocation, cfg.fleet, cfg.transport) == ("heuristic", "edge4", "relay")
    assert [n.name for n in cfg.nodes] == ["phone", "laptop", "cloud-gpu", "edge-box"]
    assert set(fleet_names()) >= {"edge3", "edge4", "uniform3"}


def test_auto_transport_is_the_stream_in_a_real_federation_and_the_relay_on_a_fleet():
    assert validate_run_config({"transport": "auto", "fleet": ""}).transport == "stream"
    assert validate_run_config({"transport": "auto", "fleet": "edge3"}).transport == "relay"
    assert validate_run_config({"transport": "auto"}).transport == "relay"  # fleet edge4
    assert validate_run_config({"fleet": ""}).transport == "stream"  # auto by default
    # the sky-app's own default: stream on real SuperNodes, the relay in simulation
    sky = app_run_config(SKY)
    assert sky["transport"] == "auto"
    assert validate_run_config({**sky, "fleet": ""}).transport == "stream"
    assert validate_run_config(sky).transport == "relay"
    # a user's explicit choice stands in a real federation
    assert validate_run_config({"transport": "relay", "fleet": ""}).transport == "relay"


@pytest.mark.parametrize(
    "run_config, words",
    [
        ({"allocation": "best"}, ["allocation", "even, heuristic, optimal"]),
        ({"fleet": "edge99"}, ["fleet", "edge3", "edge4"]),
        ({"transport": "udp"}, ["transport", "relay, direct"]),
        ({"alocation": "even"}, ["'alocation' is no Sky key: did you mean 'allocation'?"]),
        ({"batch_size": 8}, ["did you mean 'batch-size'?", "app_keys"]),
        ({"num-server-rounds": 0}, ["num-server-rounds", ">= 1"]),
        ({"num-server-rounds": 1.5}, ["num-server-rounds", "integer"]),
        ({"allocation": 3}, ["allocation", "str"]),
        ({"schedule-kind": "zigzag"}, ["schedule-kind", "sequential, gpipe, 1f1b"]),
        ({"transport": "direct"}, ["schedule-kind", "gpipe, 1f1b"]),
        ({"microbatches": 5}, ["microbatches=5", "batch-size=64"]),
        ({"microbatches": 4, "microbatches-per-message": 3}, ["microbatches-per-message"]),
        ({"direct-timeout-s": 0.0}, ["direct-timeout-s", "> 0"]),
    ],
)
def test_bad_run_config_is_refused_listing_choices(run_config, words):
    with pytest.raises(ValueError) as err:
        validate_run_config(run_config)
    for word in words:
        assert word in str(err.value)


def test_a_flower_apps_own_keys_are_named_in_a_warning_not_refused(caplog):
    """Flower's quickstart declares fraction-train and model-path for itself: they pass
    (Flower refuses undeclared keys, so they are the app's), named once; app_keys
    silences it; a key close to a Sky key is a typo, refused above."""
    own = {"fraction-train": 0.5, "model-path": "final_model.pt", "fleet": "edge3"}
    with caplog.at_level("WARNING", logger="sky_flower"):
        validate_run_config(own)
    said = [r.getMessage() for r in caplog.records if "not Sky's" in r.getMessage()]
    assert len(said) == 1 and "fraction-train, model-path" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="sky_flower"):
        validate_run_config(own, app_keys=("fraction-train", "model-path"))
    assert not [r for r in caplog.records if "not Sky's" in r.getMessage()]


def test_sky_strategy_from_run_config_and_transport_passthrough():
    import torch

    def net():
        return torch.nn.Sequential(
            *(torch.nn.Linear(64, 64) for _ in range(3)), torch.nn.Linear(64, 10)
        )

    strategy = sky_strategy(
        {"allocation": "even", "fleet": "edge3", "echo-repeats": 1}, model_fn=net, input_shape=[64]
    )
    assert strategy.settings.allocation.method == "even" and strategy.min_nodes == 3
    assert strategy.node_order == ["phone", "cloud", "box"]
    assert strategy.settings.benchmark.echo_repeats == 1
    # the schedule and the direct transport's settings reach SkyStrategy
    direct = sky_strategy(
        {
            "transport": "direct",
            "schedule-kind": "gpipe",
            "microbatches": 4,
            "direct-timeout-s": 12.0,
            "direct-join-timeout-s": 34.0,
            "direct-host": "10.0.0.5",
        },
        model_fn=net,
        input_shape=[64],
    )
    assert (direct.schedule.transport, direct.schedule.kind) == ("direct", "gpipe")
    assert direct.schedule.microbatches == 4
    run = direct.run_settings()
    d = run.settings.direct
    assert (d.timeout_s, d.join_timeout_s) == (12.0, 34.0)
    assert d.host == "10.0.0.5"
    relay = sky_strategy(
        {"schedule-kind": "1f1b", "microbatches": 8}, model_fn=net, input_shape=[64]
    )
    assert (relay.schedule.transport, relay.schedule.kind) == ("relay", "1f1b")


@pytest.mark.parametrize(
    "run_config, said, not_said",
    [
        (
            {"schedule-kind": "interleaved", "microbatches": 4},
            "transport=direct",
            "schedule.transport",
        ),
        (
            {"transport": "direct", "schedule-kind": "auto", "optimizer-state": "keep"},
            "optimizer-state=keep",
            "train.optimizer_state",
        ),
    ],
)
def test_strategy_refusals_name_run_config_keys_under_flwr_run(run_config, said, not_said):
    """A combination SkyStrategy refuses was named by its Hydra paths (``set
    schedule.transport=direct``), which a ``flwr run`` user cannot set; the app's error
    says the run-config keys."""
    import torch

    with pytest.raises(ValueError) as err:
        sky_strategy(
            run_config,
            model_fn=lambda: torch.nn.Sequential(torch.nn.Linear(64, 10)),
            input_shape=[64],
        )
    assert said in str(err.value) and not_said not in str(err.value)


def test_node_config_carries_the_emulated_device():
    for i, node in enumerate(load_fleet("edge4")):
        text = node_config(node, i, 4)
        parsed = parse_config_args([text])  # what flower-supernode --node-config does
        assert parsed["partition-id"] == i and parsed["num-partitions"] == 4
        assert emulation_from_node_config(parsed) == node
    with pytest.raises(ValueError, match="sky-slow"):
        emulation_from_node_config({"sky-node": "x", "sky-slow": 2.0})


def _changed_lines(a: Path, b: Path) -> list[str]:
    diff = difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), n=0)
    return [
        ln for ln in diff if ln[:1] in "+-" and not ln.startswith(("+++", "---")) and ln[1:].strip()
    ]


def test_sky_app_differs_from_fedavg_app_by_at_most_10_lines():
    changed = []
    for name in ("task.py", "client_app.py", "server_app.py", "__init__.py"):
        changed += _changed_lines(FEDAVG / "fedavg_app" / name, SKY / "sky_app" / name)
    assert 0 < len(changed) <= 10, changed
    assert any("register_sky_client(app" in ln for ln in changed)
    assert any("sky_strategy(context.run_config" in ln for ln in changed)


@pytest.mark.parametrize("app", [FEDAVG, SKY], ids=["fedavg-app", "sky-app"])
def test_app_bundle_stays_under_flowers_limit(app):
    fab = build_fab_from_disk(app)
    print(f"{app.name}: FAB {len(fab):,} bytes (limit {FAB_MAX_SIZE:,})")
    assert 0 < len(fab) < FAB_MAX_SIZE


def test_launcher_refuses_bad_run_config_before_starting_anything():
    assert check_run_config(SKY, "allocation='optimal'")["allocation"] == "optimal"
    with pytest.raises(DeployError, match="valid keys are num-server-rounds"):
        check_run_config(SKY, "no-such-key=1")
    with pytest.raises(DeployError, match="even, heuristic, optimal"):
        check_run_config(SKY, "allocation='fastest'")
    with pytest.raises(DeployError, match="sequential, gpipe, 1f1b"):
        check_run_config(SKY, "schedule-kind='pipelined'")
    merged = check_run_config(SKY, "transport='direct' schedule-kind='gpipe' microbatches=4")
    assert (merged["transport"], merged["schedule-kind"], merged["microbatches"]) == (
        "direct",
        "gpipe",
        4,
    )
    with pytest.raises(DeployError, match="valid keys"):
        check_run_config(FEDAVG, "allocation='even'")  # FedAvg has no allocation


def test_launcher_refuses_fleet_in_run_config_and_bad_timeout(tmp_path):
    from sky_flower.deploy import run_local

    with pytest.raises(ValueError, match="pass --fleet NAME instead"):
        run_local(SKY, "edge4", run_config="fleet='edge3'", workdir=tmp_path)
    with pytest.raises(ValueError, match="--timeout must be > 0"):
        run_local(SKY, "edge4", timeout_s=-5, workdir=tmp_path)
    assert not any(tmp_path.iterdir())  # refused before anything was started


def test_credentials_are_what_flower_loads(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key

    creds = make_credentials(tmp_path, 2)
    cert = x509.load_pem_x509_certificate(creds.server_cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    for key in creds.node_keys:
        load_ssh_private_key(key.read_bytes(), password=None)  # flower-supernode's loader
        assert try_load_public_key(key.with_suffix(".pub"))  # flwr supernode register's
    assert len(RUN_CONFIG_KEYS) >= 3


class _TwoNodeGrid(Grid):
    """Only what wait_for_nodes reads: two connected nodes (no engine needed for that)."""

    def get_node_ids(self):
        return [11, 12]

    def _unused(self, *args, **kwargs):
        raise AssertionError("wait_for_nodes only reads get_node_ids")

    create_message = pull_messages = push_messages = send_and_receive = _unused
    run = property(_unused)
    set_run = _unused


def test_missing_node_before_benchmark_is_left_out_with_a_warning(caplog):
    import logging

    import torch
    from sky_flower.strategies.sky import SkyModel, SkyNodeError, SkyStrategy

    model = SkyModel(lambda: torch.nn.Sequential(torch.nn.Linear(4, 2)), [4])
    strategy = SkyStrategy(model, min_nodes=3)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert strategy.wait_for_nodes(_TwoNodeGrid(), 0.2) == [11, 12]
    assert "Only 2 of 3 nodes connected" in caplog.text and "left out" in caplog.text

    class _NoNodeGrid(_TwoNodeGrid):
        def get_node_ids(self):
            return []

    with pytest.raises(SkyNodeError, match="no node connected"):
        strategy.wait_for_nodes(_NoNodeGrid(), 0.2)


def test_simulation_runtime_with_too_few_supernodes_names_num_supernodes(caplog, monkeypatch):
    """Under Flower's simulation runtime (its own InMemoryGrid and link state, 2
    SuperNodes registered as the runtime registers them) a fleet of 4 does not wait out
    node-wait-s for nodes that cannot join: it goes on after the settle time, and the
    warning names the num-supernodes setting that fixes it."""
    import logging
    import time

    from flwr.proto.task_pb2 import Task
    from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.superlink.federation import NoOpFederationManager
    from flwr.superlink.grid import InMemoryGrid

    from sky_flower.sky.planning import benchmark

    factory = LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
    ids = sorted(_register_nodes(num_nodes=2, state_factory=factory))
    run = Run.create_empty(run_id=7)
    run.primary_task_id, run.federation_id = 8, NOOP_FEDERATION_ID
    state = factory.state()  # the run registered as flwr's _run_simulation registers it
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[8] = Task(task_id=8, run_id=run.run_id)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    assert benchmark.fixed_node_count(grid) and not benchmark.fixed_node_count(_TwoNodeGrid())
    monkeypatch.setattr(benchmark, "SIMULATION_SETTLE_S", 0.2)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="flwr"):
        assert benchmark.wait_for_nodes(grid, 4, timeout=300.0) == ids
    assert time.monotonic() - t0 < 30.0  # the settle time, not node-wait-s
    assert 'num-supernodes=4"' in caplog.text and "missing 2 are left out" in caplog.text
    assert "Waiting for nodes: 2 of 4 connected" in caplog.text


def test_api_mistakes_are_refused_at_once_naming_the_fix():
    """Mistakes a Flower user makes switching an app (a built model for its builder, a
    shape as a number) are refused where they are made, not as torch's errors later."""
    import torch
    from flwr.clientapp import ClientApp

    from sky_flower.app import register_sky_client
    from sky_flower.pipeline.graph import sequential_fn, sequential_of

    def net():
        return torch.nn.Sequential(torch.nn.Linear(4, 2))

    for call, words in [
        (lambda: sequential_fn(net, 3072), ["input_shape", "[3, 32, 32]", "3072"]),
        (lambda: sequential_fn(net, [3, 0]), ["positive ints"]),
        (lambda: sequential_fn(net(), [4]), ["pass Net, not Net()"]),
        (lambda: sequential_of(net, [4]), ["built nn.Module", "sequential_fn"]),
        (lambda: sky_strategy({}, net()), ["sky_strategy", "a built Sequential"]),
        (
            lambda: register_sky_client(ClientApp(), net(), lambda p, n: None),
            ["register_sky_client", "sequential_fn(Net, input_shape)"],
        ),
    ]:
        with pytest.raises(TypeError) as err:
            call()
        for word in words:
            assert word in str(err.value), (word, str(err.value))
