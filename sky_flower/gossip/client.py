"""ClientApp handlers of the decentralized strategies (server: ``strategies/decentralized.py``).

Flower has no peer-to-peer channel, so the server holds every node's model and applies
the gossip matrix; a node only computes stochastic gradients on its own data.

=====================  ===============================================================
``query.dec_hello``    report this node's position (``partition-id``) and data size
``train.dec_grad``     receive the node's model ``x`` (flat, ``(dim,)``) and the
                       averaged model ``xbar``; return the gradient at ``x`` averaged
                       over ``batches`` seeded mini-batches, their mean loss, and the
                       loss of ``xbar`` on all local data
``query.dec_eval``     loss of ``xbar`` on all local data (after the last round)
=====================  ===============================================================
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from sky_flower.flower.vectors import node_position, vector_record
from sky_flower.gossip.protocol import EVAL, GRAD, HELLO
from sky_flower.gossip.training import FlatModel, minibatch_indices
from sky_flower.pipeline.data import Split


class DecentralizedClient:
    """Node side of D-PSGD, D2, DSGT and DeTAG.

    Parameters
    ----------
    model : FlatModel
        The model, as a flat parameter vector (same on every node and the server).
    load_data : Callable[[Context], Split]
        This node's local training data (numpy ``x`` ``(n, 64)``, int64 ``y`` ``(n,)``);
        called on every message: cache what it loads.
    """

    def __init__(self, model: FlatModel, load_data: Callable[[Context], Split]) -> None:
        self.model = model
        self.load_data = load_data

    def register(self, app: ClientApp) -> ClientApp:
        """Add the handlers to ``app`` and return it."""
        app.query(HELLO.removeprefix("query."))(self.hello)
        app.train(GRAD.removeprefix("train."))(self.grad)
        app.query(EVAL.removeprefix("query."))(self.eval)
        return app

    def hello(self, msg: Message, context: Context) -> Message:
        """Position and number of local examples."""
        data = self.load_data(context)
        metrics = MetricRecord({"position": node_position(context), "n": len(data)})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    def grad(self, msg: Message, context: Context) -> Message:
        """Gradient of the node's model on ``batches`` seeded mini-batches."""
        torch.set_num_threads(1)
        data = self.load_data(context)
        cfg = msg.content.config_records["cfg"]
        x = msg.content.array_records["x"]["x"].numpy()
        xbar = msg.content.array_records["xbar"]["xbar"].numpy()
        if x.shape != (self.model.dim,):
            raise ValueError(f"model vector has shape {x.shape}, expected ({self.model.dim},)")
        position, step = node_position(context), int(cfg["step"])
        batches, bs, seed = int(cfg["batches"]), int(cfg["batch_size"]), int(cfg["seed"])
        total, losses = np.zeros(self.model.dim), []
        for k in range(batches):
            idx = minibatch_indices(len(data), bs, seed, position, step, k)
            loss, g = self.model.loss_and_grad(x, data.x[idx], data.y[idx])
            total += g
            losses.append(loss)
        metrics = MetricRecord(
            {
                "loss": float(np.mean(losses)),
                "avg_model_loss": self.model.evaluate(xbar, data)["loss"],
                "n": len(data),
            }
        )
        grad = vector_record("grad", total / batches)
        return Message(RecordDict({"grad": grad, "metrics": metrics}), reply_to=msg)

    def eval(self, msg: Message, context: Context) -> Message:
        """Loss of the averaged model on all local data."""
        data = self.load_data(context)
        xbar = msg.content.array_records["xbar"]["xbar"].numpy()
        metrics = MetricRecord({"avg_model_loss": self.model.evaluate(xbar, data)["loss"]})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)


def heterogeneous_data_fn(
    num_nodes: int, homogeneity: float, test_fraction: float = 0.2, seed: int = 0
) -> Callable[[Context], Split]:
    """Loader of node ``partition-id``'s part of the digits train split, with the
    sorted-shuffle heterogeneity of :func:`sky_flower.gossip.training.sorted_shuffle_partition`."""
    from sky_flower.gossip.training import node_splits
    from sky_flower.pipeline.data import load_split

    cache: dict[int, Split] = {}

    def load(context: Context) -> Split:
        position = node_position(context)
        if not 0 <= position < num_nodes:
            raise ValueError(f"node position {position} not in [0, {num_nodes})")
        if not cache:
            train, _ = load_split("digits", test_fraction, seed)
            cache.update(enumerate(node_splits(train, num_nodes, homogeneity, seed)))
        return cache[position]

    return load
