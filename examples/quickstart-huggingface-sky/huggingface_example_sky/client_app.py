"""huggingface_example: A Flower / Hugging Face app."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from sky_flower.app import register_sky_client  # Sky
from sky_flower.pipeline.hf import hf_model_fn  # Sky

from .task import get_model, load_data
from .task import test as test_fn
from .task import train as train_fn

# Flower ClientApp
app = ClientApp()
net_fn = hf_model_fn(lambda: get_model(""), ["input_ids", "attention_mask"], 32)  # Sky
register_sky_client(app, net_fn, load_data)  # Sky


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    model_name = context.run_config["model-name"]
    net = get_model(model_name)
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader, _ = load_data(partition_id, num_partitions, model_name)

    epochs = context.run_config["local-epochs"]
    train_loss = train_fn(net, trainloader, epochs=epochs, device=device)

    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    arrays = ArrayRecord(net.state_dict())
    content = RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    model_name = context.run_config["model-name"]
    net = get_model(model_name)
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    _, testloader = load_data(partition_id, num_partitions, model_name)

    loss, accuracy = test_fn(net, testloader, device=device)

    metrics = {"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(testloader.dataset)}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
