"""What split training must compute, computed without Flower: the sky-app's model trained
unsplit in this process on the data owner's batches, and an in-process Grid that runs
every message the way Flower's deployment engine does (a fresh ClientApp per message,
``context.state`` carried between messages only through Flower's protobuf)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
)
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.serverapp import Grid

from sky_flower.pipeline.data import batch_indices

SKY_APP = Path(__file__).resolve().parents[1] / "examples" / "sky-app"


def sky_app_task():  # noqa: ANN201 - the example app's task module
    """``examples/sky-app``'s ``sky_app.task`` (Net, load_data, load_test, test)."""
    if str(SKY_APP) not in sys.path:
        sys.path.insert(0, str(SKY_APP))
    from sky_app import task

    return task


def reference_rounds(
    model_fn: Callable[[], torch.nn.Module],
    data,  # noqa: ANN001 - a Split (x, y numpy arrays)
    rounds: int,
    steps: int,
    lr: float,
    batch_size: int = 64,
    microbatches: int = 1,
    seed: int = 0,
) -> list[tuple[dict[str, torch.Tensor], list[float]]]:
    """Unsplit training as Sky's relay defines it: each round a fresh Adam, step ``s`` of
    round ``r`` on batch ``s % per_epoch`` of epoch ``r * 1000 + s // per_epoch`` of the
    data owner's data (``batch_indices``), the batch's mean loss over ``microbatches``
    equal micro-batches. Returns, per round, the weights after it and its step losses."""
    torch.set_num_threads(1)
    model = model_fn()
    per_epoch = len(data) // batch_size
    out = []
    for rnd in range(1, rounds + 1):
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            epoch = rnd * 1000 + step // per_epoch
            idx = batch_indices(len(data), batch_size, epoch, seed)[step % per_epoch]
            x, y = torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])
            opt.zero_grad()
            total = 0.0
            for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
                loss = torch.nn.functional.cross_entropy(model(xm), ym) / microbatches
                loss.backward()
                total += loss.item()
            opt.step()
            losses.append(total)
        out.append(({k: v.detach().clone() for k, v in model.state_dict().items()}, losses))
    return out


def _wire(msg: Message) -> Message:
    return message_from_proto(message_to_proto(msg))


class ProcessPerMessageGrid(Grid):
    """A Grid that delivers each message as a SuperNode of Flower's deployment engine
    does: the node's context is restored from the protobuf bytes saved after its last
    message, a ClientApp freshly built by ``app_fn`` (no module-level cache survives)
    handles the message, the updated context is saved back as bytes. Messages and
    replies go through Flower's protobuf too. Runs synchronously in push_messages.

    ``node_configs`` are the SuperNodes' ``--node-config`` dicts (node ids 101, 102, ...)."""

    def __init__(
        self,
        app_fn: Callable[[], ClientApp],
        node_configs: list[dict],
        run_config: dict,
    ) -> None:
        self.app_fn = app_fn
        self.ids = list(range(101, 101 + len(node_configs)))
        self.saved: dict[int, bytes] = {}
        for nid, cfg in zip(self.ids, node_configs, strict=True):
            ctx = Context(
                run_id=1, node_id=nid, node_config=cfg, state=RecordDict(), run_config=run_config
            )
            self.saved[nid] = context_to_proto(ctx).SerializeToString()
        self.replies: dict[str, Message] = {}
        self.handled: list[tuple[int, str]] = []  # (node id, message type), in order

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            nid = msg.metadata.dst_node_id
            context = context_from_proto(ProtoContext.FromString(self.saved[nid]))
            reply = self.app_fn()(_wire(msg), context)
            self.saved[nid] = context_to_proto(context).SerializeToString()
            self.replies[mid] = _wire(reply)
            self.handled.append((nid, msg.metadata.message_type))
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]

    def get_node_ids(self) -> Iterable[int]:
        return list(self.ids)

    def _unused(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("SkyStrategy does not use this")

    create_message = send_and_receive = set_run = _unused
    run = property(_unused)
