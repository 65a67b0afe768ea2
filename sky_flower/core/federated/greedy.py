"""The joint ``heuristic``: helper *chains*, a greedy start and local search.

A chain is a group of helpers with the owners it serves one after another; chains are
node-disjoint, so they run at once. A chain's time is the sum of its owners' pipeline
times over its helpers (:func:`~sky_flower.core.partition.partition` ``heuristic`` cuts;
a pipeline that cannot fit counts ``inf``), the round's time the largest chain time.
States are compared by their chain times sorted from the largest (lexicographic), so
the search also shortens the second-longest chain when the longest cannot improve.

A per-pipeline partition costs milliseconds (tens for a 75-layer model over many
nodes), so the greedy phase ranks choices by an *estimate* and the partitioner is called
only to verify: owner ``k`` over nodes ``U`` takes about ``e_k x steps_k x (M + |U| - 1)
/ sum_{n in U} r_n`` seconds (a balanced pipeline of ``|U|`` stages and ``M``
micro-batches; ``steps_k x M / max_{n in U} r_n`` for one micro-batch at a time),
``r_n = 1 / sum_j (fwd + bwd)_nj`` (whole-model micro-batches per second), with ``e_k``
(transfers, uneven cuts, memory) the ratio of actual to estimated time at owner ``k``'s
last partitioned pipeline.

1. Every owner starts alone (its own chain, no helpers).
2. Feasibility, owners with most samples first: an owner that cannot hold the model
   takes free helpers (fastest first) until its pipeline fits; with none left it joins
   the chain (helpers merged) that makes the shortest chain, or, when no single chain
   suffices, every chain with helpers is merged into one.
3. Speed (on estimates): the free helpers, fastest first, each join the longest
   chain whose estimate they shorten (else stay idle). Then every chain is partitioned.
4. Local search on the longest chain until nothing improves, or it has partitioned
   :data:`NEW_SOLVES` pipelines it had not seen (a deterministic cap that keeps the
   64-node case under a second; :data:`HEURISTIC_BUDGET_S` after planning began is
   only a safety net on a starved machine): moves that give it an
   idle helper or another chain's helper, swap one of its helpers with a faster idle
   one or with another chain's, trade one of its owners with another chain's, move
   one of its owners to another chain (with or
   without its helpers), alone, or to a new chain of every idle helper, are ranked by
   estimate and the best :data:`VERIFY_PER_ROUND` checked by partitioning; the best
   of those that improve is taken.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator

import numpy as np

from sky_flower.core.federated.instance import Instance, Solution

HEURISTIC_BUDGET_S = 5.0  # safety net: local search stops this long after planning began
NEW_SOLVES = 12  # local search stops after this many new per-pipeline partitions
VERIFY_PER_ROUND = 12  # moves partitioned per local-search round, best estimates first

State = list[tuple[tuple[int, ...], frozenset[int]]]  # chains: (owners, helpers)


class _Search:
    """The chain state, its estimates and its moves (see the module docstring)."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.state: State = [((k,), frozenset()) for k in range(inst.K)]
        rates = []
        for n in [*inst.owners, *inst.helpers]:
            total = float(np.sum(n.layer_fwd_s) + np.sum(n.layer_bwd_s))
            rates.append(1.0 / max(total, 1e-300))
        self.owner_rate, self.helper_rate = rates[: inst.K], rates[inst.K :]
        self.eff = [1.0] * inst.K

    # --- times --------------------------------------------------------------------------
    def ideal(self, k: int, helpers: frozenset[int]) -> float:
        rates = [self.owner_rate[k], *(self.helper_rate[h] for h in helpers)]
        M, sched = self.inst.schedule.microbatches, self.inst.schedule
        if sched.kind == "sequential" or M == 1:  # one micro-batch at a time
            return self.inst.steps[k] * M / max(rates)
        return self.inst.steps[k] * (M + len(rates) - 1) / sum(rates)

    def actual(self, k: int, helpers: frozenset[int]) -> float:
        t = self.inst.time(k, helpers, "heuristic")
        if math.isfinite(t) and t > 0:
            self.eff[k] = t / self.ideal(k, helpers)
        return t

    def estimate(self, k: int, helpers: frozenset[int]) -> float:
        return self.eff[k] * self.ideal(k, helpers)

    def chain_time(self, chain: tuple[tuple[int, ...], frozenset[int]], exact: bool) -> float:
        owners, helpers = chain
        f = self.actual if exact else self.estimate
        return sum(f(k, helpers) for k in owners)

    def key(self, state: State, exact: bool = True) -> tuple[float, ...]:
        return tuple(sorted((self.chain_time(c, exact) for c in state), reverse=True))

    def free(self, state: State) -> list[int]:
        """Helpers in no chain, fastest first."""
        used = set().union(*(h for _, h in state))
        free = [h for h in range(self.inst.H) if h not in used]
        return sorted(free, key=lambda h: (-self.helper_rate[h], h))

    # --- phases 2 and 3 -----------------------------------------------------------------
    def make_feasible(self, order: list[int]) -> None:
        for k in order:
            ci = next(i for i, (o, _) in enumerate(self.state) if k in o)
            owners, helpers = self.state[ci]
            for h in self.free(self.state):
                if math.isfinite(self.actual(k, helpers)):
                    break
                helpers = helpers | {h}
            self.state[ci] = (owners, helpers)
            if math.isfinite(self.actual(k, helpers)):
                continue
            joins = [
                (self.chain_time((o + owners, h | helpers), True), j)
                for j, (o, h) in enumerate(self.state)
                if j != ci and h
            ]
            joins = [(t, j) for t, j in joins if math.isfinite(t)]
            if joins:  # join the chain that makes the shortest chain
                group = [ci, min(joins)[1]]
            else:  # no single chain suffices: merge every chain with helpers
                group = [j for j, (_, h) in enumerate(self.state) if j == ci or h]
            merged = (
                tuple(o for j in group for o in self.state[j][0]),
                frozenset().union(*(self.state[j][1] for j in group)),
            )
            self.state = [c for j, c in enumerate(self.state) if j not in group] + [merged]

    def add_free(self) -> None:
        est = [self.chain_time(c, False) for c in self.state]
        for h in self.free(self.state):
            for i in sorted(range(len(est)), key=lambda j: -est[j]):
                owners, helpers = self.state[i]
                t = self.chain_time((owners, helpers | {h}), False)
                if t < est[i]:
                    self.state[i], est[i] = (owners, helpers | {h}), t
                    break

    # --- phase 4 ------------------------------------------------------------------------
    def moves(self, i: int) -> Iterator[State]:
        """States one move away on chain ``i``."""
        state = self.state
        owners, helpers = state[i]

        def change(**chains: tuple) -> State:
            new = [chains.get(f"c{j}", c) for j, c in enumerate(state)]
            extra = chains.get("alone")
            return [c for c in new if c[0]] + ([extra] if extra else [])

        for h in self.free(state):
            yield change(**{f"c{i}": (owners, helpers | {h})})
            for g in helpers:
                if self.helper_rate[h] > self.helper_rate[g]:
                    yield change(**{f"c{i}": (owners, helpers - {g} | {h})})
        for j, (o2, h2) in enumerate(state):
            if j == i:
                continue
            for h in h2:
                yield change(**{f"c{i}": (owners, helpers | {h}), f"c{j}": (o2, h2 - {h})})
                for g in helpers:
                    mine, theirs = helpers - {g} | {h}, h2 - {h} | {g}
                    yield change(**{f"c{i}": (owners, mine), f"c{j}": (o2, theirs)})
            for k, k2 in itertools.product(owners, o2):  # two owners trade chains
                mine = tuple(k2 if o == k else o for o in owners)
                theirs = tuple(k if o == k2 else o for o in o2)
                yield change(**{f"c{i}": (mine, helpers), f"c{j}": (theirs, h2)})
            for k in owners:  # an owner joins chain j (its chain's helpers stay or follow)
                rest = tuple(o for o in owners if o != k)
                yield change(**{f"c{i}": (rest, helpers), f"c{j}": ((*o2, k), h2)})
                if not rest:
                    yield change(**{f"c{i}": (rest, helpers), f"c{j}": ((*o2, k), h2 | helpers)})
        free = frozenset(self.free(state))
        for k in owners if len(owners) > 1 else ():  # an owner leaves: alone, or with the
            rest = tuple(o for o in owners if o != k)  # idle helpers
            yield change(**{f"c{i}": (rest, helpers)}, alone=((k,), frozenset()))
            if free:
                yield change(**{f"c{i}": (rest, helpers)}, alone=((k,), free))

    def improve(self, deadline: float) -> None:
        current = self.key(self.state)
        cap = self.inst.solves + NEW_SOLVES

        def stop() -> bool:
            return time.perf_counter() > deadline or self.inst.solves >= cap

        while not stop():
            times = [self.chain_time(c, True) for c in self.state]
            i = max(range(len(times)), key=lambda j: times[j])
            ranked = sorted(self.moves(i), key=lambda s: self.key(s, exact=False))
            best, best_key = None, current
            for state in ranked[:VERIFY_PER_ROUND]:
                key = self.key(state)
                if key < best_key:
                    best, best_key = state, key
                if stop():
                    break
            if best is None:
                return
            self.state, current = best, best_key

    def solution(self) -> Solution:
        """Chains in order, each chain's owners most samples first."""
        inst = self.inst
        return [
            (k, helpers)
            for owners, helpers in self.state
            for k in sorted(owners, key=lambda k: (-inst.samples[k], k))
        ]


def chain_search(inst: Instance, order: list[int], deadline: float) -> Solution:
    """The heuristic's chains (module docstring) as a solution; ``order``: owners, most
    samples first; local search stops at ``deadline`` (a :func:`time.perf_counter`
    value)."""
    search = _Search(inst)
    search.make_feasible(order)
    search.add_free()
    search.improve(deadline)
    return search.solution()
