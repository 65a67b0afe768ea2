"""A plain Flower FedAvg app on digits, and the same app switched to Sky.

Run it in Flower's simulation engine (3 SuperNodes)::

    python examples/fedavg_to_sky.py --strategy fedavg
    python examples/fedavg_to_sky.py --strategy sky

The lines marked ``# Sky`` are all the switch takes: register the Sky handlers on the
ClientApp and start ``SkyStrategy`` instead of ``FedAvg``. With Sky the model is split
across the nodes instead of copied to each: one data owner (here partition 0) runs
stage 0 on its own data, the other nodes hold later stages.
"""

from __future__ import annotations

import argparse

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation
from torch import nn

from sky_flower.client import SkyClient  # Sky
from sky_flower.data import Split, load_split, owner_partition
from strategies.sky import SkyStrategy  # Sky

NUM_NODES = 3


def Net() -> nn.Sequential:  # noqa: N802 - a model class in Flower's templates
    """The model as an ordered list of layers (Sky places whole entries on nodes)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU()),
        nn.Sequential(nn.Linear(256, 256), nn.ReLU()),
        nn.Sequential(nn.Linear(256, 256), nn.ReLU()),
        nn.Linear(256, 10),
    )


_cache: dict[int, Split] = {}


def load_partition(context: Context) -> Split:
    """This node's IID share of the digits train split (cached)."""
    pid = int(context.node_config["partition-id"])
    if pid not in _cache:
        train, _ = load_split("digits")
        _cache[pid] = owner_partition(train, pid, int(context.node_config["num-partitions"]))
    return _cache[pid]


def sky_data(context: Context) -> Split | None:  # Sky: one data owner (partition 0)
    return load_partition(context) if int(context.node_config["partition-id"]) == 0 else None


# --- ClientApp: a standard FedAvg train handler ---------------------------------------
client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training for FedAvg: one epoch of Adam on this node's partition."""
    model = Net()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    data = load_partition(context)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    for idx in torch.randperm(len(y)).split(32):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(y)}),
        }
    )
    return Message(content, reply_to=msg)


SkyClient(model_fn=Net, load_data=sky_data).register(client_app)  # Sky


# --- ServerApp ---------------------------------------------------------------------------
def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Accuracy of the global model on the held-out digits test split."""
    _, test = load_split("digits")
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    with torch.no_grad():
        pred = model(torch.from_numpy(test.x)).argmax(1)
    return MetricRecord({"accuracy": float((pred == torch.from_numpy(test.y)).float().mean())})


def make_server_app(strategy_name: str, num_rounds: int, results: dict) -> ServerApp:
    """The ServerApp; ``results["accuracy"]`` gets the final test accuracy."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        if strategy_name == "sky":  # Sky
            strategy = SkyStrategy(  # Sky
                model_fn=Net, input_shape=[64], lr=1e-3, local_epochs=3, min_nodes=NUM_NODES
            )
        else:
            strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(Net().state_dict()),
            num_rounds=num_rounds,
            evaluate_fn=central_evaluate,
        )
        results["accuracy"] = float(result.evaluate_metrics_serverapp[num_rounds]["accuracy"])

    return server_app


def run(strategy_name: str, num_rounds: int = 2) -> float:
    """Run the app in simulation; return the final test accuracy."""
    results: dict = {}
    run_simulation(
        server_app=make_server_app(strategy_name, num_rounds, results),
        client_app=client_app,
        num_supernodes=NUM_NODES,
        backend_config={"client_resources": {"num_cpus": 0.5, "num_gpus": 0.0}},
    )
    return results["accuracy"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["fedavg", "sky"], default="sky")
    parser.add_argument("--num-rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"final test accuracy ({args.strategy}): {run(args.strategy, args.num_rounds):.4f}")
