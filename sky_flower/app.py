"""Sky for a Flower app run with ``flwr run``: run config -> SkyStrategy, node config ->
emulated device.

A Flower app adopts Sky with two calls (see ``examples/sky-app``)::

    # client_app.py: keep your handlers, add Sky's
    register_sky_client(app, model_fn=Net, load_data=load_data)

    # server_app.py: where FedAvg was built
    strategy = sky_strategy(context.run_config, model_fn=Net, input_shape=[64])

Run config (``[tool.flwr.app.config]`` in the app's ``pyproject.toml``, overridable with
``flwr run --run-config``), the names and values of the Hydra configs
(``conf/config.yaml``, ``conf/allocation/*.yaml``, ``conf/fleet/*.yaml``):

=====================  ===================================================================
``allocation``         ``even`` | ``heuristic`` | ``optimal``
``fleet``              a packaged fleet (``sky_flower.conf.fleet``: ``edge3``, ``edge4``, ...):
                       the nodes' pipeline order and, in simulation, node ``i``'s device
``transport``          ``relay`` (through the server) | ``direct`` (peer-to-peer, issue 4)
``schedule-kind``      ``sequential`` (relay only) | ``gpipe`` | ``1f1b`` (``schedule.kind``)
``direct-host``        ``transport=direct``: the address of the round's TCPStore (the
                       ServerApp's host, reachable from every stage node; ``127.0.0.1``)
``num-server-rounds``  rounds of split training
``lr``, ``local-epochs``, ``steps-per-round``, ``batch-size``, ``microbatches``,
``microbatches-per-message``, ``optimizer``, ``benchmark-repeats``, ``echo-repeats``,
``state-probe-mb``, ``message-timeout-s``, ``direct-timeout-s``,
``direct-join-timeout-s``: as ``train.*``, ``schedule.*``, ``benchmark.*`` in
``conf/config.yaml``
=====================  ===================================================================

:func:`validate_run_config` refuses an unknown key or value, listing the valid choices,
before any node is contacted.

Node config (``flower-supernode --node-config``): ``sky-node=<name>`` names the node; its
emulated device is ``sky-holds-data``, ``sky-slowdown``, ``sky-memory-mb``,
``sky-latency-ms``, ``sky-bandwidth-mb-s`` (the fleet file's keys, see
:class:`sky_flower.emulation.devices.Emulation`); its data is ``partition-id`` of
``num-partitions``. A node with no ``sky-node`` (Flower's simulation engine, which sets
only ``partition-id`` / ``num-partitions``) is fleet node ``partition-id`` of the run
config's ``fleet``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from flwr.app import Context
from flwr.clientapp import ClientApp
from omegaconf import OmegaConf
from torch import nn

from sky_flower.emulation.devices import Emulation, expand_fleet

if TYPE_CHECKING:
    from sky_flower.pipeline.data import Split
    from sky_flower.pipeline.stage import LossFn, MetricFn

TRANSPORTS = ("relay", "direct")
SCHEDULE_KINDS = ("sequential", "gpipe", "1f1b")  # as sky_flower.core.cost (torch-free here)
OPTIMIZERS = ("adam", "sgd", "sgd_momentum")

# run-config key -> (type, default); the defaults are conf/config.yaml's
RUN_CONFIG_KEYS: dict[str, tuple[type, Any]] = {
    "num-server-rounds": (int, 3),
    "allocation": (str, "heuristic"),
    "fleet": (str, "edge4"),
    "transport": (str, "relay"),
    "schedule-kind": (str, "sequential"),
    "lr": (float, 1e-4),
    "local-epochs": (float, 1.0),
    "steps-per-round": (int, 0),
    "batch-size": (int, 64),
    "microbatches": (int, 1),
    "microbatches-per-message": (int, 0),
    "optimizer": (str, "adam"),
    "benchmark-repeats": (int, 7),
    "echo-repeats": (int, 7),
    "state-probe-mb": (float, 64.0),
    "message-timeout-s": (float, 120.0),
    "direct-timeout-s": (float, 30.0),
    "direct-join-timeout-s": (float, 60.0),
    "direct-host": (str, "127.0.0.1"),
}

POLL_INTERVAL_S = 0.05  # the ServerApp's reply polling period under `flwr run`

# node-config key -> Emulation field
NODE_CONFIG_KEYS = {
    "sky-holds-data": "holds_data",
    "sky-slowdown": "slowdown",
    "sky-memory-mb": "memory_mb",
    "sky-latency-ms": "latency_ms",
    "sky-bandwidth-mb-s": "bandwidth_mb_s",
    "sky-fail-on": "fail_on",
    "sky-fail-mode": "fail_mode",
}


def fleet_names() -> list[str]:
    """Names of the packaged fleets (``conf/fleet/*.yaml``, package ``sky_flower.conf.fleet``)."""
    files = resources.files("sky_flower.conf.fleet").iterdir()
    return sorted(p.name.removesuffix(".yaml") for p in files if p.name.endswith(".yaml"))


@cache
def load_fleet(name: str) -> tuple[Emulation, ...]:
    """The nodes of packaged fleet ``name``, in pipeline order.

    Raises
    ------
    ValueError
        On an unknown fleet (lists the packaged ones) or an invalid fleet file.
    """
    names = fleet_names()
    if name not in names:
        raise ValueError(f"unknown fleet {name!r}: choose one of {', '.join(names)}")
    text = resources.files("sky_flower.conf.fleet").joinpath(f"{name}.yaml").read_text()
    spec = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    return tuple(expand_fleet(spec))  # type: ignore[arg-type]


@dataclass(frozen=True)
class SkyRunConfig:
    """A validated run config (see the module docstring for the keys)."""

    num_server_rounds: int
    allocation: str
    fleet: str
    transport: str
    schedule_kind: str
    lr: float
    local_epochs: float
    steps_per_round: int
    batch_size: int
    microbatches: int
    microbatches_per_message: int
    optimizer: str
    benchmark_repeats: int
    echo_repeats: int
    state_probe_mb: float
    message_timeout_s: float
    direct_timeout_s: float
    direct_join_timeout_s: float
    direct_host: str

    @property
    def nodes(self) -> tuple[Emulation, ...]:
        """The fleet's nodes."""
        return load_fleet(self.fleet)


def _choice(key: str, value: str, choices: tuple[str, ...] | list[str]) -> str:
    if value not in choices:
        raise ValueError(
            f"run config {key}={value!r} is not valid: choose one of {', '.join(choices)} "
            f"(e.g. flwr run <app> --run-config \"{key}='{choices[0]}'\")"
        )
    return value


def validate_run_config(
    run_config: Mapping[str, Any], app_keys: tuple[str, ...] = ()
) -> SkyRunConfig:
    """Check ``context.run_config`` for Sky before any node is contacted.

    Parameters
    ----------
    run_config : mapping
        The app's run config (``[tool.flwr.app.config]`` plus ``--run-config``).
    app_keys : tuple of str
        Keys the app itself uses besides Sky's (allowed, not checked).

    Returns
    -------
    SkyRunConfig
        With the defaults of ``conf/config.yaml`` for keys not set.

    Raises
    ------
    ValueError
        On an unknown key (lists the valid keys), a value of the wrong type, or an
        unknown ``allocation`` / ``fleet`` / ``transport`` / ``schedule-kind`` /
        ``optimizer`` (lists the valid choices), ``schedule-kind='sequential'`` with
        ``transport='direct'``, micro-batches that do not divide the batch, or a count
        or timeout that is not positive.
    """
    unknown = sorted(set(run_config) - set(RUN_CONFIG_KEYS) - set(app_keys))
    if unknown:
        raise ValueError(
            f"unknown run config key(s) {unknown}: valid keys are "
            f"{', '.join(list(RUN_CONFIG_KEYS) + list(app_keys))}"
        )
    values: dict[str, Any] = {}
    for key, (kind, default) in RUN_CONFIG_KEYS.items():
        raw = run_config.get(key, default)
        if isinstance(raw, bool) or (kind is str and not isinstance(raw, str)):
            raise ValueError(f"run config {key}={raw!r} must be a {kind.__name__}")
        try:
            value = kind(raw)
        except (TypeError, ValueError) as err:
            raise ValueError(f"run config {key}={raw!r} must be a {kind.__name__}") from err
        if kind is int and value != raw:
            raise ValueError(f"run config {key}={raw!r} must be an integer")
        values[key.replace("-", "_")] = value
    from sky_flower.core.partition import METHODS  # scipy: not imported on ClientApp start

    _choice("allocation", values["allocation"], METHODS)
    _choice("fleet", values["fleet"], fleet_names())
    _choice("transport", values["transport"], TRANSPORTS)
    _choice("schedule-kind", values["schedule_kind"], SCHEDULE_KINDS)
    if values["transport"] == "direct" and values["schedule_kind"] == "sequential":
        raise ValueError(
            "run config schedule-kind='sequential' runs on transport='relay' only: with "
            "transport='direct' choose one of gpipe, 1f1b "
            "(e.g. --run-config \"transport='direct' schedule-kind='gpipe' microbatches=4\")"
        )
    if values["batch_size"] % max(values["microbatches"], 1):
        raise ValueError(
            f"run config microbatches={values['microbatches']} must divide "
            f"batch-size={values['batch_size']}"
        )
    mpm = values["microbatches_per_message"]
    if mpm < 0 or (mpm and values["microbatches"] % mpm):
        raise ValueError(
            f"run config microbatches-per-message={mpm} must be 0 (the cost model picks it) "
            f"or a divisor of microbatches={values['microbatches']}"
        )
    if not values["direct_timeout_s"] > 0 or not values["direct_join_timeout_s"] > 0:
        raise ValueError("run config direct-timeout-s and direct-join-timeout-s must be > 0")
    if not values["direct_host"].strip():
        raise ValueError("run config direct-host must name the ServerApp's address")
    _choice("optimizer", values["optimizer"], OPTIMIZERS)
    for key in ("num_server_rounds", "batch_size", "microbatches", "benchmark_repeats"):
        if values[key] < 1:
            raise ValueError(f"run config {key.replace('_', '-')} must be >= 1, got {values[key]}")
    for key, ok, rule in (
        ("echo_repeats", values["echo_repeats"] >= 1, ">= 1"),
        ("steps_per_round", values["steps_per_round"] >= 0, ">= 0 (0: use local-epochs)"),
        ("lr", values["lr"] > 0, "> 0"),
        ("local_epochs", values["local_epochs"] > 0, "> 0"),
        ("state_probe_mb", values["state_probe_mb"] >= 0, ">= 0"),
        ("message_timeout_s", values["message_timeout_s"] > 0, "> 0"),
    ):
        if not ok:
            name = key.replace("_", "-")
            raise ValueError(f"run config {name} must be {rule}, got {values[key]}")
    cfg = SkyRunConfig(**values)
    cfg.nodes  # noqa: B018 - loads and checks the fleet file now
    return cfg


def sky_strategy(
    run_config: Mapping[str, Any],
    model_fn: Callable[[], nn.Module],
    input_shape: list[int],
    app_keys: tuple[str, ...] = (),
    **kwargs: Any,
) -> Any:  # noqa: ANN401 - sky_flower.strategies.sky.SkyStrategy, imported lazily
    """A :class:`sky_flower.strategies.sky.SkyStrategy` built from the run config.

    Parameters
    ----------
    run_config : mapping
        ``context.run_config`` (validated here, see :func:`validate_run_config`).
    model_fn : callable
        ``() -> nn.Sequential``: the model, as on the nodes.
    input_shape : list of int
        One sample's shape, without the batch dimension (e.g. ``[64]``).
    app_keys : tuple of str
        The app's own run-config keys, allowed besides Sky's.
    **kwargs
        Passed to ``SkyStrategy`` (e.g. ``on_event``).

    Raises
    ------
    ValueError
        On a bad run config, before any node is contacted; also from ``SkyStrategy``
        (e.g. a transport it does not run yet) and from the memory pre-check against the
        fleet's memory caps.
    """
    from sky_flower.core.cost import Schedule
    from sky_flower.strategies.sky import SkyStrategy

    cfg = validate_run_config(run_config, app_keys)
    strategy = SkyStrategy(
        model_fn=model_fn,
        input_shape=input_shape,
        allocation=cfg.allocation,
        schedule=Schedule(
            batch_size=cfg.batch_size,
            microbatches=cfg.microbatches,
            kind=cfg.schedule_kind,  # type: ignore[arg-type]
            transport=cfg.transport,  # type: ignore[arg-type]
            microbatches_per_message=cfg.microbatches_per_message,
        ),
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        local_epochs=cfg.local_epochs,
        steps_per_round=cfg.steps_per_round,
        node_order=[n.name for n in cfg.nodes],
        min_nodes=len(cfg.nodes),
        benchmark_repeats=cfg.benchmark_repeats,
        echo_repeats=cfg.echo_repeats,
        state_probe_bytes=int(cfg.state_probe_mb * 2**20),
        message_timeout_s=cfg.message_timeout_s,
        direct_timeout_s=cfg.direct_timeout_s,
        direct_host=cfg.direct_host,
        direct_join_timeout_s=cfg.direct_join_timeout_s,
        **kwargs,
    )
    # under `flwr run` every poll for replies is an HTTP call to the SuperLink: 2 ms polls
    # would take the CPU from the nodes themselves (a SuperLink ran at 17 % CPU with
    # 20 ms polls); hops cost about 0.05 s in simulation and seconds in deployment
    strategy.poll_interval_s = POLL_INTERVAL_S
    strategy.precheck(
        [n.name for n in cfg.nodes],
        [None if n.memory_mb is None else n.memory_mb * 2**20 for n in cfg.nodes],
    )
    return strategy


def _parse_bool(key: str, value: Any) -> bool:  # noqa: ANN401 - a node-config value
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"node config {key}={value!r} must be true or false")


def emulation_from_node_config(node_config: Mapping[str, Any]) -> Emulation:
    """The emulated device a SuperNode declares in its ``--node-config``.

    Parameters
    ----------
    node_config : mapping
        ``sky-node`` (the name) and any of ``sky-holds-data``, ``sky-slowdown``,
        ``sky-memory-mb``, ``sky-latency-ms``, ``sky-bandwidth-mb-s`` (``sky-fail-on``,
        ``sky-fail-mode`` for tests).

    Raises
    ------
    ValueError
        On an unknown ``sky-*`` key (lists the valid ones) or an invalid value.
    """
    unknown = sorted(
        k
        for k in node_config
        if k.startswith("sky-") and k != "sky-node" and k not in NODE_CONFIG_KEYS
    )
    if unknown:
        raise ValueError(
            f"unknown node config key(s) {unknown}: valid keys are sky-node, "
            f"{', '.join(NODE_CONFIG_KEYS)}"
        )
    spec: dict[str, Any] = {"name": str(node_config["sky-node"])}
    for key, field in NODE_CONFIG_KEYS.items():
        if key not in node_config:
            continue
        value = node_config[key]
        if field == "holds_data":
            spec[field] = _parse_bool(key, value)
        elif field in ("fail_on", "fail_mode"):
            spec[field] = str(value)
        else:
            spec[field] = float(value)
    return Emulation.from_mapping(spec)


def node_emulation(context: Context) -> Emulation:
    """This node's emulated device: from its node config when it names itself
    (``sky-node``), else fleet node ``partition-id`` of the run config's ``fleet``.

    Raises
    ------
    ValueError
        If neither names the node, or ``partition-id`` has no fleet entry.
    """
    if "sky-node" in context.node_config:
        return emulation_from_node_config(context.node_config)
    if "partition-id" not in context.node_config:
        raise ValueError(
            "this SuperNode has no sky-node in its node config: start it with "
            '--node-config "sky-node=<name> partition-id=<i> num-partitions=<n>"'
        )
    fleet = load_fleet(str(context.run_config.get("fleet", RUN_CONFIG_KEYS["fleet"][1])))
    pid = int(context.node_config["partition-id"])
    if not 0 <= pid < len(fleet):
        raise ValueError(
            f"partition-id {pid} has no entry in the {len(fleet)}-node fleet "
            f"{context.run_config.get('fleet')!r}: run as many SuperNodes as the fleet has nodes"
        )
    return fleet[pid]


def register_sky_client(
    app: ClientApp,
    model_fn: Callable[[], nn.Module],
    load_data: Callable[[int, int], Split],
    loss_fn: LossFn | None = None,
    metric_fn: MetricFn | None = None,
) -> ClientApp:
    """Add Sky's handlers to a ClientApp, beside its own.

    Parameters
    ----------
    app : ClientApp
        The app's ClientApp (its ``train`` / ``evaluate`` handlers stay).
    model_fn : callable
        ``() -> nn.Sequential``, the same model as the ServerApp's.
    load_data : callable
        ``(partition_id, num_partitions) -> Split``: the app's own partition loader
        (numpy ``x`` of shape ``(n, *input_shape)``, int64 ``y`` of shape ``(n,)``). It is
        called only on data owners (the node's emulated device ``holds_data``), with the
        node config's ``partition-id`` and ``num-partitions``, and cached per node.
    loss_fn, metric_fn : callable, optional
        The last stage's ``(output, labels) -> scalar`` loss and ``(output, labels) ->
        int`` metric (default: those the ServerApp's strategy names; cross-entropy and
        correct predictions), see :class:`sky_flower.sky.client.SkyClient`.

    Returns
    -------
    ClientApp
        ``app``.
    """
    from sky_flower.sky.client import SkyClient

    cached: dict[tuple[int, int], Split] = {}

    def owner_data(context: Context) -> Split | None:
        if not node_emulation(context).holds_data:
            return None
        key = (
            int(context.node_config.get("partition-id", 0)),
            int(context.node_config.get("num-partitions", 1)),
        )
        if key not in cached:
            cached[key] = load_data(*key)
        return cached[key]

    client = SkyClient(
        model_fn=model_fn,
        load_data=owner_data,
        emulation_fn=node_emulation,
        loss_fn=loss_fn,
        metric_fn=metric_fn,
    )
    return client.register(app)
