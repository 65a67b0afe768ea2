"""The node's stage channels (issue 42): the relay's message and the stream's frames
both satisfy :class:`~sky_flower.sky.node.channels.StageChannel`, and the one
interpreter (:func:`~sky_flower.sky.node.stage_ops.answer_op`) answers the same op
alike over either: a malformed op raises the same error, the stage's own error is the
same :data:`~sky_flower.sky.protocol.STAGE_ERROR` reply. The relay is driven through
its handler (:meth:`SkyClient.forward`), the stream through its loop
(:func:`~sky_flower.sky.node.stream_node.run_stream_session`, its link a fake)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from torch import nn

from sky_flower.emulation.devices import Emulation
from sky_flower.pipeline.objective import resolve
from sky_flower.sky import protocol as P
from sky_flower.sky.node import stream_node
from sky_flower.sky.node.channels import MessageChannel, StageChannel, StreamChannel
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.node.stage_ops import MalformedOpError, NodeStage

M = 2
ST = P.StageConfig(
    stage=1,
    first=0,
    last=2,
    is_first=False,
    is_last=True,
    microbatches=M,
    batch_size=4,
    optimizer="sgd",
    lr=0.1,
    round=1,
    seed=0,
)
LINK = P.StreamLink("127.0.0.1:1", "ab" * 16, "-", "-", 1 << 20, 10.0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


class FakeLink:
    """A stage link that delivers ``frames`` and keeps what the stage sends."""

    def __init__(self, frames: list[tuple[dict[str, Any], RecordDict]]) -> None:
        self._frames, self.sent, self.closed = frames, [], False

    def frames(self) -> Iterator[tuple[dict[str, Any], RecordDict]]:
        yield from self._frames

    def send(self, header: dict[str, Any], records: RecordDict | None = None) -> int:
        self.sent.append((header, records))
        return 1

    def close(self) -> None:
        self.closed = True


def test_both_channels_satisfy_the_protocol() -> None:
    relay = MessageChannel("F", RecordDict())
    stream = StreamChannel(FakeLink([]), across_rounds=True)  # type: ignore[arg-type]
    assert isinstance(relay, StageChannel) and isinstance(stream, StageChannel)
    assert (relay.across_rounds, relay.link_per_op) == (False, False)  # one message
    assert (stream.across_rounds, stream.link_per_op) == (True, True)
    assert not StreamChannel(FakeLink([]), across_rounds=False).across_rounds  # type: ignore[arg-type]
    # the relay's channel yields its message's one op, its MB record as the header
    mb = P.MicroBatchGroup(0, 1, 1, round=1).to_config_record()
    relay = MessageChannel("B", RecordDict({P.MB: mb}))
    (header, _), *more = list(relay.frames())
    assert not more and header["op"] == "B" and (header["step"], header["first"]) == (0, 1)
    assert not list(relay.frames())  # once


def _relay(header: dict[str, Any], records: dict[str, Any]) -> RecordDict:
    """``header``'s forward through the relay's handler, after a set-up."""
    client = SkyClient(_model, lambda ctx: None)
    context = Context(1, 102, {}, RecordDict(), {})
    weights = ArrayRecord({k: v.detach() for k, v in _model().state_dict().items()})
    setup = {P.CONFIG: ST.to_config_record(), P.ARRAYS: weights}
    emu = Emulation("n")
    client.setup(Message(RecordDict(setup), dst_node_id=102, message_type=P.SETUP), context, emu)
    mb = P.MicroBatchGroup(header["step"], header["first"], header["count"], ST.round)
    content = RecordDict({P.MB: mb.to_config_record(), **records})
    return client.forward(Message(content, dst_node_id=102, message_type=P.FORWARD), context, emu)


def _stream(
    header: dict[str, Any], records: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[RecordDict, FakeLink]:
    """``header``'s forward frame through the stream's loop (a per-round set-up)."""
    link = FakeLink([({"op": "F", **header}, RecordDict(records))])
    monkeypatch.setattr(stream_node, "connect", lambda *a: link)
    cfg = P.StreamConfig(stage=ST, link=LINK, steps=1, node_id=102)
    weights = ArrayRecord({k: v.detach() for k, v in _model().state_dict().items()})
    node = NodeStage(
        weights,
        _model,
        102,
        lambda rnd: Emulation("n"),
        lambda rnd, step: (torch.zeros(4, 4), torch.zeros(4, dtype=torch.long)),
        resolve(ST.loss),
        resolve(ST.metric),
    )
    reply = stream_node.run_stream_session(cfg, node)
    return reply, link


def _inputs(rows: int, width: int = 4) -> dict[str, Any]:
    return {
        P.ACT: ArrayRecord({P.ACT: torch.ones(rows, width)}),
        P.LABELS: ArrayRecord({P.LABELS: torch.zeros(rows, dtype=torch.long)}),
    }


@pytest.mark.parametrize(
    ("header", "records", "match"),
    [
        ({"step": 0, "first": 1, "count": 2}, _inputs(2), r"micro-batches 1\.\.2 are outside"),
        ({"step": 0, "first": 0, "count": 1}, {}, r"the op's records lack 'act'"),
    ],
)
@pytest.mark.usefixtures("server_identity")  # builds Flower messages
def test_a_malformed_op_is_the_same_error_over_either_channel(
    header: dict[str, Any], records: dict[str, Any], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(MalformedOpError, match=match) as relay:
        _relay(header, records)
    with pytest.raises(MalformedOpError, match=match) as stream:
        _stream(header, records, monkeypatch)
    assert str(relay.value) == str(stream.value)
    assert isinstance(stream.value, P.ProtocolError)  # the relay's handler raises it


@pytest.mark.usefixtures("server_identity")
def test_the_stages_own_error_is_the_same_reply_over_either_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    header, records = {"step": 0, "first": 0, "count": 1}, _inputs(2, width=5)  # wrong width
    relay = _relay(header, records)
    stream, link = _stream(header, records, monkeypatch)
    error = relay[P.STAGE_ERROR]["error"]
    assert error.startswith("RuntimeError") and stream[P.STAGE_ERROR]["error"] == error
    (sent_header, sent), *_ = link.sent
    assert sent_header["error"] is True and sent[P.STAGE_ERROR]["error"] == error
    assert link.closed
