"""A ClientApp whose data owner is slower than predicted once, alive (issue 17's
deadline tests). Its own small module: :class:`reference.ConcurrentGrid` imports it in
every message's child process (by reference, as it pickles ``app_fn``)."""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from reference import sky_app_task

STALL_S = 5.0  # how much longer the owner's first stage message takes


def stall_first_forward(msg: Message, context: Context, call_next) -> Message:  # noqa: ANN001
    """A ClientApp mod: the data owner's first ``train.sky_forward`` of the run takes
    :data:`STALL_S` more."""
    if (
        msg.metadata.message_type == "train.sky_forward"
        and context.node_config.get("sky-holds-data")
        and "test.stalled" not in context.state
    ):
        context.state["test.stalled"] = ConfigRecord({"s": STALL_S})
        time.sleep(STALL_S)
    return call_next(msg, context)


def stalling_client() -> ClientApp:
    """Sky's ClientApp for the sky-app with :func:`stall_first_forward`."""
    from sky_flower.app import register_sky_client

    task = sky_app_task()
    app = ClientApp(mods=[stall_first_forward])
    return register_sky_client(app, model_fn=task.Net, load_data=task.load_data)
