"""Observers of a Sky run: subclass :class:`SkyHooks`, override what you need, and pass
it to the strategy (``SkyStrategy(model, settings, hooks=[...])``); the strategy calls
every hook in order at each point of the run. A hook observes: it must not change the
records it is given. No Flower or torch import here (the results writer uses it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class SkyHooks:
    """One observer of a Sky run; every method does nothing by default.

    The points, in order: :meth:`on_start` (before anything else), :meth:`on_benchmark`
    (the benchmark round's nodes and layers), :meth:`on_plan` (every plan installed, the
    first and each re-plan), :meth:`on_evaluate` (each server-side evaluation, round 0
    being the initial model), :meth:`on_round` (every round, trained or failed),
    :meth:`on_end` (once, with the error that ended the run or ``None``).
    """

    def on_start(self, strategy: Any) -> None:  # noqa: ANN401 - a SkyStrategy
        """The run starts: ``strategy`` is the running strategy (read its ``state``)."""

    def on_benchmark(self, event: dict[str, Any]) -> None:
        """The benchmark round finished: ``benchmark.json``'s content."""

    def on_plan(self, event: dict[str, Any]) -> None:
        """A plan was installed: ``plan.json``'s content."""

    def on_evaluate(self, server_round: int, metrics: dict[str, float]) -> None:
        """The global model of ``server_round`` (0: the initial model) was evaluated."""

    def on_round(self, record: Any) -> None:  # noqa: ANN401 - a RoundRecord
        """A round ended (:class:`sky_flower.sky.rounds.records.RoundRecord`; failed ones
        have ``error``)."""

    def on_end(self, strategy: Any, error: BaseException | None) -> None:  # noqa: ANN401
        """The run ended: ``error`` is what ended it (``None``: it completed)."""


class EventCallback(SkyHooks):
    """A hook from one callable ``fn(kind, payload)``, called with ``("benchmark",
    event)``, ``("plan", event)`` and ``("round", record as a dict)``."""

    def __init__(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        self.fn = fn

    def on_benchmark(self, event: dict[str, Any]) -> None:
        """``fn("benchmark", event)``."""
        self.fn("benchmark", event)

    def on_plan(self, event: dict[str, Any]) -> None:
        """``fn("plan", event)``."""
        self.fn("plan", event)

    def on_round(self, record: Any) -> None:  # noqa: ANN401 - a RoundRecord
        """``fn("round", record.to_dict())``: the row as ``results.json`` has it."""
        self.fn("round", record.to_dict())


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

    def on_start(self, strategy: Any) -> None:  # noqa: ANN401
        """Every hook's :meth:`SkyHooks.on_start`."""
        for hook in self.hooks:
            hook.on_start(strategy)

    def on_benchmark(self, event: dict[str, Any]) -> None:
        """Every hook's :meth:`SkyHooks.on_benchmark`."""
        for hook in self.hooks:
            hook.on_benchmark(event)

    def on_plan(self, event: dict[str, Any]) -> None:
        """Every hook's :meth:`SkyHooks.on_plan`."""
        for hook in self.hooks:
            hook.on_plan(event)

    def on_evaluate(self, server_round: int, metrics: dict[str, float]) -> None:
        """Every hook's :meth:`SkyHooks.on_evaluate`."""
        for hook in self.hooks:
            hook.on_evaluate(server_round, metrics)

    def on_round(self, record: Any) -> None:  # noqa: ANN401
        """Every hook's :meth:`SkyHooks.on_round`."""
        for hook in self.hooks:
            hook.on_round(record)

    def on_end(self, strategy: Any, error: BaseException | None) -> None:  # noqa: ANN401
        """Every hook's :meth:`SkyHooks.on_end`."""
        for hook in self.hooks:
            hook.on_end(strategy, error)
