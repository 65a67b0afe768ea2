"""The baselines of Hermes on the asynchronous driver (:class:`AsyncStrategy` of
``strategies/asynchronous.py``): BSP, ASP, SSP.

=======  ===========================================================================
``bsp``  synchronous FedAvg: every live worker waits for the slowest, models averaged
         weighted by examples
``asp``  each update ``(g_i - base_i) / n`` applied on arrival, never waits
``ssp``  as ASP, but a worker more than ``staleness`` rounds ahead of the slowest live
         worker waits
=======  ===========================================================================
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Message
from sky_flower.strategies.asynchronous import AsyncStrategy

from sky_flower.hermes.core import apply_delta, fedavg, may_start


class BSPStrategy(AsyncStrategy):
    """Bulk-synchronous parallel: synchronous FedAvg (McMahan et al., AISTATS 2017) on the
    same fleet. Every live worker waits for the slowest; the models are averaged, weighted
    by examples. A removed worker leaves the barrier; a discarded (non-finite) update
    counts as a reply that adds nothing. See :class:`AsyncStrategy` for the parameters."""

    name = "bsp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[int, np.ndarray] = {}
        self._replied: set[int] = set()

    def start_rule(self, worker: int) -> bool:
        """The barrier: start only when no live worker is behind (staleness 0)."""
        return may_start(self.clock[worker], self.live_clocks(), 0)

    def apply(self, worker: int, reply: Message) -> bool:
        """Hold the model until every live worker has replied, then average."""
        self._pending[worker] = self.model_of(reply)
        self._replied.add(worker)
        return self._close()

    def on_reject(self, worker: int) -> bool:
        """A discarded update still completes the worker's part of the barrier round."""
        self._replied.add(worker)
        return self._close()

    def on_remove(self, worker: int) -> bool:
        """The barrier round may now be complete without the removed worker."""
        return self._close()

    def _close(self) -> bool:
        """Once every live worker has replied: FedAvg of the accepted models (the global
        model unchanged if none); True if it changed."""
        if not self.members.live <= self._replied:
            return False
        order = sorted(self._pending)
        models, weights = [self._pending[w] for w in order], [self.data[w] for w in order]
        self._pending, self._replied = {}, set()
        if not order:
            return False
        self.global_vec = fedavg(models, weights)
        return True


class ASPStrategy(AsyncStrategy):
    """Asynchronous parallel: each worker's progress ``(g_i - base_i) / n`` is applied on
    arrival (``base_i``: the global model it started from); nobody waits."""

    name = "asp"

    def apply(self, worker: int, reply: Message) -> bool:
        """Apply the delta (:func:`sky_flower.hermes.core.apply_delta`)."""
        base = self._base[worker]
        assert base is not None and self.global_vec is not None
        self.global_vec = apply_delta(self.global_vec, self.model_of(reply), base, self.n)
        return True


class SSPStrategy(ASPStrategy):
    """Stale-synchronous parallel (Ho et al., NeurIPS 2013): ASP's update on arrival, but a
    worker more than ``staleness`` rounds ahead of the slowest waits."""

    name = "ssp"

    def start_rule(self, worker: int) -> bool:
        """Bounded staleness over the live workers (:func:`sky_flower.hermes.core.may_start`)."""
        return may_start(self.clock[worker], self.live_clocks(), self.staleness)
