"""The ServerApp: Sky's strategy (plan, split training per pipeline, FedAvg of the
adapters), evaluated on the server's held-out text."""

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from sky_flower.app import sky_strategy

from .task import evaluate, get_model, load_test, net_fn

app = ServerApp()


def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Next-byte loss, perplexity and accuracy of the global model on held-out text."""
    model = get_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    metrics = evaluate(model, load_test())
    print(
        f"round {server_round}: held-out loss {metrics['loss']:.4f}, "
        f"perplexity {metrics['perplexity']:.2f}"
    )
    return MetricRecord(metrics)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the strategy for ``num-server-rounds`` rounds."""
    strategy = sky_strategy(context.run_config, model_fn=net_fn())
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(get_model().state_dict()),
        num_rounds=int(context.run_config["num-server-rounds"]),
        evaluate_fn=central_evaluate,
    )
