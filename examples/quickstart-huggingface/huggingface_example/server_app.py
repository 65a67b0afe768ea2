"""huggingface_example: A Flower / Hugging Face app."""

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from .task import get_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    num_rounds = context.run_config["num-server-rounds"]

    # Set global model initialization
    model_name = context.run_config["model-name"]
    arrays = ArrayRecord(get_model(model_name).state_dict())

    # Define strategy
    fraction_train = context.run_config["fraction-train"]
    fraction_evaluate = context.run_config["fraction-evaluate"]
    strategy = FedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate)

    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)
    print(result)
