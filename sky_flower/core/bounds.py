"""Lower bounds on any plan's step time and period (pure, no Flower).

Every plan reports how far it may be from the optimum against these bounds:

* period (seconds per micro-batch): total work over total speed, and the slowest
  layer on its fastest node;
* step: one micro-batch's critical path, tightened by an LP relaxation of the
  memory-constrained assignment (HiGHS via :func:`scipy.optimize.linprog`: contiguity,
  order and transfers dropped), plus ``M - 1`` periods for pipelined schedules and the
  relay's unavoidable per-step overhead.

:class:`LowerBounds` is a mixin of :class:`sky_flower.core.cost.CostModel`: it reads the
cost model's arrays (``fwd``, ``bwd``, ``memory_static``, ``stash``, ``capacity``, ...).
"""

from __future__ import annotations

import numpy as np


class LowerBounds:
    """Lower bounds of a :class:`~sky_flower.core.cost.CostModel` (mixed into it)."""

    _lp_bound: float | None

    def period_lower_bound(self) -> float:
        """Lower bound on :meth:`period` of any plan (seconds per micro-batch).

        In time ``T`` node ``i`` does at most ``T max_j (w_j / c_ij)`` units of work
        ``w`` (``c_ij = fwd + bwd`` of layer j on node i; ``w_j`` = the mean over nodes),
        so ``T >= sum_j w_j / sum_i max_j (w_j / c_ij)`` (total work over total speed,
        exact for nodes that differ by a speed factor); and ``T >= max_j min_i c_ij``.
        """
        c = self.fwd + self.bwd
        w = c.mean(axis=0)
        pos = w > 0
        if not pos.any():
            return 0.0
        rate = (w[pos][None, :] / np.maximum(c[:, pos], 1e-300)).max(axis=1)
        return float(max(w.sum() / rate.sum(), c.min(axis=0).max()))

    def step_lower_bound(self) -> float:
        """Lower bound on :meth:`step_time` of any plan (seconds).

        One micro-batch must pass every layer: ``C1 = sum_j min_i c_ij`` (no faster node,
        no transfer), or better :meth:`memory_lp_bound` (the fastest nodes can only hold
        so much); the busiest resource works ``M x`` the period bound ``P``.
        ``sequential``: ``M C1``; ``gpipe``: ``C1 + (M - 1) P`` (its two terms bound the
        closed form's two terms); ``1f1b``: ``max(C1, M P)``. On ``relay`` add the
        per-step overhead no plan avoids: one message's latency and every layer's state
        shipped once, at the cheapest node's rates.
        """
        c = self.fwd + self.bwd
        c1 = max(float(c.min(axis=0).sum()), self.memory_lp_bound())
        M = self.schedule.microbatches
        P = self.period_lower_bound()
        relay = 0.0
        if self.relay:  # at least one message, and every layer's state ships once
            relay = float(self.latency.min() + self.state_rate.min() * self.state_bytes.sum())
        if self.schedule.kind == "sequential":
            return M * c1 + relay
        if self.schedule.kind == "gpipe":
            return c1 + (M - 1) * P + relay
        return max(c1, M * P) + relay

    def memory_lp_bound(self, max_variables: int = 200_000) -> float:
        """Least ``sum_k (f_k + b_k)`` of one micro-batch when every node holds only what
        fits its memory: the LP ``min sum_ij c_ij x_ij`` s.t. ``sum_i x_ij = 1``,
        ``sum_j m_j x_ij <= capacity_i``, ``0 <= x <= 1`` (HiGHS via
        :func:`scipy.optimize.linprog`), a relaxation of every plan (contiguity, order
        and transfers dropped; ``m_j`` with the fewest micro-batches any stage keeps).
        0 when the LP has more than ``max_variables`` variables or fails (seconds)."""
        if self._lp_bound is not None:
            return self._lp_bound
        N, L = self.num_nodes, self.num_layers
        value = 0.0
        if N * L <= max_variables:
            from scipy.optimize import linprog
            from scipy.sparse import csr_matrix, eye, kron

            fewest = 1 if (not self.relay and self.schedule.kind != "gpipe") else None
            mem = (
                self.memory_static
                + (self.schedule.microbatches if fewest is None else fewest)
                * self.schedule.microbatch_size
                * self.stash
            )
            c = (self.fwd + self.bwd).ravel()  # x[i, j] at i * L + j
            a_eq = kron(csr_matrix(np.ones((1, N))), eye(L), format="csr")
            a_ub = kron(eye(N), csr_matrix(mem[None, :]), format="csr")
            cap = np.minimum(self.capacity, mem.sum() + 1.0)
            res = linprog(
                c,
                A_ub=a_ub,
                b_ub=cap,
                A_eq=a_eq,
                b_eq=np.ones(L),
                bounds=(0.0, 1.0),
                method="highs",
            )
            if res.status == 0:
                value = float(res.fun) * (1 - 1e-9)
        self._lp_bound = value
        return value

    def lower_bound(self, objective: str = "step") -> float:
        """:meth:`step_lower_bound` or :meth:`period_lower_bound`."""
        if objective == "throughput":
            return self.period_lower_bound()
        return self.step_lower_bound()
