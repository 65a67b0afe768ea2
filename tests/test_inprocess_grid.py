"""sky_flower.flower.inprocess.InProcessGrid: the in-process Grid the benchmarks use."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from sky_flower.flower.inprocess import InProcessGrid


def _app() -> ClientApp:
    app = ClientApp()

    @app.query()
    def echo(msg: Message, context: Context) -> Message:
        seen = int(context.state.config_records.get("seen", ConfigRecord({"n": 0}))["n"]) + 1
        context.state.config_records["seen"] = ConfigRecord({"n": seen})
        if msg.content.config_records["q"]["fail"]:
            raise ValueError("asked to fail")
        reply = RecordDict(
            {"r": ConfigRecord({"node": str(context.node_config["sky-node"]), "seen": seen})}
        )
        return Message(reply, reply_to=msg)

    return app


def _query(dst: int, fail: bool = False) -> Message:
    return Message(RecordDict({"q": ConfigRecord({"fail": fail})}), dst, "query")


@pytest.mark.usefixtures("server_identity")
def test_nodes_keep_their_own_context_and_replies_are_pulled_once() -> None:
    grid = InProcessGrid({"a": _app(), "b": _app()})
    assert list(grid.get_node_ids()) == [101, 102]
    ids = list(grid.push_messages([_query(101), _query(101), _query(102)]))
    replies = list(grid.pull_messages(ids))
    got = [
        (r.content.config_records["r"]["node"], r.content.config_records["r"]["seen"])
        for r in replies
    ]
    assert got == [("a", 1), ("a", 2), ("b", 1)]
    assert [r.metadata.reply_to_message_id for r in replies] == ids
    assert list(grid.pull_messages(ids)) == []  # each reply once
    assert grid.handled == [(101, "query"), (101, "query"), (102, "query")]


@pytest.mark.usefixtures("server_identity")
def test_a_raising_clientapp_gives_an_error_reply_not_an_exception() -> None:
    grid = InProcessGrid({"a": _app()}, node_configs={"a": {"sky-node": "x"}})
    (reply,) = grid.pull_messages(grid.push_messages([_query(101, fail=True)]))
    assert reply.has_error()
    assert reply.error.reason == "ValueError: asked to fail"
    with pytest.raises(AssertionError, match="do not use"):
        grid.send_and_receive([])
