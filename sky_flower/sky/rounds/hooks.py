"""Observers of a Sky run: subclass :class:`SkyHooks`, override what you need, and pass
it to the strategy (``SkyStrategy(model, settings, hooks=[...])``); the strategy calls
every hook in order at each point of the run, with a typed event once the facts it
reports are final (never the strategy itself). A hook observes: it must not change the
records it is given. No Flower or torch import here (the results writer uses it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sky_flower.sky.rounds.records import FailedRound, JoinRecord, RoundRecord

if TYPE_CHECKING:
    from sky_flower.core.profile import LayerProfile, NodeProfile
    from sky_flower.sky.planning.planning import FederatedPlanned
    from sky_flower.sky.planning.replan import ReplanRecord


@dataclass(frozen=True)
class RunRecords:
    """What a run has recorded so far (``results.json``'s lists, as they stand when the
    event fires).

    Attributes
    ----------
    rounds : tuple of RoundRecord
        Every round, trained or failed.
    failed_rounds : tuple of FailedRound
        What recovery did after each failed round.
    replans : tuple of ReplanRecord
        Every re-plan taken.
    joins : tuple of JoinRecord
        Every node that joined or came back.
    """

    rounds: tuple[RoundRecord, ...] = ()
    failed_rounds: tuple[FailedRound, ...] = ()
    replans: tuple[ReplanRecord, ...] = ()
    joins: tuple[JoinRecord, ...] = ()


@dataclass(frozen=True)
class RunStart:
    """The run starts: ``num_rounds`` rounds of ``allocation`` over ``transport``."""

    num_rounds: int
    allocation: str
    transport: str


@dataclass(frozen=True)
class BenchmarkEnd:
    """The benchmark round finished: the model's ``layers`` as profiled, the ``nodes``
    that answered (in fleet order), and each node's ``emulation`` (its device
    emulation's name, ``""``: none)."""

    layers: tuple[LayerProfile, ...]
    nodes: tuple[NodeProfile, ...]
    emulation: Mapping[str, str]

    def to_dict(self) -> dict[str, Any]:
        """``benchmark.json``'s content: ``{"layers": [...], "nodes": [...]}``."""
        return {
            "layers": [lp.to_dict() for lp in self.layers],
            "nodes": [{**n.to_dict(), "emulation": self.emulation[n.name]} for n in self.nodes],
        }


@dataclass(frozen=True)
class PlanInstalled:
    """A plan was installed (the first, or a re-plan): ``planned``, one pipeline per
    data owner with its predictions and the other allocations' (``alternatives``)."""

    planned: FederatedPlanned

    def to_dict(self) -> dict[str, Any]:
        """``plan.json``'s content (:meth:`FederatedPlanned.to_dict`)."""
        return self.planned.to_dict()


@dataclass(frozen=True)
class RoundEnd:
    """A round ended: its ``record`` (a failed one has ``error``; a pipeline that
    diverged is already in ``diverged``) and the run's ``records`` with it."""

    record: RoundRecord
    records: RunRecords


@dataclass(frozen=True)
class RunEnd:
    """The run ended: its ``records``, and ``error``, what ended it (``None``: it
    completed)."""

    records: RunRecords
    error: BaseException | None = None


class SkyHooks:
    """One observer of a Sky run; every method does nothing by default.

    The points, in order: :meth:`on_start` (before anything else), :meth:`on_benchmark`
    (the benchmark round's nodes and layers), :meth:`on_plan` (every plan installed, the
    first and each re-plan), :meth:`on_evaluate` (each server-side evaluation, round 0
    being the initial model), :meth:`on_round` (every round, trained or failed),
    :meth:`on_end` (once, with the error that ended the run or ``None``).
    """

    def on_start(self, event: RunStart) -> None:
        """The run starts."""

    def on_benchmark(self, event: BenchmarkEnd) -> None:
        """The benchmark round finished (``event.to_dict()``: ``benchmark.json``)."""

    def on_plan(self, event: PlanInstalled) -> None:
        """A plan was installed (``event.to_dict()``: ``plan.json``)."""

    def on_evaluate(self, server_round: int, metrics: dict[str, float]) -> None:
        """The global model of ``server_round`` (0: the initial model) was evaluated."""

    def on_round(self, event: RoundEnd) -> None:
        """A round ended (``event.record``; failed ones have ``error``)."""

    def on_end(self, event: RunEnd) -> None:
        """The run ended: ``event.error`` is what ended it (``None``: it completed)."""


class EventCallback(SkyHooks):
    """A hook from one callable ``fn(kind, payload)``, called with ``("benchmark",
    event.to_dict())``, ``("plan", event.to_dict())`` and ``("round", record.to_dict())``:
    the JSON documents the Hydra job writes."""

    def __init__(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        self.fn = fn

    def on_benchmark(self, event: BenchmarkEnd) -> None:
        """``fn("benchmark", event.to_dict())``."""
        self.fn("benchmark", event.to_dict())

    def on_plan(self, event: PlanInstalled) -> None:
        """``fn("plan", event.to_dict())``."""
        self.fn("plan", event.to_dict())

    def on_round(self, event: RoundEnd) -> None:
        """``fn("round", record.to_dict())``: the row as ``results.json`` has it."""
        self.fn("round", event.record.to_dict())


class HookList(SkyHooks):
    """Several hooks called in order, as one."""

    def __init__(self, hooks: Iterable[SkyHooks] = ()) -> None:
        self.hooks: list[SkyHooks] = []
        for hook in hooks:
            self.add(hook)

    def add(self, hook: SkyHooks) -> None:
        """Call ``hook`` too, after the others.

        Raises
        ------
        TypeError
            If ``hook`` is not a :class:`SkyHooks`.
        """
        if not isinstance(hook, SkyHooks):
            raise TypeError(
                f"hooks must be SkyHooks instances (sky_flower.sky.rounds.hooks), got "
                f"{type(hook).__name__}: subclass SkyHooks, or wrap a function "
                f"fn(kind, payload) in EventCallback(fn)"
            )
        self.hooks.append(hook)


def _every(name: str) -> Callable[..., None]:
    """``HookList``'s ``name``: every hook's, in order."""

    def call(self: HookList, *args: Any) -> None:  # noqa: ANN401
        for hook in self.hooks:
            getattr(hook, name)(*args)

    call.__name__, call.__doc__ = name, f"Every hook's :meth:`SkyHooks.{name}`."
    return call


for _name in ("on_start", "on_benchmark", "on_plan", "on_evaluate", "on_round", "on_end"):
    setattr(HookList, _name, _every(_name))
