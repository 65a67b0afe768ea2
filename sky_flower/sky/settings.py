"""One source of the Sky strategy's settings: frozen dataclasses whose defaults are the
only defaults.

A setting's place in the tree is its name everywhere: the attribute path
(``settings.stream.timeout_s``) is the Hydra path (``stream.timeout_s=60``,
``conf/config.yaml``; ``allocation`` and ``fleet`` are also Hydra config groups, read at
``allocation.method`` and ``fleet.name``). Its run-config key (``flwr run
--run-config``, ``[tool.flwr.app.config]``) follows one rule: the field's name with ``_``
as ``-``, after its group's prefix in :data:`KEY_PREFIXES` (``stream.timeout_s`` ->
``stream-timeout-s``, ``train.local_epochs`` -> ``local-epochs``). A field declares its
key only where the published key differs from the rule:

- ``num_rounds``: ``num-server-rounds`` (Flower's own key);
- ``allocation.method``: ``allocation``; ``allocation.time_limit_s``: ``milp-time-limit-s``;
  ``fleet.name``: ``fleet``;
- ``schedule.kind``: ``schedule-kind``; ``schedule.chunks``: ``schedule-chunks``;
- ``benchmark.warmup``, ``benchmark.repeats``: ``benchmark-warmup``, ``benchmark-repeats``;
- ``deadlines.first_contact_s``, ``benchmark_s``, ``setup_s``, ``collect_s``:
  ``first-contact-timeout-s``, ``benchmark-timeout-s``, ``setup-timeout-s``,
  ``collect-timeout-s``; ``deadlines.stage_multiple``: ``stage-timeout-multiple``;
- ``objective.reduction``, ``objective.weight``: ``loss-reduction``, ``loss-weight``;
- ``replan.mode``: ``replan``;

and ``key=None`` for a Hydra-only setting (``benchmark.echo_bytes``), ``hydra=False``
for a run-config-only one (``results_path``). :func:`settings_fields` lists every
setting with its path and key.

:meth:`SkySettings.from_hydra` and :meth:`SkySettings.from_run_config` read and validate
them, :meth:`SkySettings.replace` overrides values by path; ``SkyStrategy`` takes the
settings object itself (``SkyStrategy(model, settings)``). The Hydra config does not
restate the defaults: ``conf/config.yaml`` composes :func:`hydra_defaults` first (Hydra's
``sky_base``); each setting's description is its entry in its class's ``Attributes``,
which ``docs/configuration.md`` shows. A test (``tests/test_settings.py``) compares
every default here with the composed Hydra config and ``examples/sky-app/pyproject.toml``,
so adding a run-config key is a field here and a line in the app's ``pyproject.toml``.

No torch, scipy or Flower is imported here (a ClientApp imports this module on start).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sky_flower.core.schedule import MILP_TIME_LIMIT_S, SCHEDULE_KINDS, TRANSPORTS, Schedule

log = logging.getLogger("sky_flower")

ALLOCATIONS = ("even", "heuristic", "optimal")  # as sky_flower.core.partition.METHODS

# Hydra paths renamed when the Hydra path became the attribute path (CHANGELOG.md, issue
# 43): old -> new, so that an old override is refused with its new name
RENAMED_PATHS = {
    **{f"schedule.direct_{k}": f"direct.{k}" for k in ("timeout_s", "join_timeout_s", "host")},
    **{
        f"schedule.stream_{k}": f"stream.{k}"
        for k in ("host", "bind", "tls", "max_frame_mb", "timeout_s", "sessions", "session_max_s")
    },
    "train.max_failed_rounds": "failure.max_failed_rounds",
    "message_timeout_s": "failure.message_timeout_s",
    "train.divergence_factor": "failure.divergence_factor",
}


def renamed(paths: list[str]) -> str:
    """``" (a was renamed to b, ...)"`` for the old Hydra paths among ``paths``, else
    ``""``."""
    said = [f"{p} was renamed to {RENAMED_PATHS[p]}" for p in paths if p in RENAMED_PATHS]
    return f" ({', '.join(said)})" if said else ""


OPTIMIZERS = ("adam", "sgd", "sgd_momentum")
BN_POLICIES = ("average", "local")  # as sky_flower.sky.rounds.federation.BN_POLICIES
# schedules that may run several model chunks per stage (sky_flower.core.schedule)
CHUNKED_KINDS = ("interleaved", "zero_bubble", "auto")

# the ServerApp's reply polling period under `flwr run`: every poll is an HTTP call to the
# SuperLink; 2 ms polls would take the CPU from the nodes themselves (a SuperLink ran at
# 17 % CPU with 20 ms polls); hops cost about 0.05 s in simulation, seconds in deployment
FLWR_RUN_POLL_INTERVAL_S = 0.05

Rule = tuple[str, Callable[[Any], bool]]
AT_LEAST_1: Rule = (">= 1", lambda v: v >= 1)
AT_LEAST_0: Rule = (">= 0", lambda v: v >= 0)
POSITIVE: Rule = ("> 0", lambda v: v > 0)
NOT_BLANK: Rule = ("a non-empty address", lambda v: bool(v.strip()))
DIVERGENCE: Rule = ("0 (off) or >= 1", lambda v: v == 0 or 1 <= v < float("inf"))


def _shown(value: Any) -> Any:  # noqa: ANN401 - a config value
    """``value`` as an error message shows it: a string quoted (``''``, not nothing)."""
    return repr(value) if isinstance(value, str) else value


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_A = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _checked(
    name: str,
    raw: Any,  # noqa: ANN401 - a config value
    f: dataclasses.Field,
    said: str,
) -> Any:  # noqa: ANN401 - the field's type
    """``raw`` converted to ``f``'s type (int, float, str, bool, a tuple of ints) and
    checked against its choices and rule; an error names the setting ``name`` (its path
    or run-config key) after ``said`` (``"run config "`` or ``""``)."""
    if str(f.type).startswith("tuple"):
        try:
            return tuple(int(v) for v in raw)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{said}{name} must be a list of integers, got {_shown(raw)}") from err
    kind = _TYPES[str(f.type)]
    wrong = ValueError(f"{said}{name}={raw!r} must be {_A[kind]}")
    if kind is bool:  # true / false only (not 0 / 1, not "yes")
        if not isinstance(raw, bool):
            raise wrong
        return raw
    if isinstance(raw, bool) or (said and kind is str and not isinstance(raw, str)):
        raise wrong
    try:
        value = kind(raw)
    except (TypeError, ValueError) as err:
        raise wrong from err
    if kind is int and value != raw:
        raise wrong
    choices = f.metadata["choices"]
    if choices and value not in choices:
        if said:
            raise ValueError(
                f"run config {name}={value!r} is not valid: choose one of {', '.join(choices)} "
                f"(e.g. flwr run <app> --run-config \"{name}='{choices[0]}'\")"
            )
        noun = "allocation" if name == "allocation.method" else f.name
        raise ValueError(f"unknown {noun} {value!r} ({name}): choose one of {', '.join(choices)}")
    rule = f.metadata["rule"]
    if rule is not None and not rule[1](value):
        raise ValueError(f"{said}{name} must be {rule[0]}, got {_shown(value)}")
    return value


_DERIVED = "derived"  # a field's run-config key follows the rule (module docstring)


def _setting(
    default: Any,  # noqa: ANN401 - a scalar or a tuple of ints
    rule: Rule | None = None,
    choices: tuple[str, ...] | None = None,
    *,
    key: str | None = _DERIVED,
    hydra: bool = True,
    run_default: Any = None,  # noqa: ANN401 - as default
) -> Any:  # noqa: ANN401 - a dataclasses.field
    """A settings field: its default, check, run-config ``key`` where it is not the
    rule's (``None``: Hydra only) and whether Hydra sets it. Its description is an entry
    of its class's ``Attributes`` (docs/configuration.md shows it)."""
    meta = {"key": key, "hydra": hydra, "rule": rule, "choices": choices}
    if run_default is not None:  # the run config's default differs (documented there)
        meta["run_default"] = run_default
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class AllocationSettings:
    """How the layers are cut: the ``allocation`` group (``allocation=optimal``) sets
    ``method``.

    Attributes
    ----------
    method : str
        even | heuristic | optimal
    time_limit_s : float
        allocation=optimal: the MILP's (HiGHS) time limit; past it: the better of its
        incumbent and the heuristic's plan
    """

    method: str = _setting("heuristic", choices=ALLOCATIONS, key="allocation")
    time_limit_s: float = _setting(MILP_TIME_LIMIT_S, POSITIVE, key="milp-time-limit-s")


@dataclass(frozen=True)
class FleetSettings:
    """The packaged fleet (``conf/fleet/``) by name: the ``fleet`` group (``fleet=edge3``)
    sets it and its nodes; ``""`` under ``flwr run``: no fleet file (a real federation).

    Attributes
    ----------
    name : str
        conf/fleet: node i of the fleet is SuperNode i in simulation (run config "": no
        fleet file, a real federation: native nodes)
    """

    name: str = _setting("edge4", key="fleet")


@dataclass(frozen=True)
class TrainSettings:
    """What every stage trains with.

    Attributes
    ----------
    optimizer : str
        every stage's optimizer
    lr : float
        learning rate (every stage)
    local_epochs : float
        passes over the data owner's data per round
    steps_per_round : int
        > 0 overrides local_epochs
    bn_policy : str
        BatchNorm across data owners: average (FedAvg, every entry) | local (FedBN: each
        owner keeps its BatchNorm parameters and statistics; docs/models.md)
    optimizer_state : str
        round: a fresh optimizer every round | keep: each pipeline's optimizer state kept
        across rounds (moved with its layers, sky_flower.sky.migration)
    """

    optimizer: str = _setting("adam", choices=OPTIMIZERS)
    lr: float = _setting(0.0001, POSITIVE)
    local_epochs: float = _setting(1.0, POSITIVE)
    steps_per_round: int = _setting(0, (">= 0 (0: use local-epochs)", AT_LEAST_0[1]))
    bn_policy: str = _setting("average", choices=BN_POLICIES)
    optimizer_state: str = _setting("round", choices=("round", "keep"))


# the schedule's defaults are those of the pure core's Schedule (sky_flower.core.schedule),
# written there once
_SCHEDULE = Schedule()


@dataclass(frozen=True)
class ScheduleSettings:
    """One training step: batch, micro-batches, pipeline schedule and transport.

    Attributes
    ----------
    batch_size : int
        samples per training step (per data owner)
    microbatches : int
        micro-batches per step (divides batch_size; Hydra: the transport group's)
    kind : str
        sequential (relay, stream) | gpipe | 1f1b | interleaved, zero_bubble, auto (direct
        only; auto: the planner predicts each and runs the fastest)
    transport : str
        relay | direct | stream (Hydra: the transport group); run config: auto (stream when
        fleet="", else relay)
    microbatches_per_message : int
        gpipe/1f1b on relay: micro-batches per Flower message (a divisor of microbatches);
        0: the cost model picks it
    chunks : int
        direct interleaved / zero_bubble (and auto's candidates): model chunks per stage,
        chunk c on stage c mod S (>= S x chunks layers)
    """

    batch_size: int = _setting(_SCHEDULE.batch_size, AT_LEAST_1)
    microbatches: int = _setting(_SCHEDULE.microbatches, AT_LEAST_1)
    kind: str = _setting(_SCHEDULE.kind, choices=SCHEDULE_KINDS, key="schedule-kind")
    transport: str = _setting(_SCHEDULE.transport, choices=TRANSPORTS, run_default="auto")
    microbatches_per_message: int = _setting(_SCHEDULE.microbatches_per_message, AT_LEAST_0)
    chunks: int = _setting(_SCHEDULE.chunks, AT_LEAST_1, key="schedule-chunks")


@dataclass(frozen=True)
class DirectSettings:
    """``transport=direct``: the round's process group.

    Attributes
    ----------
    timeout_s : float
        bound on every peer operation; a stage that fails or stalls mid-round ends the round
        within about this time
    join_timeout_s : float
        bound on all stages joining a round (their messages may start seconds apart)
    host : str
        address of the round's TCPStore (the server), reachable from every stage node
    """

    timeout_s: float = _setting(30.0, POSITIVE)
    join_timeout_s: float = _setting(60.0, POSITIVE)
    host: str = _setting("127.0.0.1", NOT_BLANK)


@dataclass(frozen=True)
class StreamSettings:
    """``transport=stream``: the round's endpoint on the ServerApp
    (:mod:`sky_flower.sky.transport.stream`).

    Attributes
    ----------
    host : str
        the address the stage nodes dial for the round's endpoint (the server as the nodes
        reach it)
    bind : str
        the interface the endpoint listens on (0.0.0.0: all)
    tls : bool
        TLS, a fresh certificate pinned through the set-up message (false only for an
        insecure run)
    max_frame_mb : float
        frame size cap (MiB), both ways
    timeout_s : float
        a stage silent this long while it owes a reply (or not connected this long after its
        set-up) fails the round, by name
    sessions : bool
        stream, direct: stage sessions (sky_flower.sky.transport.session) live across
        rounds: one Flower message per stage node per plan, every round driven over the
        stream (direct: its control stream, which these stream.* settings configure; the
        process group kept); false: a set-up message every round
    session_max_s : float
        a session older than this hands over to a fresh one at a round's start (below
        Flower's 12 h message TTL, flwr.app.DEFAULT_TTL)
    """

    host: str = _setting("127.0.0.1", NOT_BLANK)
    bind: str = _setting("127.0.0.1", NOT_BLANK)
    tls: bool = _setting(True)
    max_frame_mb: float = _setting(256.0, POSITIVE)
    timeout_s: float = _setting(30.0, POSITIVE)
    sessions: bool = _setting(True)
    session_max_s: float = _setting(36000.0, POSITIVE)


@dataclass(frozen=True)
class BenchmarkSettings:
    """The benchmark round: layer timing, link echoes, the state probe (flwr run: 7, 7, 64).

    Attributes
    ----------
    warmup : int
        untimed passes per layer
    repeats : int
        timed passes per layer (median)
    echo_bytes : tuple of int
        two payload sizes (bytes) for latency and bandwidth
    echo_repeats : int
        echoes per payload size (median; link timing)
    echo_jitter_s : float
        random pause before each echo: samples every phase of the nodes' polling tick (0.1 s
        in Flower's simulation engine)
    state_probe_mb : float
        probe stored in context.state to time its per-message cost (0 = skip)
    """

    warmup: int = _setting(2, AT_LEAST_0, key="benchmark-warmup")
    repeats: int = _setting(3, AT_LEAST_1, key="benchmark-repeats", run_default=7)
    echo_bytes: tuple[int, ...] = _setting((1024, 4194304), key=None)
    echo_repeats: int = _setting(3, AT_LEAST_1, run_default=7)
    echo_jitter_s: float = _setting(0.1, AT_LEAST_0)
    state_probe_mb: float = _setting(16.0, AT_LEAST_0, run_default=64.0)


@dataclass(frozen=True)
class FailurePolicy:
    """When a node fails a round, and how many failed rounds end the run.

    Attributes
    ----------
    max_failed_rounds : int
        a failed round is recorded, the nodes whose own fault it was (silence,
        error/malformed reply, crash) are dropped and the model re-planned (never the data
        owner); non-finite output is a divergence (nobody dropped, train.lr named) or one
        suspect helper set aside for a round (sky_flower/sky/rounds/blame.py); the next
        round starts from the last good model; this many failures in a row end the run (1:
        the first does)
    message_timeout_s : float
        a node silent for longer fails the round, by name: the floor of every deadline (none
        is shorter)
    divergence_factor : float
        0 = off; >= 1: a round whose training loss exceeds this x the best so far fails like
        a non-finite round (sky_flower.sky.transport.guard.RoundGuard)
    """

    max_failed_rounds: int = _setting(2, AT_LEAST_1)
    message_timeout_s: float = _setting(120.0, POSITIVE)
    divergence_factor: float = _setting(0.0, DIVERGENCE)


@dataclass(frozen=True)
class DeadlineSettings:
    """Per-phase message deadlines (s; :mod:`sky_flower.sky.transport.deadlines`): none is below
    ``failure.message_timeout_s``; a stage message's is ``failure.message_timeout_s +
    stage_multiple x`` its predicted time.

    Attributes
    ----------
    first_contact_s : float
        a node's first message, its start-up included
    benchmark_s : float
        each benchmark message (profile, echo)
    setup_s : float
        each round's set-up message (the stage's weights)
    stage_multiple : float
        a stage message: failure.message_timeout_s + this x its predicted time (direct: x
        the round's predicted steps)
    collect_s : float
        each round's collect message (the stage's weights back)
    busy_wait_s : float
        a node still running a message that timed out or was abandoned: wait this long for
        it before failing the node (none is pushed to a node with one in flight)
    """

    first_contact_s: float = _setting(300.0, POSITIVE, key="first-contact-timeout-s")
    benchmark_s: float = _setting(120.0, POSITIVE, key="benchmark-timeout-s")
    setup_s: float = _setting(60.0, POSITIVE, key="setup-timeout-s")
    stage_multiple: float = _setting(5.0, AT_LEAST_0, key="stage-timeout-multiple")
    collect_s: float = _setting(60.0, POSITIVE, key="collect-timeout-s")
    busy_wait_s: float = _setting(30.0, AT_LEAST_0)


@dataclass(frozen=True)
class MessagingSettings:
    """How the ServerApp waits: reply polling period and the wait for nodes.

    Attributes
    ----------
    poll_interval_s : float
        the ServerApp's reply polling period (under flwr run every poll is a call to the
        SuperLink)
    node_wait_s : float
        wait this long for the fleet's nodes before the benchmark round, then plan with
        those there (the simulation runtime: 5 s, its SuperNodes never join late)
    min_nodes : int
        flwr run: SuperNodes to wait for (0: the fleet's size; with fleet="" (a real
        federation, no fleet file): all that connect within node_wait_s)
    """

    poll_interval_s: float = _setting(0.002, POSITIVE, run_default=FLWR_RUN_POLL_INTERVAL_S)
    node_wait_s: float = _setting(300.0, POSITIVE)
    min_nodes: int = _setting(0, AT_LEAST_0)


UNIT_INTERVAL: Rule = ("in (0, 1]", lambda v: 0 < v <= 1)
FRACTION: Rule = ("in [0, 1)", lambda v: 0 <= v < 1)


@dataclass(frozen=True)
class ReplanSettings:
    """Online re-planning (:mod:`sky_flower.sky.planning.replan`). ``mode`` off by default:
    the plan stays fixed unless a run asks for it; see docs/replanning.md.

    Attributes
    ----------
    mode : str
        off | on | force (force: tests, other cuts every round); on/force also admit nodes
        that join mid-run (profiled, then planned with)
    threshold : float
        re-plan when the new plan's expected step (migration included) beats the measured
        step by more than this
    smoothing : float
        weight of the newest round in the profiles' smoothing
    """

    mode: str = _setting("off", choices=("off", "on", "force"), key="replan")
    threshold: float = _setting(0.1, FRACTION)
    smoothing: float = _setting(0.5, UNIT_INTERVAL)


REFERENCE: Rule = ('"module:qualname"', lambda v: v.count(":") == 1 and all(v.split(":")))
REFERENCE_OR_BLANK: Rule = ('"module:qualname" or ""', lambda v: v == "" or REFERENCE[1](v))
REDUCTIONS = ("mean", "sum", "weighted")  # as sky_flower.pipeline.objective.REDUCTIONS


@dataclass(frozen=True)
class ObjectiveSettings:
    """The last stage's loss and metric, by reference (``"module:qualname"``, imported on
    every node; :mod:`sky_flower.pipeline.objective`), and how the loss reduces over a
    micro-batch (``reduction``: ``mean``, ``sum``, or ``weighted`` by ``weight(labels)``,
    e.g. tokens not ignored; :class:`sky_flower.pipeline.objective.LossReduction`): split
    training scales each micro-batch's loss by it so that it equals unsplit training.
    Hydra: the ``task`` group.

    Attributes
    ----------
    loss : str
        the last stage's loss, "module:qualname"
    metric : str
        its metric (reported as accuracy)
    reduction : str
        how the loss reduces over a micro-batch: mean | sum | weighted (exact for any loss,
        docs/models.md)
    weight : str
        weighted only: "module:qualname" of labels -> the count the loss averages over (e.g.
        sky_flower.pipeline.lm:token_count)
    """

    loss: str = _setting("torch.nn.functional:cross_entropy", REFERENCE)
    metric: str = _setting("sky_flower.pipeline.objective:correct_count", REFERENCE)
    reduction: str = _setting("mean", choices=REDUCTIONS, key="loss-reduction")
    weight: str = _setting("", REFERENCE_OR_BLANK, key="loss-weight")

    def functions(self, run_config: bool = False) -> tuple[Callable, Callable]:
        """``(loss_fn, metric_fn)`` imported (the reduction checked too,
        :meth:`reduction_object`).

        Raises
        ------
        ValueError
            Naming the key (``objective.loss`` or run config ``loss``, ...) if a
            reference cannot be imported or is not callable, or the reduction and the
            weight do not go together.
        """
        from sky_flower.pipeline.objective import resolve

        out = []
        for name in ("loss", "metric"):
            out.append(self._imported(name, resolve, run_config))
        self.reduction_object(run_config)
        return out[0], out[1]

    def reduction_object(self, run_config: bool = False) -> Any:  # noqa: ANN401
        """The :class:`sky_flower.pipeline.objective.LossReduction` of ``reduction`` and
        ``weight``.

        Raises
        ------
        ValueError
            Naming the keys if the weight cannot be imported, or ``weighted`` lacks it
            (another reduction has one).
        """
        from sky_flower.pipeline.objective import LossReduction, resolve

        fn = self._imported("weight", resolve, run_config) if self.weight else None
        try:
            return LossReduction(self.reduction, fn)
        except ValueError as err:
            keys = ("loss-reduction", "loss-weight") if run_config else None
            named = f" (run config keys {', '.join(keys)})" if keys else ""
            raise ValueError(f"{err}{named}") from err

    def _imported(self, name: str, resolve: Callable, run_config: bool) -> Callable:
        s = _SETTINGS[f"objective.{name}"]
        key = s.key if run_config else s.path
        try:
            return resolve(getattr(self, name))
        except ValueError as err:
            raise ValueError(f"{'run config ' if run_config else ''}{key}: {err}") from err


# run-config key prefixes of the groups whose keys carry their group's name
# (``stream.timeout_s`` -> ``stream-timeout-s``); the other groups' keys are the bare name
KEY_PREFIXES = {"direct": "direct-", "stream": "stream-", "replan": "replan-"}


@dataclass(frozen=True)
class SkySettings:
    """Every setting of a Sky run (see the module docstring): the groups' (their classes
    describe them) and these.

    Attributes
    ----------
    num_rounds : int
        training rounds (2: ~0.94 test accuracy on the default fleet)
    seed : int
        random seed: the initial model, the data partition, the batches' order
    results_path : str
        the file a flwr run writes results.json to ("" = none; the launcher sets it; the
        Hydra job writes its own)
    """

    num_rounds: int = _setting(2, AT_LEAST_1, key="num-server-rounds")
    allocation: AllocationSettings = field(default_factory=AllocationSettings)
    fleet: FleetSettings = field(default_factory=FleetSettings)
    seed: int = _setting(0)
    results_path: str = _setting("", hydra=False)
    train: TrainSettings = field(default_factory=TrainSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    direct: DirectSettings = field(default_factory=DirectSettings)
    stream: StreamSettings = field(default_factory=StreamSettings)
    benchmark: BenchmarkSettings = field(default_factory=BenchmarkSettings)
    failure: FailurePolicy = field(default_factory=FailurePolicy)
    deadlines: DeadlineSettings = field(default_factory=DeadlineSettings)
    messaging: MessagingSettings = field(default_factory=MessagingSettings)
    objective: ObjectiveSettings = field(default_factory=ObjectiveSettings)
    replan: ReplanSettings = field(default_factory=ReplanSettings)

    # where these settings were read from: their errors name each setting as that
    # caller does (``hydra``: the Hydra path; ``run_config``: the run-config key)
    words: str = field(default="hydra", compare=False, repr=False, metadata={"internal": True})

    @classmethod
    def from_hydra(cls, cfg: Any) -> SkySettings:  # noqa: ANN401 - an omegaconf DictConfig
        """The settings of a composed Hydra config (``conf/config.yaml``).

        A path the config does not have takes the default here. A ``stream.*`` or
        ``direct.*`` value the transport does not read is named in a warning
        (:meth:`unread`).

        Raises
        ------
        ValueError
            On a value of the wrong type or outside its rule, naming its path
            (e.g. ``train.lr must be > 0, got -1.0``), an unknown allocation,
            transport, schedule kind or optimizer (lists the choices), or settings that
            do not go together (:meth:`check_combinations`).
        """
        from omegaconf import OmegaConf

        def read(path: str, default: Any) -> Any:  # noqa: ANN401
            value = OmegaConf.select(cfg, path, default=default)
            return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

        settings = cls._build(_hydra_path, read)
        settings.check_combinations()
        for line in settings.unread():  # named once, at the start of a run
            log.warning(line)
        return settings

    @classmethod
    def from_run_config(
        cls, run_config: Mapping[str, Any], app_keys: tuple[str, ...] = ()
    ) -> SkySettings:
        """The settings of a Flower app's ``context.run_config``.

        Parameters
        ----------
        run_config : mapping
            ``[tool.flwr.app.config]`` plus ``--run-config``; keys not set take the
            defaults here.
        app_keys : tuple of str
            Keys the app itself uses besides Sky's (allowed, not checked).

        Raises
        ------
        ValueError
            On an unknown key close to a Sky key (a typo: names the close key), a value
            of the wrong type, an unknown choice (lists the valid ones), a value outside
            its rule (names the rule), or settings that do not go together
            (:meth:`check_combinations`), every one named by its run-config key.

        Notes
        -----
        A key that is neither Sky's nor in ``app_keys`` nor close to a Sky key is the
        app's own (Flower refuses a key the app does not declare): it is named in a
        warning, not refused, so a Flower app's keys (``fraction-train``,
        ``model-path``) stay as written.
        ``transport='auto'`` (the run config's default) is resolved here by
        :func:`auto_transport`: ``stream`` for a real federation, ``relay`` on a fleet.
        A ``stream-*`` or ``direct-*`` value the transport does not read is named in a
        warning (:meth:`unread`).
        """
        keys = run_config_keys()
        unknown = sorted(set(run_config) - set(keys) - set(app_keys))
        close = {k: _close_key(k, keys) for k in unknown}
        if typos := {k: c for k, c in close.items() if c}:
            raise ValueError(
                "run config "
                + ", ".join(
                    f"key {k!r} is no Sky key: did you mean {c!r}?" for k, c in typos.items()
                )
                + " (rename it in the app's [tool.flwr.app.config]; if it is the app's own "
                "key, name it in sky_strategy(..., app_keys=(...)))"
            )
        if unknown:  # Flower let them through: the app declares them, for itself
            log.warning(
                "run config key(s) %s are not Sky's: Sky does not read them (FedAvg's "
                "fraction-train, say, has no effect), the app may; name the app's own in "
                "sky_strategy(..., app_keys=(...)) to silence this",
                ", ".join(unknown),
            )

        if run_config.get("transport", "auto") == "auto":  # the run config's default
            run_config = {**run_config, "transport": auto_transport(run_config)}

        settings = cls._build(lambda s: s.key, run_config.get, said="run config ")
        settings = dataclasses.replace(settings, words="run_config")
        settings.check_combinations()
        settings.objective.functions(run_config=True)  # importable, or refused by key
        for line in settings.unread():  # named once, at the start of a run
            log.warning(line)
        return settings

    def replace(self, overrides: Mapping[str, Any]) -> SkySettings:
        """These settings with the values at the Hydra paths of ``overrides`` replaced
        (e.g. ``{"train.lr": 0.01, "schedule.transport": "stream"}``), checked as
        :meth:`from_hydra` checks them; the others keep their values.

        Raises
        ------
        ValueError
            On an unknown path (lists the valid ones), or a value the path's rule or
            choices refuse, or settings that do not go together (named as the settings
            were named before: Hydra paths or run-config keys).
        """
        paths = [s.path for s in settings_fields() if s.hydra]
        unknown = sorted(set(overrides) - set(paths))
        if unknown:
            raise ValueError(
                f"unknown setting(s) {unknown}{renamed(unknown)}: "
                f"valid Hydra paths are {', '.join(paths)}"
            )
        settings = self._build(_hydra_path, overrides.get, base=self)
        settings = dataclasses.replace(settings, words=self.words)
        settings.check_combinations()
        return settings

    def name(self, path: str) -> str:
        """The setting at Hydra path ``path`` in its caller's words: the run-config key
        for settings read from a run config (where the setting has one), else the
        Hydra path. Errors built here name settings through it."""
        s = _SETTINGS.get(path)
        if self.words == "run_config" and s is not None and s.key:
            return s.key
        return path

    @classmethod
    def _build(
        cls,
        name_of: Callable[[Setting], str | None],
        read: Callable[[str, Any], Any],
        said: str = "",
        base: SkySettings | None = None,
    ) -> SkySettings:
        """Read every setting as ``read(name, default)`` (``name_of``: its path or key,
        ``None``: not settable there; the default is ``base``'s value, else the field's;
        ``said``: ``"run config "`` for a run config's keys and defaults)."""
        groups: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
        top: dict[str, Any] = {}
        for s in settings_fields():
            if base is not None:
                value = s.value(base)
            else:
                value = s.field.metadata.get("run_default", s.default) if said else s.default
            name = name_of(s)
            if name is not None:
                value = _checked(name, read(name, value), s.field, said)
            group, _, leaf = s.path.rpartition(".")
            (groups[group] if group else top)[leaf] = value
        return cls(**top, **{group: GROUPS[group](**v) for group, v in groups.items()})

    def check_combinations(self) -> None:
        """Refuse settings that are each valid but do not go together, naming them in
        the caller's words (:meth:`name`).

        Raises
        ------
        ValueError
            ``schedule.kind=sequential`` with ``transport=direct`` (torch has no such
            schedule), or ``interleaved``, ``zero_bubble``, ``auto`` on another
            transport; micro-batches that do not divide the batch;
            ``microbatches_per_message`` that does not divide ``microbatches``;
            ``train.optimizer_state=keep`` with a schedule that may run several chunks
            per stage; ``benchmark.echo_bytes`` not two sizes ``0 < small < large``.
        """
        s, n = self.schedule, self.name
        run = self.words == "run_config"
        said = "run config " if run else ""
        example = (
            " (e.g. --run-config \"transport='direct' schedule-kind='gpipe' microbatches=4\","
            " each key declared in the app's [tool.flwr.app.config]: Flower refuses others)"
            if run
            else ""
        )
        if s.transport == "direct" and s.kind == "sequential":
            raise ValueError(
                f"{said}{n('schedule.kind')}=sequential runs on transport=relay and stream, "
                "gpipe and 1f1b on transport=direct (torch.distributed.pipelining, with "
                "interleaved, zero_bubble and auto) and on relay: got kind=sequential, "
                f"transport=direct. Set {n('schedule.kind')} to one of gpipe, 1f1b, "
                f"interleaved, zero_bubble, auto, or {n('schedule.transport')} to relay or "
                f"stream{example}"
            )
        if s.kind in CHUNKED_KINDS and s.transport != "direct":  # torch's schedules only
            raise ValueError(
                f"{said}{n('schedule.kind')}={s.kind} runs on {n('schedule.transport')}=direct"
                f" only (torch.distributed.pipelining): set {n('schedule.transport')}=direct"
            )
        if s.batch_size % s.microbatches:
            batch = n("schedule.batch_size") if run else "batch_size"
            raise ValueError(
                f"{said}{n('schedule.microbatches')}={s.microbatches} must divide "
                f"{batch}={s.batch_size}: pick a divisor (or set {n('schedule.batch_size')})"
            )
        if s.microbatches_per_message and s.microbatches % s.microbatches_per_message:
            raise ValueError(
                f"{said}{n('schedule.microbatches_per_message')}={s.microbatches_per_message}"
                f" must be 0 (the cost model picks it) or a divisor of "
                f"{n('schedule.microbatches')}={s.microbatches}"
            )
        if self.train.optimizer_state == "keep" and s.kind in CHUNKED_KINDS:
            raise ValueError(
                f"{said}{n('train.optimizer_state')}=keep moves each layer's optimizer state "
                f"with its stage, which needs one chunk per stage: {n('schedule.kind')}="
                f"{s.kind} may split a stage into chunks. Use {n('schedule.kind')}=gpipe or "
                f"1f1b with keep, or {n('train.optimizer_state')}=round"
            )
        echo = self.benchmark.echo_bytes
        if len(echo) != 2 or not 0 < echo[0] < echo[1]:
            raise ValueError(
                f"echo_bytes (benchmark.echo_bytes) must be two payload sizes in bytes, "
                f"0 < small < large, e.g. [1024, 4194304]; got {list(echo)}"
            )

    def unread(self) -> list[str]:
        """The ``stream.*`` and ``direct.*`` settings given a value other than their default
        on a transport that does not read them, each as a sentence naming the setting (in
        the caller's words, :meth:`name`) and the transport it applies to.

        ``direct.*`` apply to ``transport=direct``; ``stream.sessions`` and
        ``stream.session_max_s`` to stream and direct (stage sessions); the other
        ``stream.*`` to stream, and to direct while ``stream.sessions`` is on (the
        sessions' control stream). Not refused: a sweep sets them across transports.
        """
        transport, out = self.schedule.transport, []
        for s in settings_fields():
            group, _, leaf = s.path.partition(".")
            value = s.value(self)
            if group not in ("direct", "stream") or value == s.default:
                continue
            if group == "direct":
                reads, where = ("direct",), "transport=direct"
            else:  # direct's stage sessions run over a stream too (their control stream)
                sessions = leaf in ("sessions", "session_max_s") or self.stream.sessions
                reads = ("stream", "direct") if sessions else ("stream",)
                where = "transport=stream (and direct's stage sessions)"
            if transport not in reads:
                out.append(
                    f"{self.name(s.path)}={_shown(value)} is ignored: it applies to {where}, "
                    f"this run's {self.name('schedule.transport')} is {transport}"
                )
        return out

    def schedule_object(self) -> Schedule:
        """The :class:`sky_flower.core.cost.Schedule` (which checks its own rules).

        Raises
        ------
        ValueError
            If micro-batches do not divide the batch, or a count is out of range.
        """
        s = self.schedule
        return Schedule(
            batch_size=s.batch_size,
            microbatches=s.microbatches,
            kind=s.kind,  # type: ignore[arg-type]
            transport=s.transport,  # type: ignore[arg-type]
            microbatches_per_message=s.microbatches_per_message,
            chunks=s.chunks,
        )


def _close_key(key: str, keys: Sequence[str]) -> str:
    """The Sky run-config key that ``key`` is a likely typo of (``alocation``,
    ``batch_size``, ``num-server-round``), else ``""``: :func:`difflib.get_close_matches`
    at 0.75, over the key in lower case with ``-`` for ``_``."""
    close = difflib.get_close_matches(key.lower().replace("_", "-"), list(keys), n=1, cutoff=0.75)
    return close[0] if close else ""


# the groups, field name -> settings class: every field of SkySettings that is not a leaf
GROUPS: dict[str, Any] = {
    f.name: f.default_factory
    for f in dataclasses.fields(SkySettings)
    if f.default_factory is not dataclasses.MISSING
}


@dataclass(frozen=True)
class Setting:
    """One leaf setting: ``path``, its attribute path and Hydra path
    (``stream.timeout_s``); its run-config ``key`` (``None``: Hydra only); whether
    Hydra sets it; its dataclass ``field`` (default, rule, choices)."""

    path: str
    key: str | None
    hydra: bool
    field: dataclasses.Field

    @property
    def default(self) -> Any:  # noqa: ANN401 - the field's type
        return self.field.default

    def value(self, settings: SkySettings) -> Any:  # noqa: ANN401 - the field's type
        """This setting's value in ``settings``."""
        return functools.reduce(getattr, self.path.split("."), settings)


def _leaves(kind: type, group: str = "") -> Iterator[Setting]:
    for f in dataclasses.fields(kind):
        if f.metadata.get("internal"):
            continue
        if not group and f.name in GROUPS:
            yield from _leaves(GROUPS[f.name], f.name)
            continue
        key = f.metadata["key"]
        if key == _DERIVED:
            key = KEY_PREFIXES.get(group, "") + f.name.replace("_", "-")
        path = f"{group}.{f.name}" if group else f.name
        yield Setting(path, key, f.metadata["hydra"], f)


_SETTINGS = {s.path: s for s in _leaves(SkySettings)}


def settings_fields() -> tuple[Setting, ...]:
    """Every leaf setting, in field order."""
    return tuple(_SETTINGS.values())


def hydra_defaults() -> dict[str, Any]:
    """Every Hydra setting's default as a nested dict in field order (``{"num_rounds": 2,
    ..., "train": {"optimizer": "adam", "lr": 0.0001, ...}, ...}``; a tuple as a list):
    the ``sky_base`` config that ``conf/config.yaml`` composes first
    (:func:`sky_flower.jobs.common.conf_dir` registers it in Hydra's ConfigStore), so that
    each default is written here only. Its values are untyped for OmegaConf: a bad
    override reaches :meth:`SkySettings.from_hydra`, whose errors name the setting."""
    tree: dict[str, Any] = {}
    for s in settings_fields():
        if s.hydra:
            group, _, leaf = s.path.rpartition(".")
            node = tree.setdefault(group, {}) if group else tree
            node[leaf] = list(s.default) if isinstance(s.default, tuple) else s.default
    return tree


def _hydra_path(s: Setting) -> str | None:
    return s.path if s.hydra else None


def auto_transport(run_config: Mapping[str, Any]) -> str:
    """What ``transport='auto'`` in a run config means: ``stream`` when ``fleet`` is
    ``""`` (a real federation of SuperNodes: Flower carries only each round's set-up and
    collect, the nodes connect out to the ServerApp's TLS data plane,
    docs/transports.md), else ``relay`` (an emulated fleet in Flower's simulation
    engine, where a Flower message costs milliseconds)."""
    fleet = run_config.get("fleet", FleetSettings().name)
    return "stream" if fleet == "" else "relay"


def run_config_keys() -> dict[str, tuple[type, Any]]:
    """Run-config key -> ``(type, default)``, in field order."""
    keys: dict[str, tuple[type, Any]] = {}
    for s in settings_fields():
        if s.key is not None:
            kind = _TYPES[str(s.field.type)]
            keys[s.key] = (kind, s.field.metadata.get("run_default", s.default))
    return keys
