"""Emulated heterogeneity: make one host's simulated node act as a slower device.

SkyComputing's own emulation (arXiv 2202.11836, Sec. 4.1): after each compute, sleep
``slowdown x`` that compute's measured time, so the node runs ``1 + slowdown`` times
slower. A memory cap bounds the memory the node reports; a link latency and bandwidth
add ``latency + bytes / bandwidth`` of sleep per message. Everything is off unless the
fleet config sets it, and every node prints what it emulates in the benchmark table.

A fleet config lists its nodes, or gives a node count (``conf/fleet/skycomputing.yaml``):
:func:`expand_fleet` then generates SkyComputing's emulated fleet.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import psutil
import torch

from sky_flower.core.fleets import SKYCOMPUTING_SEED, skycomputing_slowdowns
from sky_flower.emulation.faults import FAIL_MODES, FaultInjected
from sky_flower.pipeline.device import check_device, resolve_device
from sky_flower.sky.protocol import MESSAGE_TYPES

MIB = 1024 * 1024
EMULATED_S = "emulated_s"  # a stage reply's metric: seconds its emulated slowdown slept

__all__ = [
    "GENERATED_FLEET_KEYS",
    "MIB",
    "check_fleet_devices",
    "compose_fleet",
    "Emulation",
    "FaultInjected",
    "NodeAbsent",
    "expand_fleet",
    "parse_fleet",
]


def _real(where: str, field: str, value: object, rule: str, or_null: bool = False) -> None:
    """Raise ``ValueError`` naming the node and field unless ``value`` is a finite real
    number obeying ``rule`` (``">= 0"`` or ``"> 0"``)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if rule == ">= 0" else value > 0)  # type: ignore[operator]
    if not ok:
        null = " or null" if or_null else ""
        raise ValueError(f"{where}: {field} must be {rule}{null} (a finite number), got {value!r}")


@dataclass(frozen=True)
class Emulation:
    """One node of a fleet config (``conf/fleet/*.yaml``).

    Attributes
    ----------
    name : str
        Node name, unique in the fleet; also its place in the pipeline order.
    holds_data : bool
        Data owner (runs stage 0 on its own batches).
    slowdown : float
        ``s >= 0``: sleep ``s x`` compute time after each compute (0 = native speed).
    memory_mb : float or None
        Memory cap in MiB (None = what psutil reports as available).
    latency_ms : float
        Added per message (round trip), milliseconds.
    bandwidth_mb_s : float or None
        Link bandwidth in MB/s (10^6 bytes/s); None = no bandwidth emulation.
    fail_on : str
        Fault injection for tests (:mod:`sky_flower.emulation.faults`): misbehave when a
        message of this type arrives (one of ``sky_flower.sky.protocol.MESSAGE_TYPES``,
        e.g. ``"train.sky_forward"``; another is refused); empty = never.
    fail_mode : {"raise", "malformed", "nan", "late", "crash", "stall"}
        How (:mod:`sky_flower.emulation.faults`): raise (Flower turns it into an error
        reply), reply with arrays of the wrong shape, with NaN values, ``fail_delay_s``
        late, or (``direct`` transport, ``fail_on: train.sky_direct``) mid-round
        before step ``fail_step``: ``crash`` drops out of the round's process group at
        once (its sockets close, as when the process is killed) and raises; ``stall``
        stops communicating for 1.5 x the round's ``direct.timeout_s``, then
        raises.
    fail_round : int
        Only misbehave in this round (0 = every round), so a test can check that the
        next round runs.
    fail_step : int
        Step of the round before which ``crash`` / ``stall`` strike (direct); on a
        message about one step (relay forward / backward), the step it hits.
    fail_delay_s : float
        ``late``: seconds slept before the reply; ``stall``: seconds stalled (0: the
        direct stall's 1.5 x ``timeout_s``).
    slowdown_schedule : dict of int to float
        Drift: from round ``r`` on (each key a round >= 1) the node's slowdown is the
        value of the largest key ``<= r`` (``{3: 4.0}``: ``slowdown`` until round 2,
        4.0 from round 3). Empty: ``slowdown`` throughout. The benchmark round is round 0.
    leave_round : int
        Drift: from this round on the node has left (every message fails with
        :class:`NodeAbsent`); 0 = never.
    join_round : int
        Drift: the node is absent before this round (the benchmark round included, so
        the first plan leaves it out); 0 = present from the start.
    device : str
        Where the node's stages compute (real, not emulated): ``auto`` (CUDA when
        available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``
        (:mod:`sky_flower.pipeline.device`). Checked for syntax here; a CUDA device
        this machine lacks is refused when it is resolved (:meth:`torch_device`).
    """

    name: str
    holds_data: bool = False
    slowdown: float = 0.0
    memory_mb: float | None = None
    latency_ms: float = 0.0
    bandwidth_mb_s: float | None = None
    fail_on: str = ""
    fail_mode: str = "raise"
    fail_round: int = 0
    fail_step: int = 0
    fail_delay_s: float = 0.0
    slowdown_schedule: Mapping[int, float] = field(default_factory=dict)
    leave_round: int = 0
    join_round: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        where = f"node {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"fleet node name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "device", check_device(self.device, f"{where}: device"))
        if not isinstance(self.holds_data, bool):
            raise ValueError(f"{where}: holds_data must be true or false, got {self.holds_data!r}")
        if self.fail_mode not in FAIL_MODES:
            raise ValueError(
                f"{where}: fail_mode must be one of {', '.join(FAIL_MODES)}, got {self.fail_mode!r}"
            )
        _real(where, "slowdown", self.slowdown, ">= 0")
        _real(where, "latency_ms", self.latency_ms, ">= 0")
        _real(where, "fail_delay_s", self.fail_delay_s, ">= 0")
        if self.memory_mb is not None:
            _real(where, "memory_mb", self.memory_mb, "> 0")
        if self.bandwidth_mb_s is not None:
            _real(where, "bandwidth_mb_s", self.bandwidth_mb_s, "> 0", or_null=True)
        if not isinstance(self.fail_on, str):
            raise ValueError(f"{where}: fail_on must be a string, got {self.fail_on!r}")
        if self.fail_on and self.fail_on not in MESSAGE_TYPES:  # a typo injects nothing
            raise ValueError(
                f"{where}: fail_on must be '' or a Sky message type "
                f"({', '.join(MESSAGE_TYPES)}), got {self.fail_on!r}: a fault on a message "
                "that never comes is never injected"
            )
        for f in ("fail_round", "fail_step", "leave_round", "join_round"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: {f} must be an integer >= 0, got {v!r}")
        object.__setattr__(self, "slowdown_schedule", _schedule(where, self.slowdown_schedule))
        if self.leave_round and self.join_round and self.leave_round <= self.join_round:
            raise ValueError(
                f"{where}: leave_round ({self.leave_round}) must come after join_round "
                f"({self.join_round})"
            )
        if self.holds_data and self.join_round:
            raise ValueError(
                f"{where}: a data owner cannot have join_round ({self.join_round}): a data "
                f"owner absent from the benchmark round is never given a pipeline (only "
                f"helpers join mid-run), so its data would never train. Drop join_round, "
                f"or make the node a helper"
            )
        if self.fail_mode == "stall" and self.fail_on != "train.sky_direct":
            if self.fail_delay_s <= 0:
                raise ValueError(
                    f"{where}: fail_mode stall on {self.fail_on or 'every message'} needs "
                    f"fail_delay_s > 0 (how long the node stays silent; set it past "
                    f"failure.message_timeout_s to stall past the deadline): a relay node does not "
                    f"know its deadline (on train.sky_direct the default is 1.5 x the "
                    f"round's timeout)"
                )

    @classmethod
    def from_mapping(cls, spec: Mapping) -> Emulation:
        """Build from a fleet-config entry.

        Raises
        ------
        ValueError
            On a missing name or an unknown key (lists the valid keys).
        """
        known = {f.name for f in fields(cls)}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(
                f"unknown fleet node key(s) {sorted(unknown)} in {dict(spec)}: valid keys are "
                f"{sorted(known)}"
            )
        if "name" not in spec:
            raise ValueError(f"fleet node {dict(spec)} has no name")
        return cls(**dict(spec))

    def to_dict(self) -> dict:
        """Plain dict (for config records and JSON)."""
        d = asdict(self)
        d["slowdown_schedule"] = dict(self.slowdown_schedule)
        return d

    # --- drift -----------------------------------------------------------------------
    @property
    def drifts(self) -> bool:
        """Whether the node's emulation changes during the run."""
        return bool(self.slowdown_schedule or self.leave_round or self.join_round)

    def present(self, server_round: int) -> bool:
        """Whether the node takes part in round ``server_round`` (0: the benchmark)."""
        if self.join_round and server_round < self.join_round:
            return False
        return not (self.leave_round and server_round >= self.leave_round)

    def at_round(self, server_round: int) -> Emulation:
        """This node as it is in round ``server_round`` (0: the benchmark round): its
        slowdown from :attr:`slowdown_schedule`.

        Raises
        ------
        NodeAbsent
            If the node has not joined yet or has left (:meth:`present`).
        """
        if not self.present(server_round):
            raise NodeAbsent(
                f"node {self.name!r} is not in the federation in round {server_round} "
                f"(fleet join_round={self.join_round}, leave_round={self.leave_round})"
            )
        due = [r for r in self.slowdown_schedule if r <= server_round]
        if not due:
            return self
        return replace(self, slowdown=float(self.slowdown_schedule[max(due)]))

    # --- effects ---------------------------------------------------------------------
    def after_compute(self, elapsed_s: float) -> float:
        """Sleep ``slowdown x elapsed_s`` (SkyComputing's emulation); return the seconds
        slept (what the emulated device's compute took longer)."""
        if self.slowdown > 0 and elapsed_s > 0:
            time.sleep(self.slowdown * elapsed_s)
            return self.slowdown * elapsed_s
        return 0.0

    def link_delay_s(self, nbytes: float) -> float:
        """Seconds a message of ``nbytes`` (both directions together) takes on the link."""
        delay = self.latency_ms / 1000.0
        if self.bandwidth_mb_s:
            delay += nbytes / (self.bandwidth_mb_s * 1e6)
        return delay

    def torch_device(self) -> torch.device:
        """The node's device on this machine (:func:`sky_flower.pipeline.device.
        resolve_device`).

        Raises
        ------
        ValueError
            Naming the node, if it asks for CUDA (or a GPU index) this machine lacks.
        """
        return resolve_device(self.device, f"node {self.name!r}: device")

    def memory_bytes(self, available: int | None = None) -> int:
        """Memory available for training: ``available`` bytes (the device's free memory;
        default psutil's available memory), capped by ``memory_mb``."""
        available = int(psutil.virtual_memory().available) if available is None else available
        if self.memory_mb is None:
            return available
        return min(available, int(self.memory_mb * MIB))

    def describe(self) -> str:
        """One-line summary for the benchmark table."""
        parts = [f"slowdown x{1 + self.slowdown:g}" if self.slowdown else "native speed"]
        if self.memory_mb is not None:
            parts.append(f"mem cap {self.memory_mb:g} MiB")
        if self.latency_ms:
            parts.append(f"+{self.latency_ms:g} ms")
        if self.bandwidth_mb_s:
            parts.append(f"{self.bandwidth_mb_s:g} MB/s")
        return ", ".join(parts)


def message_round(msg: Any) -> int:  # noqa: ANN401 - a flwr Message
    """The server round a Sky message belongs to: its group id (``str(round)``, set by
    :func:`sky_flower.sky.transport.runner.message`); 0 for the benchmark's ``benchmark`` /
    ``echo`` groups."""
    group = str(getattr(msg.metadata, "group_id", "") or "")
    return int(group) if group.isdigit() else 0


class NodeAbsent(RuntimeError):  # noqa: N818 - a state, as FaultInjected
    """A drifting node's message in a round it is not part of (fleet ``join_round`` /
    ``leave_round``): Flower turns it into an error reply, so the node fails the round."""


def _schedule(where: str, raw: object) -> dict[int, float]:
    """``slowdown_schedule`` checked: round (int >= 1) -> slowdown (>= 0); YAML keys
    may arrive as strings.

    Raises
    ------
    ValueError
        Naming the node, on another type, a round < 1 or a bad slowdown.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{where}: slowdown_schedule must map rounds to slowdowns, e.g. {{3: 4.0}}, got {raw!r}"
        )
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            rnd = int(key)
        except (TypeError, ValueError):
            rnd = -1
        if isinstance(key, bool) or rnd < 1 or str(rnd) != str(key).strip():
            raise ValueError(f"{where}: slowdown_schedule round {key!r} must be an integer >= 1")
        _real(where, f"slowdown_schedule[{rnd}]", value, ">= 0")
        out[rnd] = float(value)  # type: ignore[arg-type]
    return out


def parse_fleet(nodes: list[Mapping]) -> list[Emulation]:
    """Validate a fleet's node list.

    Raises
    ------
    ValueError
        If empty, names repeat, or no node holds data.
    """
    fleet = [Emulation.from_mapping(n) for n in nodes]
    if not fleet:
        raise ValueError("the fleet has no nodes: list at least one under fleet.nodes")
    names = [n.name for n in fleet]
    if len(set(names)) != len(names):
        raise ValueError(f"fleet node names must be unique, got {names}")
    if not any(n.holds_data for n in fleet):
        raise ValueError("no node in the fleet holds data: set holds_data: true on one node")
    return fleet


def check_fleet_devices(fleet: Sequence[Emulation]) -> dict[str, str]:
    """Resolve every node's ``device`` on this machine (the nodes of an emulated fleet
    run here), before Flower starts. Returns node name -> ``"cpu"`` / ``"cuda:N"``.

    Raises
    ------
    ValueError
        Naming the node, if one asks for CUDA (or a GPU index) this machine lacks.
    """
    return {n.name: str(n.torch_device()) for n in fleet}


GENERATED_FLEET_KEYS = (
    "name",
    "nodes",
    "seed",
    "flops_per_s",
    "memory_mb",
    "latency_ms",
    "bandwidth_mb_s",
    "device",
)


def expand_fleet(fleet_cfg: Mapping) -> list[Emulation]:
    """Nodes of a fleet config, listed or generated.

    ``nodes`` is either a list of node entries (checked by :func:`parse_fleet`) or an
    integer ``N``: SkyComputing's emulated fleet (``conf/fleet/skycomputing.yaml``),
    ``node0 .. node{N-1}`` with the slowdowns of
    :func:`sky_flower.core.fleets.skycomputing_slowdowns` (``seed``, default 35), ``node0``
    the data owner, and the fleet's ``memory_mb``, ``latency_ms``, ``bandwidth_mb_s`` and
    ``device`` on every node. ``flops_per_s`` is for the planner only (the training job
    measures real compute) and is ignored here. An integer ``nodes`` makes ``fleet.nodes=4,8,16``
    a Hydra sweep.

    Parameters
    ----------
    fleet_cfg : mapping
        The ``fleet`` config group as a plain dict.

    Returns
    -------
    list of Emulation
        In pipeline order (the data owner first for a generated fleet).

    Raises
    ------
    ValueError
        On a missing ``nodes``, a non-positive count, an unknown key next to an integer
        ``nodes``, or whatever :func:`parse_fleet` / :class:`Emulation` refuse.
    """
    if "nodes" not in fleet_cfg:
        raise ValueError(
            "the fleet config has no nodes: set fleet.nodes to a list of nodes or a count"
        )
    nodes = fleet_cfg["nodes"]
    if isinstance(nodes, bool) or not isinstance(nodes, int):
        if isinstance(nodes, Sequence) and not isinstance(nodes, str):
            return parse_fleet(list(nodes))
        raise ValueError(f"fleet.nodes must be a list of nodes or a node count, got {nodes!r}")
    if nodes < 1:
        raise ValueError(f"fleet.nodes must be >= 1, got {nodes}")
    unknown = set(fleet_cfg) - set(GENERATED_FLEET_KEYS)
    if unknown:
        raise ValueError(
            f"unknown key(s) {sorted(unknown)} in a fleet with a node count: valid keys are "
            f"{list(GENERATED_FLEET_KEYS)}"
        )
    seed = fleet_cfg.get("seed", SKYCOMPUTING_SEED)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"fleet.seed must be an integer, got {seed!r}")
    slowdowns = skycomputing_slowdowns(nodes, seed)
    return parse_fleet(
        [
            {
                "name": f"node{i}",
                "holds_data": i == 0,
                "slowdown": float(s),
                "memory_mb": fleet_cfg.get("memory_mb"),
                "latency_ms": float(fleet_cfg.get("latency_ms") or 0.0),
                "bandwidth_mb_s": fleet_cfg.get("bandwidth_mb_s"),
                "device": fleet_cfg.get("device", "auto"),
            }
            for i, s in enumerate(slowdowns)
        ]
    )


def compose_fleet(name: str, read: Callable[[str], str]) -> dict:
    """A fleet config as Hydra composes it: ``read(name)`` gives the YAML text of
    ``conf/fleet/<name>.yaml``; a ``defaults`` list (other fleet files, ``_self_``) is
    merged in order, as ``fleet=<name>`` does in the training job.

    Raises
    ------
    ValueError
        On a ``defaults`` entry that is not a fleet name or ``_self_``, a cycle, or a
        file that is not valid YAML (one line: the fleet, its file, line and column).
    """
    import yaml
    from omegaconf import OmegaConf

    def load(n: str, seen: tuple[str, ...]) -> Any:
        if n in seen:
            raise ValueError(f"fleet {n!r}: defaults form a cycle {' -> '.join((*seen, n))}")
        text = read(n)
        try:
            yaml.safe_load(text)  # OmegaConf's own error has no file, line or column
        except yaml.YAMLError as err:
            from sky_flower.jobs.config_files import describe_yaml_error

            raise ValueError(describe_yaml_error(err, f"fleet {n!r} (fleet/{n}.yaml)")) from None
        cfg = OmegaConf.create(text)
        defaults = cfg.pop("defaults", None) if "defaults" in cfg else None
        if defaults is None:
            return cfg
        parts = []
        for entry in defaults:
            if entry == "_self_":
                parts.append(cfg)
            elif isinstance(entry, str):
                parts.append(load(entry, (*seen, n)))
            else:
                raise ValueError(f"fleet {n!r}: defaults entry {entry!r} is not a fleet name")
        if all(p is not cfg for p in parts):
            parts.append(cfg)
        return OmegaConf.merge(*parts)

    return OmegaConf.to_container(load(name, ()), resolve=True)  # type: ignore[return-value]
