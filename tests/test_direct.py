"""The direct transport's engine (sky_flower/pipeline/direct.py): real gloo process groups in
local processes, no Flower."""

from __future__ import annotations

import os
import time

import pytest
import torch
from reference import forkserver, reference_rounds

from sky_flower.pipeline.direct import (
    PEER_FAILURE,
    DirectStageError,
    RankRefusedError,
    Rendezvous,
    RoundHost,
    run_local,
    run_stage,
    stage_input_shapes,
)
from sky_flower.pipeline.models import build_model
from sky_flower.pipeline.stage import RngKey, build_stage

MODEL = {"name": "mlp", "hidden_width": 32, "hidden_layers": 3}
ROUND_TIMEOUT_S = 2.0  # the failure tests' round timeout (every peer operation)
STALL_S = 6.0  # a stalled stage's silence: far longer than the round timeout (2 s)


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["1f1b"])  # gpipe: tests/test_process_per_message.py
def test_local_pipeline_equals_unsplit_training(kind):
    torch.manual_seed(0)
    weights = build_model(MODEL).state_dict()
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen))
        for _ in range(3)
    ]
    # stage processes from the forkserver, which preloaded torch (a spawned stage imports
    # it again, ~4 s); run_local's default, spawn, is the zero_bubble case below (make
    # test-all) and the benchmarks' (python -m sky_flower.bench.schedules)
    merged, results = run_local(
        MODEL,
        [(0, 1), (2, 2), (3, 3)],
        weights,
        batches,
        kind=kind,
        microbatches=4,
        lr=1e-3,
        mp_context=forkserver(),
    )
    ((expected, _),) = reference_rounds(
        lambda: build_model(MODEL), batches, 1, 3, 1e-3, microbatches=4, weights=weights
    )
    assert set(merged) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-4, atol=1e-6)
    assert len(results[-1].losses) == 3 and results[-1].samples == 48
    assert all(len(r.step_times_s) == 3 and r.compute_s > 0 for r in results)


CNN_BN = {
    "_target_": "sky_flower.pipeline.models.build_cnn_bn",
    "channels": [4, 8, 8],
    "hidden": 16,
}


@pytest.mark.processes
@pytest.mark.parametrize(
    "kind",
    # zero_bubble in make test: tests/test_process_per_message.py
    ["interleaved", pytest.param("zero_bubble", marks=pytest.mark.slow)],
)
def test_chunked_schedules_equal_unsplit_training(kind):
    # 2 ranks x 2 chunks (chunk c on rank c % 2) of a CNN with BatchNorm and Dropout:
    # weights and BatchNorm buffers after 2 steps equal the unsplit model's. SGD: a conv
    # bias before a BatchNorm has a zero gradient up to rounding, which Adam amplifies to
    # a full step of either sign (the reference calls the loss once on the whole batch,
    # a different order of operations from the per-micro-batch losses)
    torch.manual_seed(0)
    weights = build_model(CNN_BN).state_dict()
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen))
        for _ in range(2)
    ]
    merged, results = run_local(
        CNN_BN,
        [(0, 0), (1, 1), (2, 3), (4, 4)],
        weights,
        batches,
        kind=kind,
        microbatches=4,
        optimizer="sgd",
        lr=0.1,
        ranks=2,
        rng=RngKey(0, 1),  # reference_rounds' first round
        # interleaved from the forkserver; zero_bubble (make test-all) spawns its stages:
        # run_local's default context
        mp_context=forkserver() if kind == "interleaved" else None,
    )
    ((expected, _),) = reference_rounds(
        lambda: build_model(CNN_BN),
        batches,
        1,
        2,
        0.1,
        microbatches=4,
        weights=weights,
        optimizer="sgd",
    )
    assert set(merged) == set(expected)
    assert any("running_mean" in k for k in expected)
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-4, atol=1e-6)
    assert len(results) == 2 and len(results[-1].losses) == 2 and results[-1].samples == 32


def test_stage_input_shapes():
    shapes = stage_input_shapes(lambda: build_model(MODEL), [64], [(0, 0), (1, 2), (3, 3)])
    assert shapes == [(64,), (32,), (32,)]


def test_wrong_ticket_is_refused_before_joining():
    with RoundHost(2, timeout_s=5.0) as host:
        good = host.rendezvous(1)
        bad = Rendezvous(good.host, good.port, good.key, 1, 2, "not-the-ticket", 5.0)
        module = build_stage(lambda: build_model(MODEL), 3, 3)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        t0 = time.monotonic()
        with pytest.raises(RankRefusedError, match="rank 1 refused: this node's ticket"):
            run_stage(bad, module, opt, "gpipe", 1, 1, 8, [32])
        assert time.monotonic() - t0 < 5.0  # refused at once, not after a timeout
        assert not torch.distributed.is_initialized()


def _failing_worker(rdv: Rendezvous, mode: str, queue) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    bounds = [(0, 1), (2, 2), (3, 3)][rdv.rank]
    module = build_stage(lambda: build_model(MODEL), *bounds)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)

    def fault(step: int) -> None:
        if mode == "kill" and step == 2:
            os._exit(1)  # killed mid-round: no clean-up at all
        if mode == "stall" and step == 2:
            time.sleep(STALL_S)  # silent, far longer than the round timeout

    t0 = time.monotonic()
    try:
        run_stage(
            rdv,
            module,
            opt,
            "1f1b",
            4,
            50,
            8,
            [(64,), (32,), (32,)][rdv.rank],
            batch_fn=lambda s: (torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,))),
            fault=fault,
        )
        queue.put((rdv.rank, "finished", time.monotonic() - t0))
    except DirectStageError as err:
        queue.put((rdv.rank, str(err), time.monotonic() - t0))


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_failed_stage_ends_the_round_for_all_within_the_timeout(mode):
    """Stage 1's process dies mid-round (os._exit) or stalls (``STALL_S``): stages 0 and
    2 stop with an error saying a peer failed, within the ``ROUND_TIMEOUT_S`` round
    timeout (not the 30 s join timeout), and every process ends by itself."""
    ctx = forkserver()  # fresh processes, without importing torch in each
    queue = ctx.Queue()
    with RoundHost(3, timeout_s=ROUND_TIMEOUT_S, join_timeout_s=30.0) as host:
        procs = [
            ctx.Process(
                target=_failing_worker, args=(host.rendezvous(k), mode if k == 1 else "", queue)
            )
            for k in range(3)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
        alive = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
    assert not alive, f"processes still running: {alive}"
    got = {}
    while not queue.empty():
        rank, msg, elapsed = queue.get()
        got[rank] = (msg, elapsed)
    assert set(got) == ({0, 2} if mode == "kill" else {0, 1, 2})
    for rank in (0, 2):
        msg, elapsed = got[rank]
        assert msg.startswith(f"stage {rank} of 3") and PEER_FAILURE in msg
        assert elapsed < STALL_S - 1.0  # stopped before the stalled stage woke up
    if mode == "kill":
        assert procs[1].exitcode == 1
