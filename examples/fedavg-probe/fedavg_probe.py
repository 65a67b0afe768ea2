"""FedAvg on emulated devices, timed per round (``sky_flower.bench.deployment``, table 3).

``fedavg_task.py`` is ``examples/fedavg-app``'s ``task.py`` (model, data, test), copied
in by the bench. Training is its loop (Adam, shuffled batches) with the node's emulation
as Sky's stages apply it: sleep slowdown x each step's compute
(``Emulation.after_compute``), and the link delay of the model both ways once per
message. A node without data, or whose memory cap cannot hold the model's training
memory (the server sends it: weights, gradients, Adam state and the batch's stashed
activations), trains nothing: it replies 0 examples (no weight in FedAvg).
"""

import json
import time
from collections.abc import Iterable

import torch
from fedavg_task import Net, initial_weights, load_data, load_test, test
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

from sky_flower.app import emulation_from_node_config
from sky_flower.bench.deployment import model_training_bytes
from sky_flower.emulation.devices import Emulation

client = ClientApp()
server = ServerApp()


def train_emulated(
    net: nn.Module, data: object, epochs: float, lr: float, batch: int, emu: Emulation
) -> float:
    """Train ``net`` on ``data`` (``x``, ``y`` arrays) with Adam; the mean loss."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    losses = []
    for _ in range(max(1, round(epochs))):
        for idx in torch.randperm(len(y)).split(batch):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
            emu.after_compute(time.perf_counter() - t0)
            losses.append(loss.item())
    return sum(losses) / len(losses)


@client.train()
def train(msg: Message, context: Context) -> Message:
    """One round's local training (or none: see the module docstring)."""
    emu = emulation_from_node_config(context.node_config)
    cfg = msg.content["config"]
    arrays, n, loss = msg.content["arrays"], 0, 0.0
    if emu.holds_data and emu.memory_bytes() >= int(cfg["need-bytes"]):
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        nc = context.node_config
        data = load_data(int(nc["partition-id"]), int(nc["num-partitions"]))
        epochs, lr, batch = float(cfg["local-epochs"]), float(cfg["lr"]), int(cfg["batch-size"])
        loss = train_emulated(model, data, epochs, lr, batch, emu)
        arrays, n = ArrayRecord(model.state_dict()), len(data)
    time.sleep(emu.link_delay_s(2 * arrays.count_bytes()))
    metrics = MetricRecord({"train_loss": loss, "num-examples": n})
    return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


class CountingFedAvg(FedAvg):
    """FedAvg that records, per round, the examples and owners that trained."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.trained: dict[int, tuple[int, int]] = {}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> object:
        """Count the round's examples and owners, then FedAvg's aggregation."""
        replies = list(replies)
        ns = [int(m.content["metrics"]["num-examples"]) for m in replies if m.has_content()]
        self.trained[server_round] = (sum(ns), sum(1 for n in ns if n > 0))
        return super().aggregate_train(server_round, replies)


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedAvg for ``num-server-rounds``; write each round's time, accuracy and
    examples trained to ``results-path``."""
    cfg = context.run_config
    rounds, batch, k = int(cfg["num-server-rounds"]), int(cfg["batch-size"]), int(cfg["min-nodes"])
    t_wait = time.perf_counter()
    while len(list(grid.get_node_ids())) < k:  # every SuperNode, before round 1 (as Sky)
        time.sleep(0.5)
    wait_s = time.perf_counter() - t_wait
    need = model_training_bytes(Net(), [64], batch)
    test_set, marks = load_test(), {}

    def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        t0 = time.perf_counter()
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = test(model, test_set)
        marks[rnd] = (t0, time.perf_counter(), time.time())
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy = CountingFedAvg(
        fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=k, min_available_nodes=k
    )
    config = ConfigRecord(
        {
            "lr": float(cfg["lr"]),
            "local-epochs": float(cfg["local-epochs"]),
            "batch-size": batch,
            "need-bytes": need,
        }
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial_weights()),
        train_config=config,
        num_rounds=rounds,
        evaluate_fn=evaluate,
    )
    acc = {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
    rows = [
        {
            "round": r,
            "test_accuracy": acc.get(r),
            "round_time_s": marks[r][0] - marks[r - 1][1],
            "evaluated_unix_s": marks[r][2],
            "samples_trained": strategy.trained.get(r, (None, None))[0],
            "owners_trained": strategy.trained.get(r, (None, None))[1],
        }
        for r in range(1, rounds + 1)
        if r in marks
    ]
    out = {
        "initial_test_accuracy": acc.get(0),
        "rounds": rows,
        "need_bytes": need,
        "node_wait_s": wait_s,
        "completed": len(rows) == rounds,
        "error": None,
    }
    with open(str(cfg["results-path"]), "w") as f:
        json.dump(out, f, indent=1)
