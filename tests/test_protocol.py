"""The Sky wire protocol (fast, no engine): every typed record round-trips, a missing or
wrong-typed key is refused by name, and the node's relay handlers driven only through
:mod:`sky_flower.sky.protocol` train exactly like unsplit training; the fault wrapper
acts only on the configured message type and round."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from reference import ProcessPerMessageGrid, reference_rounds, sky_app_task

from sky_flower.emulation import faults
from sky_flower.emulation.devices import Emulation
from sky_flower.pipeline.direct import Rendezvous
from sky_flower.pipeline.stage import slice_state
from sky_flower.sky import protocol as P
from sky_flower.sky.node.client import SkyClient

STAGE = P.StageConfig(
    stage=1,
    first=2,
    last=3,
    is_first=False,
    is_last=True,
    microbatches=2,
    batch_size=8,
    optimizer="adam",
    lr=0.01,
    round=3,
    seed=7,
)
LINK = P.StreamLink(
    address="127.0.0.1:40123",
    ticket="ab" * 16,
    fingerprint="cd" * 32,
    cert_pem="-----BEGIN CERTIFICATE-----\n...\n-----END CERTIFICATE-----\n",
    max_frame_bytes=1 << 20,
    timeout_s=90.0,
)
EXAMPLES = [
    STAGE,
    dataclasses.replace(STAGE, loss="mymod:my_loss", metric="mymod:my_metric"),
    P.MicroBatchGroup(step=4, first=1, count=1, round=2, session=5),
    P.ProfileRequest(input_shape=(64,), microbatch_size=32, warmup=1, repeats=3),
    P.ProfileRequest(
        input_shape=(3, 8, 8), microbatch_size=4, warmup=0, repeats=1, optimizer="sgd", lr=0.1
    ),
    P.ProfileReply(
        name="box",
        holds_data=True,
        num_examples=10,
        memory_bytes=2**33,
        slowdown=0.5,
        emulation="native speed",
        link_latency_s=0.01,
        link_bandwidth_bps=1e6,
        layer_fwd_s=(0.1, 0.2),
        layer_bwd_s=(0.2, 0.4),
        layer_step_s=(0.0, 0.01),
        state_rebuild_s_per_byte=1e-9,
        state_save_s_per_byte=2e-9,
    ),
    P.EchoRequest(store_bytes=-1),
    P.DirectLinks(0.01, 1e6, 0.02, 2e6, 0.0, 0.0),
    P.DirectConfig(
        stage=STAGE,
        rendezvous=Rendezvous("127.0.0.1", 29500, "abc", 1, 3, "t1", 5.0, 30.0),
        links=P.DirectLinks(link_latency_s=0.01),
        kind="1f1b",
        steps=5,
        input_shape=(32,),
        node_id=12345678901,
    ),
    P.StreamConfig(stage=STAGE, link=LINK, steps=4, node_id=12345678901),
    LINK,
    P.StepMetrics(loss=0.5, correct=3, n=8, compute_s=0.01),
    P.DirectMetrics(
        losses=(1.0, 0.5), correct=4, n=8, step_times_s=(0.1, 0.2), setup_s=0.3, compute_s=0.2
    ),
    P.SessionId(round=3, session=9),
]


def test_every_record_class_has_an_example():
    assert {type(e) for e in EXAMPLES} == set(P.RECORDS)


@pytest.mark.parametrize("obj", EXAMPLES, ids=lambda o: type(o).__name__)
def test_round_trip(obj):
    cls = type(obj)
    rec = obj.to_config_record()
    assert isinstance(rec, ConfigRecord)
    assert set(rec) <= set(cls.keys())
    assert len(set(cls.keys())) == len(cls.keys())  # no nested key collides
    assert cls.from_config_record(rec) == obj
    typed = obj.to_record()
    assert isinstance(typed, cls.record_type)
    assert cls.from_record(typed) == obj


@pytest.mark.parametrize(
    "obj",
    [e for e in EXAMPLES if not isinstance(e, (P.EchoRequest, P.DirectLinks))],  # all optional
    ids=lambda o: type(o).__name__,
)
def test_a_missing_required_key_is_named(obj):
    cls = type(obj)
    rec = dict(obj.to_config_record())
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.name in rec
    ]
    assert required
    del rec[required[0]]
    with pytest.raises(P.ProtocolError, match=rf"{cls.__name__}(\.\w+)?: the record lacks key"):
        cls.from_config_record(rec)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("lr", "fast", "key 'lr' must be float, got str 'fast'"),
        ("first", 2.0, "key 'first' must be int, got float"),
        ("stage", True, "key 'stage' must be int, got bool"),
        ("is_last", 1, "key 'is_last' must be bool, got int"),
        ("optimizer", 3, "key 'optimizer' must be str"),
    ],
)
def test_a_wrong_typed_key_is_named(key, value, expected):
    rec = {**STAGE.to_config_record(), key: value}
    with pytest.raises(P.ProtocolError, match=expected):
        P.StageConfig.from_config_record(rec)


def test_lists_nested_records_and_defaults():
    with pytest.raises(P.ProtocolError, match=r"key 'input_shape\[1\]' must be int"):
        P.ProfileRequest.from_config_record(
            {"input_shape": [3, "8"], "microbatch_size": 1, "warmup": 0, "repeats": 1}
        )
    with pytest.raises(P.ProtocolError, match="key 'input_shape' must be a list"):
        P.ProfileRequest.from_config_record(
            {"input_shape": 3, "microbatch_size": 1, "warmup": 0, "repeats": 1}
        )
    direct = EXAMPLES[8]
    rec = dict(direct.to_config_record())
    assert len(rec) == 38  # the 27 keys of the direct round + is_first, is_last, loss, metric,
    # input_dtype, session, chunk_layers, chunk_shapes, backend (issue 31), reduction, weight
    del rec["join_timeout_s"], rec["backend"]  # the Rendezvous defaults hold (defined there)
    defaults = {f.name: f.default for f in dataclasses.fields(Rendezvous)}
    got = P.DirectConfig.from_config_record(rec).rendezvous
    assert (got.join_timeout_s, got.backend) == (defaults["join_timeout_s"], "gloo")
    del rec["ticket"]
    with pytest.raises(
        P.ProtocolError, match="DirectConfig.rendezvous: the record lacks key 'ticket'"
    ):
        P.DirectConfig.from_config_record(rec)
    with pytest.raises(P.ProtocolError, match="rank 3 outside a world of 3"):
        P.DirectConfig.from_config_record({**direct.to_config_record(), "rank": 3})
    with pytest.raises(P.ProtocolError, match="not divisible into 3 micro-batches"):
        P.StageConfig.from_config_record({**STAGE.to_config_record(), "microbatches": 3})
    with pytest.raises(P.ProtocolError, match="no record"):
        P.StageConfig.from_config_record(None)
    extra = {**STAGE.to_config_record(), "local-epochs": 1}  # the run's own train config
    assert P.StageConfig.from_config_record(extra) == STAGE
    assert P.EchoRequest.from_config_record({}) == P.EchoRequest(0)
    with pytest.raises(P.ProtocolError, match="outside the step's 2"):
        P.MicroBatchGroup(0, 1, 2, 1).check(2)


def test_message_types_are_flower_types():
    assert len(set(P.MESSAGE_TYPES)) == len(P.MESSAGE_TYPES)
    for mtype in P.MESSAGE_TYPES:
        kind, action = mtype.split(".")
        assert kind in ("train", "query") and P.action(mtype) == action


@pytest.fixture
def server_identity(monkeypatch):
    for attr, value in (("_run_id", 1), ("_node_id", SUPERLINK_NODE_ID), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)  # as a ServerApp process has them


def _send(grid: ProcessPerMessageGrid, nid: int, mtype: str, content: dict) -> Message:
    msg = Message(RecordDict(content), dst_node_id=nid, message_type=mtype, group_id="1")
    (reply,) = grid.pull_messages(grid.push_messages([msg]))
    assert not reply.has_error(), reply.error.reason
    return reply


@pytest.mark.parametrize("group", [2, 1])
def test_node_relay_through_the_protocol_equals_unsplit_training(server_identity, group):
    """Two stages on two nodes, 2 micro-batches per step in groups of ``group`` (2: the
    ``sequential`` relay), driven message by message with the protocol's names only."""
    task = sky_app_task()
    data = task.load_data(0, 1)
    fleet = [Emulation("a", holds_data=True), Emulation("b")]

    def app() -> ClientApp:
        client = SkyClient(
            task.Net,
            lambda ctx: data if ctx.node_id == 101 else None,
            lambda ctx: fleet[ctx.node_id - 101],
        )
        return client.register(ClientApp())

    grid = ProcessPerMessageGrid(app, [{}, {}], {})
    model = task.Net()
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n_layers = len(model)
    bounds = [(0, 1), (2, n_layers - 1)]
    steps, M, B = 3, 2, 64
    for k, (first, last) in enumerate(bounds):
        st = dataclasses.replace(
            STAGE,
            stage=k,
            first=first,
            last=last,
            is_first=k == 0,
            is_last=k == 1,
            microbatches=M,
            batch_size=B,
            optimizer="adam",
            lr=0.01,
            round=1,
            seed=0,
        )
        content = {
            P.ARRAYS: ArrayRecord(slice_state(full, first, last)),
            P.CONFIG: st.to_config_record(),
        }
        _send(grid, 101 + k, P.SETUP, content)
    losses = []
    for step in range(steps):
        loss = 0.0
        for g in range(M // group):
            mb = P.MicroBatchGroup(step, g * group, group, round=1).to_config_record()
            r0 = _send(grid, 101, P.FORWARD, {P.MB: mb})
            content = {P.MB: mb, P.ACT: r0.content[P.ACT], P.LABELS: r0.content[P.LABELS]}
            r1 = _send(grid, 102, P.FORWARD, content)
            m = P.StepMetrics.from_record(r1.content.metric_records[P.METRICS])
            assert m.n == B // M * group and P.BUSY_S in r1.content.metric_records[P.METRICS]
            loss += m.loss
            _send(grid, 101, P.BACKWARD, {P.MB: mb, P.GRAD: r1.content[P.GRAD]})
        losses.append(loss)
    got = {}
    for nid in (101, 102):
        got.update(_send(grid, nid, P.COLLECT, {}).content[P.ARRAYS].to_torch_state_dict())
    weights, ref_losses = reference_rounds(task.Net, data, 1, steps, 0.01, B, M, weights=full)[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for key, value in weights.items():
        np.testing.assert_allclose(got[key].numpy(), value.numpy(), rtol=1e-4, atol=1e-6)


def _echo_handler(msg: Message, context: object, emu: Emulation) -> RecordDict:
    return RecordDict(
        {"payload": ArrayRecord({"p": torch.ones(4)}), "metrics": MetricRecord({"hook": 0})}
    )


@pytest.mark.parametrize("mode", ["raise", "malformed", "crash"])
def test_fault_wrapper_acts_only_on_its_message_type_and_round(server_identity, mode):
    emu = Emulation("box", fail_on=P.FORWARD, fail_mode=mode, fail_round=2)
    seen: list[object] = []

    def handler(msg: Message, context: object, e: Emulation) -> RecordDict:
        seen.append(faults.step_hook())
        return _echo_handler(msg, context, e)

    wrapped = faults.inject(handler)

    def msg(mtype: str, rnd: int) -> Message:
        cfg = ConfigRecord({"round": rnd, "timeout_s": 1.0})
        return Message(RecordDict({"config": cfg}), dst_node_id=1, message_type=mtype)

    for mtype, rnd in ((P.BACKWARD, 2), (P.FORWARD, 1)):  # not its type / not its round
        out = wrapped(msg(mtype, rnd), None, emu)
        assert out.array_records["payload"]["p"].shape == (4,) and seen[-1] is None
    if mode == "raise":
        with pytest.raises(faults.FaultInjected, match="fault injected on train.sky_forward"):
            wrapped(msg(P.FORWARD, 2), None, emu)
        assert len(seen) == 2  # the handler did not run
    elif mode == "malformed":
        out = wrapped(msg(P.FORWARD, 2), None, emu)
        assert out.array_records["payload"]["p"].shape == (1,)
    else:  # the hook is set while handling; a handler that never calls it loses the reply
        with pytest.raises(faults.FaultInjected, match="crashed on train.sky_forward"):
            wrapped(msg(P.FORWARD, 2), None, emu)
        assert callable(seen[-1]) and faults.step_hook() is None  # only while handling


def test_registered_clientapp_pickles():
    """Flower's simulation engine sends the ClientApp to its Ray actors (cloudpickle)."""
    import cloudpickle

    task = sky_app_task()
    fleet = [Emulation("a", holds_data=True, fail_on=P.DIRECT, fail_mode="crash")]
    app = SkyClient(task.Net, lambda ctx: None, lambda ctx: fleet[0]).register(ClientApp())
    assert isinstance(cloudpickle.loads(cloudpickle.dumps(app)), ClientApp)
