"""The ClientApp (FedAvg's train and evaluate handlers)."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .task import Net, Split, load_data
from .task import test as test_fn
from .task import train as train_fn

app = ClientApp()


def _partition(context: Context) -> Split:
    """This node's partition (``partition-id`` of ``num-partitions`` in its node config)."""
    cfg = context.node_config
    return load_data(int(cfg["partition-id"]), int(cfg["num-partitions"]))


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on this node's partition."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = _partition(context)
    cfg = context.run_config
    loss = train_fn(model, data, float(cfg["local-epochs"]), float(msg.content["config"]["lr"]))
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(data)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this node's partition."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = _partition(context)
    loss, acc = test_fn(model, data)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc, "num-examples": len(data)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
