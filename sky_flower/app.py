"""Sky for a Flower app run with ``flwr run``: run config -> SkyStrategy, node config ->
emulated device.

A Flower app adopts Sky with two calls (see ``examples/sky-app``)::

    # client_app.py: keep your handlers, add Sky's
    register_sky_client(app, model_fn=Net, load_data=load_data)

    # server_app.py: where FedAvg was built
    strategy = sky_strategy(context.run_config, model_fn=Net, input_shape=[64])

Run config (``[tool.flwr.app.config]`` in the app's ``pyproject.toml``, overridable with
``flwr run --run-config``): the keys of :class:`sky_flower.sky.settings.SkySettings`, with
its defaults (the Hydra job's too: ``conf/config.yaml`` composes them, its groups
``conf/allocation/*.yaml`` and ``conf/transport/relay.yaml`` choose the same), e.g.
``allocation`` (``even`` | ``heuristic`` | ``optimal``), ``fleet`` (a packaged fleet,
``sky_flower.conf.fleet``: the nodes' pipeline order and, in simulation, node ``i``'s
device), ``transport`` (``relay`` | ``direct`` | ``stream``), ``schedule-kind``,
``num-server-rounds``, ``lr``, ``max-failed-rounds``, ... and ``results-path`` (write the
run's ``results.json`` there; ``""``: none).

:func:`validate_run_config` refuses an unknown key or value, listing the valid choices,
before any node is contacted.

Your own model, data and objective in a Flower app: pass them to both calls (``model_fn``,
``load_data``, ``loss_fn`` / ``metric_fn``), or take the Hydra job's by ``_target_`` with
:func:`hydra_parts` (``hydra_parts(["model=cnn_bn"])``: the same configs, the same data
on every node as ``python -m sky_flower.run``); the run config's ``loss`` and ``metric``
name the objective by reference.

Node config (``flower-supernode --node-config``): ``sky-node=<name>`` names the node;
its emulated device is ``sky-holds-data``, ``sky-slowdown``, ``sky-memory-mb``,
``sky-latency-ms``, ``sky-bandwidth-mb-s`` (the fleet file's keys, see
:class:`sky_flower.emulation.devices.Emulation`); ``sky-device`` (``auto`` by default,
``cpu``, ``cuda``, ``cuda:N``) is the real device its stages compute on; its data is
``partition-id`` of ``num-partitions``. A node with no ``sky-node`` (Flower's simulation
engine, which sets only ``partition-id`` / ``num-partitions``) is fleet node
``partition-id`` of the run config's ``fleet``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context
from flwr.clientapp import ClientApp
from torch import nn

from sky_flower.emulation.devices import Emulation, compose_fleet, expand_fleet
from sky_flower.pipeline.device import check_device
from sky_flower.sky.settings import SkySettings, run_config_keys

if TYPE_CHECKING:
    from sky_flower.pipeline.data import Split
    from sky_flower.pipeline.stage import LossFn, MetricFn

# run-config key -> (type, default): SkySettings' fields (sky_flower/sky/settings.py)
RUN_CONFIG_KEYS: dict[str, tuple[type, Any]] = run_config_keys()

# node-config key -> Emulation field
NODE_CONFIG_KEYS = {
    "sky-holds-data": "holds_data",
    "sky-slowdown": "slowdown",
    "sky-memory-mb": "memory_mb",
    "sky-latency-ms": "latency_ms",
    "sky-bandwidth-mb-s": "bandwidth_mb_s",
    "sky-device": "device",
    "sky-fail-on": "fail_on",
    "sky-fail-mode": "fail_mode",
    "sky-fail-round": "fail_round",
    "sky-fail-step": "fail_step",
    "sky-fail-delay-s": "fail_delay_s",
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
    fleets = resources.files("sky_flower.conf.fleet")
    spec = compose_fleet(name, lambda n: fleets.joinpath(f"{n}.yaml").read_text())
    return tuple(expand_fleet(spec))


@dataclass(frozen=True)
class SkyRunConfig:
    """A validated run config: its :class:`SkySettings` and the fleet's nodes."""

    settings: SkySettings

    @property
    def allocation(self) -> str:
        """The allocation method."""
        return self.settings.allocation.method

    @property
    def fleet(self) -> str:
        """The packaged fleet's name."""
        return self.settings.fleet.name

    @property
    def transport(self) -> str:
        """``relay`` or ``direct``."""
        return self.settings.schedule.transport

    @property
    def nodes(self) -> tuple[Emulation, ...]:
        """The fleet's nodes (none when ``fleet`` is ``""``)."""
        return load_fleet(self.fleet) if self.fleet else ()


def validate_run_config(
    run_config: Mapping[str, Any], app_keys: tuple[str, ...] = ()
) -> SkyRunConfig:
    """Check ``context.run_config`` for Sky before any node is contacted.

    Parameters
    ----------
    run_config : mapping
        The app's run config (``[tool.flwr.app.config]`` plus ``--run-config``).
    app_keys : tuple of str
        Keys the app itself uses besides Sky's (allowed, not checked, not warned of).

    Returns
    -------
    SkyRunConfig
        With :class:`SkySettings`' defaults for keys not set.

    Raises
    ------
    ValueError
        As :meth:`SkySettings.from_run_config` (a key close to a Sky key, wrong type,
        unknown choice, a value outside its rule), or on an unknown ``fleet`` (lists the
        packaged ones). A key of the app's own that is not in ``app_keys`` is named in a
        warning.
    """
    settings = SkySettings.from_run_config(run_config, app_keys)
    fleets = fleet_names()
    if (
        settings.fleet.name and settings.fleet.name not in fleets
    ):  # "": no fleet (a real federation)
        raise ValueError(
            f"run config fleet={settings.fleet.name!r} is not valid: choose one of "
            f"{', '.join(fleets)} (e.g. flwr run <app> --run-config \"fleet='{fleets[0]}'\")"
        )
    cfg = SkyRunConfig(settings)
    cfg.nodes  # noqa: B018 - loads and checks the fleet file now
    return cfg


def _check_model_fn(model_fn: Any, who: str) -> None:  # noqa: ANN401 - what a caller gave
    """Refuse a ``model_fn`` that is a built model (``Net()``) or no callable, before any
    node is contacted.

    Raises
    ------
    TypeError
        Naming ``who`` and the fix (``sequential_fn(Net, input_shape)``).
    """
    built = isinstance(model_fn, nn.Module)
    if built or not callable(model_fn):
        got = f"a built {type(model_fn).__name__}" if built else repr(model_fn)
        raise TypeError(
            f"{who} takes model_fn, a function that builds the model, got {got}: pass "
            "sequential_fn(Net, input_shape) (sky_flower.pipeline.graph), or a function "
            "returning a fresh nn.Sequential"
        )


def sky_strategy(
    run_config: Mapping[str, Any],
    model_fn: Callable[[], nn.Module],
    input_shape: list[int] | None = None,
    app_keys: tuple[str, ...] = (),
    hooks: Sequence[Any] = (),
    input_dtype: str | None = None,
    **removed: Any,  # noqa: ANN401 - keywords it once passed on: refused, naming their key
) -> Any:  # noqa: ANN401 - sky_flower.strategies.sky.SkyStrategy, imported lazily
    """A :class:`sky_flower.strategies.sky.SkyStrategy` built from the run config.

    With ``results-path`` set, the run's ``results.json`` (the Hydra job's structure,
    :func:`sky_flower.jobs.common.sky_results`) is written there after every round and
    at the end (:class:`sky_flower.jobs.common.SkyRecorder`).

    Parameters
    ----------
    run_config : mapping
        ``context.run_config`` (validated here, see :func:`validate_run_config`).
    model_fn : callable
        ``() -> nn.Module``: the model, as on the nodes.
    input_shape : list of int, optional
        One sample's shape, without the batch dimension (e.g. ``[64]``); default: a
        converted model's own (:func:`sky_flower.pipeline.graph.sequential_fn`,
        several inputs packed), required for a model of your own.
    app_keys : tuple of str
        The app's own run-config keys, allowed besides Sky's.
    hooks : sequence of SkyHooks
        Observers of the run (:class:`sky_flower.sky.rounds.hooks.SkyHooks`).
    input_dtype : str, optional
        The model input's dtype (``"int64"`` for token ids); default: a converted
        model's own, else ``"float32"``.

    Raises
    ------
    ValueError
        On a bad run config, before any node is contacted, naming the run-config key
        (the settings' own checks, :class:`sky_flower.sky.settings.SkySettings`); from
        the memory pre-check against the fleet's memory caps.
    TypeError
        On another keyword (every setting is a run-config key: the error names it), or
        a ``model_fn`` that is a built model (:func:`_check_model_fn`).
    """
    if removed:
        keys = run_config_keys()
        moved = {"on_event": "hooks=[EventCallback(on_event)]", "loss_fn": "run config loss"}
        moved |= {"metric_fn": "run config metric"}
        where = [
            f"{k}: {moved[k]}"
            if k in moved
            else f"{k}: run config key {k.replace('_', '-')!r}"
            if k.replace("_", "-") in keys
            else f"{k}: not a sky_strategy argument"
            for k in removed
        ]
        raise TypeError(
            "sky_strategy takes (run_config, model_fn, input_shape, app_keys, hooks, "
            "input_dtype): every setting comes from the run config. Unexpected keyword(s): "
            + "; ".join(where)
        )
    from sky_flower.jobs.common import SkyRecorder
    from sky_flower.strategies.sky import SkyModel, SkyStrategy

    _check_model_fn(model_fn, "sky_strategy")
    cfg = validate_run_config(run_config, app_keys)
    settings, nodes = cfg.settings, cfg.nodes
    if input_shape is None or input_dtype is None:
        from sky_flower.pipeline.graph import model_input

        shape, dtype = model_input(model_fn())
        if input_shape is None and shape is None:
            raise ValueError(
                "sky_strategy needs input_shape (one sample's shape, e.g. [64]) for a model "
                "that is not converted by sky_flower.pipeline.graph.sequential_fn / sequential_of"
            )
        input_shape = list(shape) if input_shape is None else input_shape
        input_dtype = input_dtype or dtype or "float32"
    hooks = list(hooks)
    if settings.results_path:
        path = Path(settings.results_path)
        hooks.append(SkyRecorder(path, settings.allocation.method, settings.fleet.name))
    strategy = SkyStrategy(
        SkyModel.from_settings(model_fn, input_shape, settings, input_dtype),
        settings,
        node_order=[n.name for n in nodes],
        min_nodes=settings.messaging.min_nodes or len(nodes),  # 0: all in node-wait-s
        hooks=hooks,
    )
    strategy.precheck(
        [n.name for n in nodes],
        [None if n.memory_mb is None else n.memory_mb * 2**20 for n in nodes],
    )
    return strategy


@dataclass(frozen=True)
class HydraParts:
    """A Hydra config's model, data and objective, for :func:`register_sky_client` and
    :func:`sky_strategy` (see :func:`hydra_parts`)."""

    model_fn: Callable[[], nn.Module]  # () -> the model, from model._target_
    input_shape: list[int]  # one sample's shape
    load_data: Callable[[int, int], Split]  # (partition id, partitions) -> that partition
    test: Split  # the held-out test split (the server's)
    loss_fn: LossFn  # objective.loss
    metric_fn: MetricFn  # objective.metric


def hydra_parts(overrides: Sequence[str] = (), seed: int = 0) -> HydraParts:
    """The model, data and objective of the Hydra job's config (``conf/config.yaml``
    composed with ``overrides``, e.g. ``["model=resnet"]`` or ``["~model",
    "+model._target_=my_pkg.my_net"]``), checked as the job checks them.

    ``load_data(i, n)`` is IID partition ``i`` of ``n`` of the train split of
    ``dataset._target_`` (seeded by ``seed``), what the Hydra job's data owners load.

    Raises
    ------
    ValueError
        As :func:`sky_flower.jobs.common.model_and_data`, naming the key.
    """
    from hydra import compose, initialize_config_dir

    from sky_flower.jobs.common import conf_dir, model_and_data
    from sky_flower.pipeline.data import owner_partition

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"seed={seed}"])
    settings = SkySettings.from_hydra(cfg)
    built = model_and_data(cfg, settings, settings.schedule.transport)
    train = built["train"]

    def load_data(partition_id: int, num_partitions: int) -> Split:
        return owner_partition(train, partition_id, num_partitions, seed)

    return HydraParts(
        model_fn=built["model_fn"],
        input_shape=built["input_shape"],
        load_data=load_data,
        test=built["test"],
        loss_fn=built["loss_fn"],
        metric_fn=built["metric_fn"],
    )


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
        ``sky-memory-mb``, ``sky-latency-ms``, ``sky-bandwidth-mb-s``, ``sky-device``
        (``sky-fail-*`` for tests: :mod:`sky_flower.emulation.faults`).

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
        elif field == "device":
            spec[field] = check_device(value, f"node config {key}")
        elif field in ("fail_on", "fail_mode"):
            spec[field] = str(value)
        elif field in ("fail_round", "fail_step"):
            spec[field] = int(value)  # type: ignore[arg-type]
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
    name = str(context.run_config.get("fleet", RUN_CONFIG_KEYS["fleet"][1]))
    pid = int(context.node_config["partition-id"])
    if not name:  # no fleet file: a native node named by its partition
        return Emulation(name=f"node{pid}")
    fleet = load_fleet(name)
    if not 0 <= pid < len(fleet):
        raise ValueError(
            f"partition-id {pid} has no entry in the {len(fleet)}-node fleet "
            f"{context.run_config.get('fleet')!r}: run as many SuperNodes as the fleet has nodes"
        )
    return fleet[pid]


def owns_data(context: Context) -> bool:
    """Whether this SuperNode is a data owner (heads its own pipeline): its node
    config's ``sky-holds-data`` when set, else yes when it has Flower's
    ``partition-id`` and ``num-partitions`` (the template's data partition: under
    ``flwr run`` every SuperNode trains on its partition, as with FedAvg), else its
    emulated device's ``holds_data``."""
    cfg = context.node_config
    if "sky-holds-data" in cfg:
        return _parse_bool("sky-holds-data", cfg["sky-holds-data"])
    if "partition-id" in cfg and "num-partitions" in cfg:
        return True
    return node_emulation(context).holds_data


def run_config_arguments(
    load_data: Callable[..., Any], run_config: Mapping[str, Any]
) -> dict[str, Any]:
    """The arguments of ``load_data``'s parameters after ``(partition_id,
    num_partitions)`` that have no default, from the run config: parameter
    ``batch_size`` is key ``batch-size`` (``_`` read as ``-``), ``model_name`` is
    ``model-name`` (Flower's quickstart apps' ``load_data(partition_id, num_partitions,
    batch_size)``).

    Raises
    ------
    ValueError
        If the run config has no such key (naming the parameter and the key to add).
    """
    import inspect

    params = list(inspect.signature(load_data).parameters.values())[2:]
    out = {}
    for p in params:
        if p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        key = p.name.replace("_", "-")
        if key not in run_config:
            raise ValueError(
                f"load_data takes {p.name!r} after (partition_id, num_partitions): add "
                f"{key} to the app's [tool.flwr.app.config], or bind it "
                f"(functools.partial(load_data, {p.name}=...))"
            )
        out[p.name] = run_config[key]
    return out


def _reduction(context: Context) -> Any:  # noqa: ANN401 - a LossReduction
    """The run's loss reduction (run config ``loss-reduction``, ``loss-weight``)."""
    from sky_flower.sky.settings import ObjectiveSettings

    cfg = context.run_config
    objective = ObjectiveSettings(
        reduction=str(cfg.get("loss-reduction", "mean")), weight=str(cfg.get("loss-weight", ""))
    )
    return objective.reduction_object(run_config=True)


def register_sky_client(
    app: ClientApp,
    model_fn: Callable[[], nn.Module],
    load_data: Callable[[int, int], Any],
    loss_fn: LossFn | None = None,
    metric_fn: MetricFn | None = None,
    input_keys: str | Sequence[str] | None = None,
    label_key: str | None = None,
) -> ClientApp:
    """Add Sky's handlers to a ClientApp, beside its own.

    Parameters
    ----------
    app : ClientApp
        The app's ClientApp (its ``train`` / ``evaluate`` handlers stay).
    model_fn : callable
        ``() -> nn.Sequential``, the same model as the ServerApp's (a module of your
        own: ``lambda: sequential_of(Net(), input_shape)``).
    load_data : callable
        ``(partition_id, num_partitions) -> partition``: the app's own partition loader,
        returning a :class:`~sky_flower.pipeline.data.Split` (numpy ``x`` ``(n,
        *input_shape)``, ``y`` ``(n,)``), a map-style torch ``Dataset``, a
        ``DataLoader`` (its data set and ``collate_fn``; Sky draws the batches), a
        ``datasets.Dataset`` (a ``flwr_datasets`` partition), or a Flower app's
        ``(trainloader, testloader)`` (the first is trained on); see
        :mod:`sky_flower.pipeline.sources`. Its further parameters without a default
        are read from the run config by name (``batch_size`` from ``batch-size``,
        ``model_name`` from ``model-name``: :func:`run_config_arguments`), as the app's
        own handlers read them; Sky's schedule decides the batches whatever
        ``batch_size`` says. It is called only on data
        owners (:func:`owns_data`), with the node config's ``partition-id`` and
        ``num-partitions``, once per node; a sample of it is checked then
        (:func:`sky_flower.pipeline.sources.check_source`).
    loss_fn, metric_fn : callable, optional
        The last stage's ``(output, labels) -> scalar`` loss and ``(output, labels) ->
        int`` metric (default: those the ServerApp's strategy names; cross-entropy and
        correct predictions), see :class:`sky_flower.sky.node.client.SkyClient`.
    input_keys, label_key : optional
        Dict batches (``batch["img"]``, ``batch["input_ids"]``): the model's inputs in
        its ``forward``'s order and the labels' key (defaults: the one of ``label`` /
        ``labels``, and the one other key), see
        :class:`sky_flower.pipeline.sources.DatasetSource`.

    Returns
    -------
    ClientApp
        ``app``.

    Raises
    ------
    ValueError
        On a data owner, from the first message that reads its data: a partition of
        another kind, batches without the named keys, non-finite values in the sample
        checked (:func:`sky_flower.pipeline.sources.check_source`), labels the loss
        cannot take, or a loss that does not reduce as run config ``loss-reduction``
        declares (:func:`sky_flower.pipeline.sources.check_labels`).
    TypeError
        At once, on a ``model_fn`` that is a built model (``Net()``) or no callable.
    """
    from sky_flower.pipeline.objective import resolve
    from sky_flower.pipeline.sources import ModelInputs, as_source, check_labels, check_source
    from sky_flower.sky.node.client import SkyClient

    _check_model_fn(model_fn, "register_sky_client")
    cached: dict[tuple[int, int], Any] = {}

    def owner_data(context: Context) -> Any:  # noqa: ANN401 - a data source
        if not owns_data(context):
            return None
        key = (
            int(context.node_config.get("partition-id", 0)),
            int(context.node_config.get("num-partitions", 1)),
        )
        if key not in cached:
            data = load_data(*key, **run_config_arguments(load_data, context.run_config))
            model = model_fn()  # once: its input shapes and dtypes, its parameters' dtype
            source = as_source(data, input_keys, label_key, ModelInputs.of(model))
            what = f"partition {key[0]} of {key[1]}"
            probe = check_source(source, what, model=model)
            loss = str(context.run_config.get("loss", RUN_CONFIG_KEYS["loss"][1]))
            check_labels(probe, model, loss_fn or resolve(loss), what, _reduction(context))
            cached[key] = source
        return cached[key]

    client = SkyClient(
        model_fn=model_fn,
        load_data=owner_data,
        emulation_fn=node_emulation,
        loss_fn=loss_fn,
        metric_fn=metric_fn,
    )
    return client.register(app)
