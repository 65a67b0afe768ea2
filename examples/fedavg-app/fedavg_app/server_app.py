"""The ServerApp (FedAvg, evaluated on the server's held-out test split)."""

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from .task import Net, initial_weights, load_test, save_results
from .task import test as test_fn

app = ServerApp()


def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Accuracy and loss of the global model on the held-out test split."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, acc = test_fn(model, load_test())
    return MetricRecord({"accuracy": acc, "loss": loss})


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the strategy for ``num-server-rounds`` rounds."""
    num_rounds = int(context.run_config["num-server-rounds"])
    lr = float(context.run_config["lr"])
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial_weights()),
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=central_evaluate,
    )
    save_results(context.run_config, result)  # results.json for the launcher
