"""Run a ServerApp's strategy against ClientApps in this process, without Flower's engines.

:class:`InProcessGrid` is a Flower ``Grid`` whose nodes are ClientApps called in this
process: a message is handled when it is pushed, each node keeps its own ``Context``
(``node_config``, ``state``), and a handler that raises gives an error reply, as a
SuperNode's ClientApp does. There is no Ray and no SuperLink, so no per-message polling
tick (the simulation engine's 0.1 s) hides what the ClientApps themselves cost: the
benchmarks that time a protocol's own work (``sky_flower.bench.drift``) and the
in-process protocol tests run on it. Subclasses change how one message is delivered
(:meth:`InProcessGrid.deliver`), e.g. through Flower's protobuf with a fresh ClientApp
per message, as the deployment engine does (``tests/reference.py``).

:func:`server_identity` gives this process the task identity a ServerApp process has,
so a strategy can build ``Message`` objects outside Flower's runtime.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

FIRST_NODE_ID = 101  # node ids are 101, 102, ... in the order the nodes are given


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApps in this process, one ``Context`` each.

    Parameters
    ----------
    apps:
        Node name -> its ClientApp; node ids are 101, 102, ... in this order.
    node_configs:
        Node name -> its ``node_config`` (default ``{"sky-node": name}``, what a Sky
        SuperNode is started with).
    run_config:
        Every node's ``run_config`` (default empty).

    ``push_messages`` handles each message at once, in order; ``pull_messages`` returns
    the replies of the ids asked for that exist (each once). A handler that raises gives
    an error reply (``Error(code=0, reason="<Type>: <message>")``); it never propagates.
    Only ``push_messages``, ``pull_messages`` and ``get_node_ids`` are provided (what
    the strategies of this package use); the rest raise ``AssertionError``.
    """

    def __init__(
        self,
        apps: Mapping[str, ClientApp],
        node_configs: Mapping[str, dict] | None = None,
        run_config: dict | None = None,
    ) -> None:
        names = list(apps)
        self.ids: list[int] = list(range(FIRST_NODE_ID, FIRST_NODE_ID + len(names)))
        self.names: dict[int, str] = dict(zip(self.ids, names, strict=True))
        self.apps: dict[int, ClientApp] = {nid: apps[name] for nid, name in self.names.items()}
        configs = node_configs or {}
        self.contexts: dict[int, Context] = {
            nid: Context(
                run_id=1,
                node_id=nid,
                node_config=dict(configs.get(name, {"sky-node": name})),
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for nid, name in self.names.items()
        }
        self.replies: dict[str, Message] = {}
        self.handled: list[tuple[int, str]] = []  # (node id, message type), in order

    def deliver(self, node_id: int, message: Message) -> Message:
        """Handle ``message`` on node ``node_id`` and return its reply (an error reply
        if the ClientApp raises)."""
        try:
            return self.apps[node_id](message, self.contexts[node_id])
        except Exception as err:  # noqa: BLE001 - a node's failure: an error reply
            return Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Give each message an id, :meth:`handle` it, keep the reply."""
        ids = []
        for msg in messages:
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            self.replies[mid] = self.handle(msg)
            ids.append(mid)
        return ids

    def handle(self, msg: Message) -> Message:
        """The reply to a pushed message: :meth:`deliver` on its destination node."""
        nid = msg.metadata.dst_node_id
        reply = self.deliver(nid, msg)
        self.handled.append((nid, msg.metadata.message_type))
        return reply

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that exist, each returned once."""
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]

    def get_node_ids(self) -> Iterable[int]:
        """The node ids, 101, 102, ..."""
        return list(self.ids)

    def _unused(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        raise AssertionError("the strategies of sky_flower do not use this Grid method")

    create_message = send_and_receive = set_run = _unused  # type: ignore[assignment]
    run = property(_unused)  # type: ignore[assignment]


def server_identity() -> None:
    """Give this process a ServerApp's task identity (run 1, the SuperLink's node id,
    task 1), so a strategy can build messages outside Flower's runtime. Process-wide:
    tests should set the same attributes with ``monkeypatch`` instead."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        setattr(TaskIdentity, attr, value)
