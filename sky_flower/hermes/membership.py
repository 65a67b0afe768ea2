"""Who takes part in an asynchronous run (Hermes, BSP, ASP, SSP), and the driver's wait
for replies or late messages (:func:`wait_any`, on the run's
:class:`sky_flower.flower.exchange.Exchange`).

Each run starts with every worker *live*. A worker leaves the member set when it fails
(an error reply, a malformed reply) or stays silent past its message's deadline
(``message_timeout_s`` from the push); the driver then stops waiting for it (BSP's
barrier closes over the live workers only) and never sends it another round. What
happens to the reply of a removed worker that still comes in is the *staleness policy*:

``discard`` (default)
    it is dropped: nothing a removed worker sends reaches the global model;
``keep``
    it is applied by the strategy's rule like any other reply (a stale update: ASP/SSP
    apply its delta against the global model it started from, Hermes merges it by its
    loss, BSP counts it in the barrier round in progress), if it arrives before the run
    ends; the worker stays removed.

The run goes on while at least ``min_live_workers`` workers are live (default: all of
them, so one removal fails the run, naming the worker: what ``message_timeout_s`` has
always promised). A non-finite reply does not remove a worker at once: the update is
*rejected* (discarded, the worker named), and the worker gets the global model with its
next round; a worker whose last :data:`MAX_REJECTED_IN_A_ROW` updates were all rejected
(it keeps diverging from the global model it is sent) is removed like a failed one. Both
kinds of event are kept as rows for ``results.json``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import WARN
from typing import Any

from flwr.app import Message
from flwr.supercore import log

from sky_flower.flower.exchange import Exchange

STALENESS_POLICIES = ("discard", "keep")
#: A worker whose updates were rejected this many times in a row (non-finite each time,
#: though it starts every round from the finite global model) is removed from the run.
MAX_REJECTED_IN_A_ROW = 3


@dataclass
class Membership:
    """The live workers of an asynchronous run and what happened to the others.

    Attributes
    ----------
    n : int
        Workers at the start (positions ``0 .. n - 1``).
    min_live : int
        The run fails when fewer workers are live.
    staleness_policy : str
        ``discard`` or ``keep`` (module docstring).
    live : set[int]
        Positions of the live workers.
    removals : list[dict]
        One row per removed worker: ``worker`` (position), ``name`` (``"worker <i> (node
        <id>)"``), ``round`` (its round in progress), ``reason``, ``time_s`` (server clock).
    rejected : list[dict]
        One row per discarded non-finite update, the same keys (``round``: the round that
        produced it).
    """

    n: int
    min_live: int
    staleness_policy: str = "discard"
    live: set[int] = field(default_factory=set)
    removals: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    streak: dict[int, int] = field(default_factory=dict)  # worker -> rejections in a row

    @classmethod
    def create(
        cls, num_workers: int, min_live_workers: int | None, staleness_policy: str
    ) -> Membership:
        """Every worker live.

        Parameters
        ----------
        num_workers : int
            Workers at the start.
        min_live_workers : int or None
            Fewest live workers the run goes on with; ``None``: all of them.
        staleness_policy : {"discard", "keep"}
            What to do with a removed worker's late reply.

        Raises
        ------
        ValueError
            ``min_live_workers`` outside ``[1, num_workers]``, or an unknown policy.
        """
        m = num_workers if min_live_workers is None else min_live_workers
        if isinstance(m, bool) or int(m) != m or not 1 <= m <= num_workers:
            raise ValueError(
                f"min_live_workers must be an integer in [1, {num_workers}] (the workers), "
                f"got {min_live_workers}"
            )
        if staleness_policy not in STALENESS_POLICIES:
            raise ValueError(
                f"staleness_policy must be one of {', '.join(STALENESS_POLICIES)}, "
                f"got {staleness_policy!r}"
            )
        return cls(int(num_workers), int(m), staleness_policy, set(range(num_workers)))

    def remove(self, worker: int, name: str, rnd: int, reason: str, time_s: float) -> bool:
        """Remove live ``worker`` (``name``: how the log names it) in its round ``rnd``
        for ``reason`` at ``time_s`` (server clock): a warning and a row in
        :attr:`removals`. False, and nothing recorded, if it was not live."""
        if worker not in self.live:
            return False
        self.live.discard(worker)
        self.removals.append(_row(worker, name, rnd, reason, time_s))
        log(
            WARN,
            "removing %s from the run in its round %d: %s (%d of %d workers live, minimum %d)",
            name,
            rnd,
            reason,
            len(self.live),
            self.n,
            self.min_live,
        )
        return True

    def reject(self, worker: int, name: str, rnd: int, reason: str, time_s: float) -> bool:
        """Record that ``worker``'s update of its round ``rnd`` was discarded for
        ``reason``: a warning and a row in :attr:`rejected`. True when this makes
        :data:`MAX_REJECTED_IN_A_ROW` rejections in a row (the caller removes it)."""
        self.rejected.append(_row(worker, name, rnd, reason, time_s))
        log(WARN, "%s: update of its round %d discarded: %s", name, rnd, reason)
        self.streak[worker] = self.streak.get(worker, 0) + 1
        return self.streak[worker] >= MAX_REJECTED_IN_A_ROW

    def accepted(self, worker: int) -> None:
        """``worker``'s update was applied: its run of rejections ends."""
        self.streak.pop(worker, None)

    def failure(self, reason: str) -> str | None:
        """The run's error after a removal for ``reason`` if fewer than ``min_live`` workers
        are live, else None."""
        if len(self.live) >= self.min_live:
            return None
        return (
            f"{reason} ({len(self.live)} of {self.n} workers live, fewer than "
            f"min_live_workers={self.min_live})"
        )

    def summary(self) -> str:
        """``"<k> workers removed, <m> updates discarded"`` (non-finite updates)."""
        return f"{len(self.removals)} workers removed, {len(self.rejected)} updates discarded"

    def keeps(self, worker: int) -> bool:
        """Whether a reply of ``worker`` is still taken: live, or removed under ``keep``."""
        return worker in self.live or self.staleness_policy == "keep"


def wait_any(
    exchange: Exchange, stale: dict[str, int], until: float
) -> tuple[list[Message], list[str]]:
    """Poll ``exchange`` (and the ``stale`` message ids: removed workers' rounds still
    wanted under ``keep``) until a reply arrives, a pending message passes its deadline,
    or ``time.monotonic()`` passes ``until``.

    Returns
    -------
    (replies, late)
        The replies (error replies included), and the ids of the messages past their
        deadline, which ``exchange`` then no longer holds as pending (so
        :meth:`Exchange.poll` does not wait for them).
    """
    while exchange.pending or stale:
        got = exchange.poll(raise_late=False)
        if stale:
            got += list(exchange.grid.pull_messages(set(stale)))
        late = exchange.late()
        for mid in late:
            exchange.deadline.pop(mid, None)  # the exchange's own pending set
        if got or late or time.monotonic() >= until:
            return got, late
        if exchange.poll_interval_s > 0:
            time.sleep(exchange.poll_interval_s)
    return [], []


def _row(worker: int, name: str, rnd: int, reason: str, time_s: float) -> dict[str, Any]:
    return {"worker": worker, "name": name, "round": rnd, "reason": reason, "time_s": time_s}
