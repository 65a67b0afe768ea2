"""huggingface_example: A Flower / Hugging Face app."""

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from sky_flower.app import sky_strategy  # Sky
from sky_flower.pipeline.hf import hf_model_fn  # Sky

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
    net_fn = hf_model_fn(lambda: get_model(model_name), ["input_ids", "attention_mask"], 32)  # Sky
    strategy = sky_strategy(context.run_config, net_fn, app_keys=("model-name",))  # Sky

    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)
    print(result)
