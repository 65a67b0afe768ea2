"""The fast path of the decentralized benchmarks: all ``n`` nodes' gradients at once
(``torch.func.vmap``) in one process, no Flower. Used by
:mod:`sky_flower.bench.decentralized` and :mod:`sky_flower.bench.decentralized_noise`;
``tests/test_decentralized_sim.py`` checks it against the Flower strategies."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sky_flower.gossip.algorithms import make_algorithm
from sky_flower.gossip.matrices import GossipMatrix
from sky_flower.gossip.training import FlatModel, minibatch_indices
from sky_flower.pipeline.data import Split


def simulate(  # noqa: PLR0913
    algorithm: str,
    gossip: GossipMatrix,
    model: FlatModel,
    splits: list[Split],
    test: Split,
    rounds: int,
    lr: float,
    batch_size: int = 16,
    seed: int = 0,
    phase_rounds: int = 0,
    variant: str = "paper",
    phase_rule: str = "sqrt",
    eta: float | None = None,
) -> list[dict[str, Any]]:
    """Run ``algorithm`` for ``rounds`` gossip rounds; return the rows the Flower strategy
    would record
    (:meth:`sky_flower.strategies.decentralized.DecentralizedStrategy.start`): ``round``,
    ``loss`` (training loss of the averaged model over all nodes' data), ``node_loss``,
    ``test_accuracy``, ``test_loss``, ``consensus_distance``. Stops early (last row
    ``loss`` = inf) if the loss diverges. ``phase_rounds``, ``variant``, ``phase_rule``, ``eta``:
    DeTAG's (:class:`sky_flower.gossip.algorithms.DeTAG`).

    Raises
    ------
    ValueError
        As :func:`sky_flower.gossip.algorithms.make_algorithm`; ``len(splits) != gossip.n``.
    """
    if len(splits) != gossip.n:
        raise ValueError(f"{len(splits)} data splits for {gossip.n} nodes")
    alg = make_algorithm(algorithm, gossip, lr, phase_rounds, variant, phase_rule, eta)
    alg.reset(model.initial(seed))
    all_train = Split(np.concatenate([s.x for s in splits]), np.concatenate([s.y for s in splits]))
    rows: list[dict[str, Any]] = []

    def record(step: int, node_loss: float | None) -> None:
        test_res = model.evaluate(alg.average, test)
        rows.append(
            {
                "round": step * alg.rounds_per_step,
                "loss": model.evaluate(alg.average, all_train)["loss"],
                "node_loss": node_loss,
                "consensus_distance": alg.consensus_distance(),
                "test_accuracy": test_res["accuracy"],
                "test_loss": test_res["loss"],
            }
        )

    record(0, None)
    for step in range(rounds // alg.rounds_per_step):
        grads, losses = np.zeros(alg.x.shape), np.zeros(gossip.n)
        for k in range(alg.batches_per_step):
            idx = [
                minibatch_indices(len(s), batch_size, seed, i, step, k)
                for i, s in enumerate(splits)
            ]
            xb = np.stack([s.x[j] for s, j in zip(splits, idx, strict=True)])
            yb = np.stack([s.y[j] for s, j in zip(splits, idx, strict=True)])
            loss, g = model.batched_loss_and_grad(alg.x, xb, yb)
            grads += g
            losses += loss
        alg.step(grads / alg.batches_per_step)
        record(step + 1, float(np.mean(losses) / alg.batches_per_step))
        if not math.isfinite(rows[-1]["loss"]) or rows[-1]["loss"] > 1e3:
            rows[-1]["loss"] = math.inf
            break
    return rows
