"""The decentralized algorithms of the gossip core, on the ``(n, d)`` stack of node
models (notation: :mod:`sky_flower.gossip.matrices`). Pure numpy (no Flower).

Algorithms (each a :class:`DecentralizedAlgorithm` on ``(n, d)`` arrays; one ``step``
takes the nodes' stochastic gradients ``G`` at ``X``):

======  ==============================================================================
dpsgd   D-PSGD (Lian et al., NeurIPS 2017, Algorithm 1): ``X <- W X - alpha G``
d2      D2 (Tang et al., ICML 2018, Algorithm 1): ``X_{t+1} = W (2 X_t - X_{t-1} -
        alpha (G_t - G_{t-1}))``; needs ``lambda_min(W) > -1/3``
dsgt    DSGT, gradient tracking (Pu and Nedic, Math. Prog. 2021):
        ``Y_t = W Y_{t-1} + G_t - G_{t-1}``, ``X_{t+1} = W (X_t - alpha Y_t)``
detag   DeTAG (Lu and De Sa 2021/2023, Algorithm 2 with accelerated gossip, Algorithm 3):
        ``X_{k+1} = AG_R(X_k) - alpha AG_R(Y_k)``, ``Y_{k+1} = AG_R(Y_k) + G_k - G_{k-1}``,
        ``G_k`` accumulated over the ``R`` mini-batches of phase ``k``
        (``variant="atc"``: tracker updated before gossip, not in the paper)
======  ==============================================================================
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from sky_flower.gossip.matrices import (
    GossipMatrix,
    accelerated_gossip,
    acceleration_eta,
    consensus_distance,
)


class DecentralizedAlgorithm:
    """One decentralized optimiser on the ``(n, d)`` stack of node models.

    Use: ``alg.reset(x0)``; then repeatedly compute each node's stochastic gradient at
    its row of ``alg.x`` (averaged over ``alg.batches_per_step`` mini-batches) and call
    ``alg.step(G)``. One step costs ``alg.rounds_per_step`` gossip rounds.

    Parameters
    ----------
    gossip : GossipMatrix
        The network.
    lr : float
        Step size ``alpha`` (> 0).

    Raises
    ------
    ValueError
        ``lr <= 0``.
    """

    name: ClassVar[str] = ""
    rounds_per_step: int = 1
    batches_per_step: int = 1

    def __init__(self, gossip: GossipMatrix, lr: float) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.gossip, self.lr = gossip, float(lr)
        self.W = gossip.W
        self._x: np.ndarray | None = None
        self.steps = 0

    def reset(self, x0: np.ndarray) -> None:
        """Start every node at ``x0``: a ``(d,)`` vector (same start everywhere) or an
        ``(n, d)`` stack."""
        x0 = np.asarray(x0, dtype=float)
        if x0.ndim == 1:
            x0 = np.tile(x0, (self.gossip.n, 1))
        if x0.ndim != 2 or x0.shape[0] != self.gossip.n:
            raise ValueError(f"x0 must be (d,) or ({self.gossip.n}, d), got {x0.shape}")
        self._x, self.steps = x0.copy(), 0

    @property
    def x(self) -> np.ndarray:
        """Current node models ``(n, d)``: where the next gradients are taken."""
        if self._x is None:
            raise RuntimeError("call reset(x0) first")
        return self._x

    @property
    def average(self) -> np.ndarray:
        """The averaged model ``xbar``, ``(d,)``."""
        return self.x.mean(axis=0)

    def consensus_distance(self) -> float:
        """See :func:`sky_flower.gossip.matrices.consensus_distance`."""
        return consensus_distance(self.x)

    def step(self, grads: np.ndarray) -> None:
        """One update from the ``(n, d)`` gradients at :attr:`x`."""
        grads = np.asarray(grads, dtype=float)
        if grads.shape != self.x.shape:
            raise ValueError(f"gradients have shape {grads.shape}, expected {self.x.shape}")
        self._x = self._update(grads)
        self.steps += 1

    def _update(self, grads: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class DPSGD(DecentralizedAlgorithm):
    """D-PSGD (Lian et al., "Can Decentralized Algorithms Outperform Centralized
    Algorithms?", NeurIPS 2017, Algorithm 1): ``x_i <- sum_j W_ij x_j - alpha g_i(x_i)``.

    With a constant step it reaches only a neighbourhood of the optimum whose size grows
    with ``alpha`` and with how much the nodes' data differ."""

    name = "dpsgd"

    def _update(self, grads: np.ndarray) -> np.ndarray:
        return self.W @ self.x - self.lr * grads


class D2(DecentralizedAlgorithm):
    """D2 (Tang, Lian, Yan, Zhang, Liu, "D^2: Decentralized Training over Decentralized
    Data", ICML 2018, Algorithm 1): ``X_1 = W (X_0 - alpha G_0)``, then
    ``X_{t+1} = W (2 X_t - X_{t-1} - alpha G_t + alpha G_{t-1})``.

    Removes the data-heterogeneity bias of D-PSGD; converges only if
    ``lambda_min(W) > -1/3`` (Tang et al.'s assumption on ``W``, as also quoted by Lu and
    De Sa, JMLR 2023, footnote 9, read). Metropolis-Hastings weights on an even ring give
    exactly -1/3 and on the 4x4 / 4x8 tori -0.6; lazy gossip ``(I + W) / 2``
    (:meth:`sky_flower.gossip.matrices.GossipMatrix.lazy`, ``strategy.lazy_mixing``)
    lifts every eigenvalue to ``(1 + lambda) / 2 >= 0`` at the cost of about half the gap.

    Raises
    ------
    ValueError
        If ``lambda_min(W) <= -1/3``.
    """

    name = "d2"

    def __init__(self, gossip: GossipMatrix, lr: float) -> None:
        if gossip.lambda_min <= -1.0 / 3.0 + 1e-9:
            lazy_min = (1.0 + gossip.lambda_min) / 2.0
            raise ValueError(
                f"D2 needs lambda_min(W) > -1/3 (Tang et al. 2018), but the {gossip.topology} "
                f"gossip matrix on {gossip.n} nodes has lambda_min = {gossip.lambda_min:.4f}: "
                f"set strategy.lazy_mixing=true (lazy gossip W' = (I + W) / 2, lambda_min "
                f"{lazy_min:.4f}), or choose another topology (complete, exponential, star)"
            )
        super().__init__(gossip, lr)

    def reset(self, x0: np.ndarray) -> None:  # noqa: D102
        super().reset(x0)
        self._prev_x: np.ndarray | None = None
        self._prev_g: np.ndarray | None = None

    def _update(self, grads: np.ndarray) -> np.ndarray:
        x = self.x
        if self._prev_x is None:
            new = self.W @ (x - self.lr * grads)
        else:
            assert self._prev_g is not None
            new = self.W @ (2.0 * x - self._prev_x - self.lr * (grads - self._prev_g))
        self._prev_x, self._prev_g = x, grads
        return new


class DSGT(DecentralizedAlgorithm):
    """DSGT, distributed stochastic gradient tracking (Pu and Nedic, "Distributed
    stochastic gradient tracking methods", Math. Programming 2021):
    ``y_0 = g_0``, ``y_t = W y_{t-1} + g_t - g_{t-1}``, ``x_{t+1} = W (x_t - alpha y_t)``.

    The tracker ``y_i`` follows the network's average gradient, so every node moves along
    the global gradient and the heterogeneity bias of D-PSGD vanishes. Both ``x`` and
    ``y`` are gossiped once per step."""

    name = "dsgt"

    def reset(self, x0: np.ndarray) -> None:  # noqa: D102
        super().reset(x0)
        self.y: np.ndarray | None = None
        self._prev_g: np.ndarray | None = None

    def _update(self, grads: np.ndarray) -> np.ndarray:
        if self.y is None:
            self.y = grads.copy()
        else:
            assert self._prev_g is not None
            self.y = self.W @ self.y + grads - self._prev_g
        self._prev_g = grads
        return self.W @ (self.x - self.lr * self.y)


class DeTAG(DecentralizedAlgorithm):
    """DeTAG (Lu and De Sa, "Optimal Complexity in Decentralized Training", ICML 2021,
    arXiv 2006.08085; extended as "Decentralized Learning: Theoretical Optimality and
    Practical Improvements", JMLR 24(93), 2023): gradient tracking with accelerated
    gossip by phase and mini-batch accumulation. One step is a *phase* ``k`` of ``R``
    gossip rounds; in it each node accumulates (averages) its gradient over ``R``
    mini-batches (``batches_per_step``) at the fixed point ``x_k``, giving ``g_k``.

    ``variant="paper"`` (default), Algorithm 2 of the JMLR version, per node ``i``::

        x_{k+1} = AG_R(x_k) - alpha AG_R(y_k)        (y_0 = 0, g_{-1} = 0)
        y_{k+1} = AG_R(y_k) + g_k - g_{k-1}

    ``variant="atc"`` (not in the paper; kept because earlier benchmark tables used
    it): the tracker takes the phase's gradient *before* gossip::

        y_{k+1/2} = y_k + g_k - g_{k-1}
        x_{k+1}   = AG_R(x_k - alpha y_{k+1/2})
        y_{k+1}   = AG_R(y_{k+1/2})

    Since ``AG_R`` is linear, ``atc`` is ``x_{k+1} = AG_R(x_k) - alpha y_{k+1}``: it steps
    along the tracker of this phase, ``paper`` along the previous phase's (the gradient
    taken at ``x_k`` first moves ``x_{k+2}``), which lets the phase's gossip run while its
    gradients are computed. At ``R = 1``, ``eta = 0``, ``atc`` is exactly :class:`DSGT`.

    Provenance, line by line against the JMLR paper's Algorithm 2 (its PDF read through
    the search tool's ``JmlrOrg/v24`` snapshot, 22-0044; the ICML version is *assumed*
    to print the same algorithm, the JMLR one says it extends it):

    - Input ``x~_0 = x_0``, tracker ``y_0``, buffers ``g^(0) = g^(-1) = 0``, steps
      ``alpha_k``: read. ``y_0`` is an input there; ``y_0 = 0`` here is *inferred*
      (the authors' ``pcode`` ``DeTAG`` optimizer sets it to the first mini-batch
      gradient). A constant ``alpha`` (Theorem 5's plain version): read.
    - Lines 2-3, ``k = floor(t / R)``, ``r = t mod R``: read; one :meth:`step` here is
      the ``R`` iterations of phase ``k`` at once.
    - Line 4, eqs. (13)-(14), one accelerated-gossip step per iteration on the replica
      ``x~`` and on ``y``, i.e. ``AG_R`` over the phase: read; ``AG`` is Algorithm 3,
      :func:`~sky_flower.gossip.matrices.accelerated_gossip` (``z_{-1} = z_0``,
      ``z_{r+1} = (1 + eta) W z_r - eta z_{r-1}``,
      ``eta = (1 - sqrt(1 - l^2)) / (1 + sqrt(1 - l^2))``, ``l = max(|lambda_2|,
      |lambda_n|)``): read. Restarting ``AG`` each phase (``z_{-1} = z_0`` at the
      phase start): read from Algorithm 3 being called per phase and from ``pcode``.
    - Line 5, ``g^(k) += g~ / R`` at ``x_{k,i}`` with ``B`` samples per query: read
      (``accumulate=True``; ``B`` is the mini-batch size of the caller).
    - Line 7, eq. (15), ``x_{t+1} = x~_{t+1} - alpha_k y_i``: read; that ``y_i`` is the
      tracker *after* the phase's gossip and *before* eq. (16) is *inferred* from the
      line order and matches ``pcode`` (``apply_gradient_from_gradient_tracker`` between
      the tracker's gossip and its update). Eq. (16), ``y += g^(k) - g^(k-1)``: read.
    - Lines 8-9, shift the buffers, copy ``x~ = x``: read.
    - The paper's experiments tune ``eta`` in {0, 0.1, 0.2, 0.4} and ``R`` in {1, 2, 3}
      (Appendix A.1, read); here ``eta`` is Algorithm 3's formula unless ``eta`` is
      given, and ``R`` by ``phase_rule`` unless ``phase_rounds`` is set.

    Parameters
    ----------
    phase_rounds : int (default: 0)
        ``R``, gossip rounds per phase; 0 picks :func:`default_phase_rounds` by
        ``phase_rule``.
    accumulate : bool (default: True)
        Average the gradient over ``R`` mini-batches per phase (False: one mini-batch).
    variant : {"paper", "atc"} (default: "paper")
        See above.
    phase_rule : {"sqrt", "log"} (default: "sqrt")
        Automatic ``R`` (``phase_rounds=0``): see :func:`default_phase_rounds`.
    eta : float or None (default: None)
        Accelerated gossip's momentum in [0, 1); None: Algorithm 3's formula. The paper
        tunes it (Appendix A.1); 0 is plain gossip.

    Raises
    ------
    ValueError
        ``phase_rounds < 0``, an unknown ``variant`` or ``phase_rule``, ``eta`` outside
        [0, 1).
    """

    name = "detag"
    VARIANTS: ClassVar[tuple[str, ...]] = ("paper", "atc")

    def __init__(  # noqa: PLR0913
        self,
        gossip: GossipMatrix,
        lr: float,
        phase_rounds: int = 0,
        accumulate: bool = True,
        variant: str = "paper",
        phase_rule: str = "sqrt",
        eta: float | None = None,
    ) -> None:
        super().__init__(gossip, lr)
        if eta is not None and not 0.0 <= eta < 1.0:
            raise ValueError(f"DeTAG's eta must be in [0, 1) (None: automatic), got {eta}")
        if phase_rounds < 0:
            raise ValueError(f"phase_rounds must be >= 0 (0: automatic), got {phase_rounds}")
        if variant not in self.VARIANTS:
            hint = (
                " ('overlap' is now 'paper': the paper's Algorithm 2 is that update)"
                if variant == "overlap"
                else ""
            )
            raise ValueError(
                f"unknown DeTAG variant {variant!r}: choose one of {self.VARIANTS}{hint}"
            )
        self.variant = variant
        self.rounds_per_step = int(phase_rounds) or default_phase_rounds(
            gossip.spectral_gap, gossip.n, phase_rule
        )
        self.batches_per_step = self.rounds_per_step if accumulate else 1
        self.eta = acceleration_eta(gossip.mixing_rate) if eta is None else float(eta)

    def reset(self, x0: np.ndarray) -> None:  # noqa: D102
        super().reset(x0)
        self.y = np.zeros_like(self.x)
        self._prev_g = np.zeros_like(self.x)

    def _gossip(self, z: np.ndarray) -> np.ndarray:
        return accelerated_gossip(z, self.W, self.rounds_per_step, self.eta)

    def _update(self, grads: np.ndarray) -> np.ndarray:
        if self.variant == "paper":  # Algorithm 2, eqs. (13)-(16)
            mixed_y = self._gossip(self.y)
            new_x = self._gossip(self.x) - self.lr * mixed_y
            self.y = mixed_y + grads - self._prev_g
        else:  # atc
            half_y = self.y + grads - self._prev_g
            new_x = self._gossip(self.x - self.lr * half_y)
            self.y = self._gossip(half_y)
        self._prev_g = grads
        return new_x


PHASE_RULES = ("sqrt", "log")


def default_phase_rounds(spectral_gap: float, nodes: int = 2, rule: str = "sqrt") -> int:
    """DeTAG's automatic phase length ``R`` in gossip rounds.

    ``rule="sqrt"``: ``max(1, round(1 / sqrt(gap)))``, the paper's order
    ``1/sqrt(1-lambda)`` without its log factor. ``rule="log"``:
    ``max(1, ceil(ln(n) / (2 sqrt(gap))))``. Lu and De Sa (JMLR 2023, Corollary 6, read)
    set ``R = max(log(n) / 2, log(s0^2 T / (Delta L)) / 2) / sqrt(1 - lambda)``; the
    second term needs the outer variance ``s0^2``, the initial gap ``Delta`` and the
    smoothness ``L``, unknown in practice, so it is *dropped* here, and the log is taken
    natural (*inferred*: the paper does not say).

    Parameters
    ----------
    spectral_gap : float
        ``1 - lambda`` in (0, 1].
    nodes : int (default: 2)
        ``n`` (``rule="log"`` only), >= 2.
    rule : {"sqrt", "log"} (default: "sqrt")

    Raises
    ------
    ValueError
        A gap outside (0, 1], ``nodes < 2`` or an unknown rule.
    """
    if not 0.0 < spectral_gap <= 1.0:
        raise ValueError(f"spectral_gap must be in (0, 1], got {spectral_gap}")
    if rule == "sqrt":
        return max(1, round(1.0 / math.sqrt(spectral_gap)))
    if rule != "log":
        raise ValueError(f"unknown phase rule {rule!r}: choose one of {PHASE_RULES}")
    if nodes < 2:
        raise ValueError(f"nodes must be >= 2, got {nodes}")
    return max(1, math.ceil(0.5 * math.log(nodes) / math.sqrt(spectral_gap) - 1e-9))


ALGORITHMS: dict[str, type[DecentralizedAlgorithm]] = {
    cls.name: cls for cls in (DPSGD, D2, DSGT, DeTAG)
}


def make_algorithm(  # noqa: PLR0913
    name: str,
    gossip: GossipMatrix,
    lr: float,
    phase_rounds: int = 0,
    variant: str = "paper",
    phase_rule: str = "sqrt",
    eta: float | None = None,
) -> DecentralizedAlgorithm:
    """Build algorithm ``name`` (``dpsgd``, ``d2``, ``dsgt``, ``detag``); ``phase_rounds``,
    ``variant``, ``phase_rule`` and ``eta`` are DeTAG's (see :class:`DeTAG`), ignored
    otherwise.

    Raises
    ------
    ValueError
        Unknown name, or the algorithm's own checks (``lr``, D2's ``lambda_min``,
        DeTAG's variant and phase rule).
    """
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}: choose one of {', '.join(ALGORITHMS)}")
    if name == "detag":
        return DeTAG(
            gossip, lr, phase_rounds=phase_rounds, variant=variant, phase_rule=phase_rule, eta=eta
        )
    return ALGORITHMS[name](gossip, lr)
