"""The transformer LM on the Python standard library's source: corpus, split equality,
training, and integer inputs through the profile and the direct engine's shape probe."""

import math
import time

import numpy as np
import pytest
import torch
from reference import forkserver, reference_rounds
from torch import nn

from sky_flower.core.example import as_dtype, dtype_name, example_input
from sky_flower.core.profile import profile_layers
from sky_flower.pipeline.direct import RoundHost, run_stage, stage_input_shapes
from sky_flower.pipeline.lm import (
    build_transformer_lm,
    lm_cross_entropy,
    perplexity,
    token_correct,
)
from sky_flower.pipeline.stage import StageExecutor, build_stage, run_split_step, slice_state
from sky_flower.pipeline.text import BLOCK_WINDOWS, load_python_source, python_source_bytes

T = 16
LM = {"vocab_size": 256, "seq_len": T, "d_model": 32, "n_heads": 4, "n_layers": 3}


def _lm():
    return build_transformer_lm(**LM, dropout=0.0)


# --- corpus ---------------------------------------------------------------------------


def test_corpus_is_next_token_windows_split_by_blocks():
    t0 = time.perf_counter()
    train, test = load_python_source(0.1, seed=0, seq_len=T, max_chars=200_000)
    print(f"load_python_source(200 kB): {time.perf_counter() - t0:.3f} s")
    assert train.x.dtype == np.int64 and train.y.dtype == np.int64
    assert train.x.shape[1] == T and test.y.shape[1] == T
    assert train.x.min() >= 0 and train.x.max() < 256
    # labels are the inputs shifted by one token
    np.testing.assert_array_equal(train.y[:, :-1], train.x[:, 1:])
    assert (len(train) + len(test)) % BLOCK_WINDOWS == 0 and len(test) % BLOCK_WINDOWS == 0
    # the text is real Python source
    assert b"def " in bytes(train.x[:200].astype(np.uint8).ravel())
    # train and test are contiguous blocks of the text at disjoint block offsets
    text = python_source_bytes(200_000).tobytes()
    span = BLOCK_WINDOWS * T

    def block_offsets(split):
        out = set()
        for b in range(0, len(split), BLOCK_WINDOWS):
            block = split.x[b : b + BLOCK_WINDOWS].astype(np.uint8).tobytes()
            at = text.find(block)
            assert at >= 0 and at % span == 0  # a contiguous, block-aligned stretch
            out.add(at)
        return out

    test_at, train_at = block_offsets(test), block_offsets(train)
    assert not test_at & train_at
    assert len(test_at) == round(0.1 * (len(test_at) + len(train_at)))


def test_corpus_is_deterministic_and_seeded():
    a_tr, a_te = load_python_source(0.2, seed=3, seq_len=T, max_chars=100_000)
    b_tr, b_te = load_python_source(0.2, seed=3, seq_len=T, max_chars=100_000)
    c_tr, _ = load_python_source(0.2, seed=4, seq_len=T, max_chars=100_000)
    np.testing.assert_array_equal(a_tr.x, b_tr.x)
    np.testing.assert_array_equal(a_te.y, b_te.y)
    assert not np.array_equal(a_tr.x, c_tr.x)


@pytest.mark.parametrize("kwargs", [{"test_fraction": 0.0}, {"seq_len": 0}, {"max_chars": 100}])
def test_corpus_refuses_bad_input(kwargs):
    args = {"test_fraction": 0.1, "seed": 0, "seq_len": T, "max_chars": 100_000, **kwargs}
    with pytest.raises(ValueError):
        load_python_source(**args)


# --- model and objective --------------------------------------------------------------


def test_lm_shapes_and_objective():
    model = _lm()
    assert len(model) == LM["n_layers"] + 3
    ids = torch.randint(0, 256, (4, T))
    logits = model(ids)
    assert logits.shape == (4, T, 256)
    loss = lm_cross_entropy(logits, ids).detach()
    assert loss.shape == () and abs(float(loss) - math.log(256)) < 0.5  # untrained
    assert token_correct(logits, logits.argmax(-1)) == 4 * T
    assert token_correct(logits, (logits.argmax(-1) + 1) % 256) == 0
    assert perplexity(0.0) == 1.0 and perplexity(1e6) == float("inf")


def test_lm_is_causal():
    model = _lm()
    ids = torch.randint(0, 256, (2, T))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    torch.testing.assert_close(model(ids)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(ids)[:, 10:], model(changed)[:, 10:])


def test_lm_refuses_heads_not_dividing_width():
    with pytest.raises(ValueError, match="divisible"):
        build_transformer_lm(d_model=30, n_heads=4)


# --- split equals whole ---------------------------------------------------------------

PLANS = [[(0, 2), (3, 5)], [(0, 1), (2, 3), (4, 5)]]


@pytest.mark.parametrize("bounds", PLANS)
@pytest.mark.parametrize("microbatches", [1, 2])
def test_split_lm_equals_whole_logits_and_gradients(bounds, microbatches):
    torch.manual_seed(0)
    whole = _lm()
    state = {k: v.clone() for k, v in whole.state_dict().items()}
    x, y = torch.randint(0, 256, (8, T)), torch.randint(0, 256, (8, T))
    stages = [build_stage(_lm, a, b, slice_state(state, a, b)) for a, b in bounds]
    # logits: the chain of stages is the model
    h = x
    for st in stages:
        h = st(h)
    torch.testing.assert_close(h, whole(x), rtol=0, atol=1e-6)
    # gradients: the whole model's over the same micro-batches
    for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
        (lm_cross_entropy(whole(xm), ym) / microbatches).backward()
    grads = {k: p.grad for k, p in whole.named_parameters()}
    # one SGD step of lr 1 through the split: w_before - w_after is the split's gradient
    execs = [
        StageExecutor(m, torch.optim.SGD(m.parameters(), lr=1.0), microbatches) for m in stages
    ]
    run_split_step(execs, x, y, loss_fn=lm_cross_entropy, metric_fn=token_correct)
    split_grads = {}
    for ex in execs:
        for k, p in ex.module.named_parameters():
            split_grads[k] = state[k] - p.detach()
    assert split_grads.keys() == grads.keys()
    for k, g in grads.items():
        torch.testing.assert_close(split_grads[k], g, rtol=0, atol=1e-6, msg=k)


# --- it learns --------------------------------------------------------------------------


def test_lm_trains_on_python_source():
    """A few Adam steps on the corpus: training loss falls well below the uniform
    ln 256 = 5.55 nats; the held-out perplexity is printed."""
    torch.manual_seed(0)
    train, test = load_python_source(0.1, seed=0, seq_len=32, max_chars=300_000)
    model = build_transformer_lm(seq_len=32, d_model=64, n_heads=4, n_layers=2, dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    steps, losses = 40, []
    for _ in range(steps):
        idx = rng.choice(len(train), 32, replace=False)
        loss = lm_cross_entropy(
            model(torch.from_numpy(train.x[idx])), torch.from_numpy(train.y[idx])
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        xt, yt = torch.from_numpy(test.x[:256]), torch.from_numpy(test.y[:256])
        logits = model(xt)
        test_loss = float(lm_cross_entropy(logits, yt))
        acc = token_correct(logits, yt) / yt.numel()
    print(
        f"LM {steps} steps: train loss {losses[0]:.2f} -> {np.mean(losses[-5:]):.2f}, "
        f"test perplexity {perplexity(test_loss):.1f}, token accuracy {acc:.3f}"
    )
    assert np.mean(losses[-5:]) < losses[0] - 1.5
    assert perplexity(test_loss) < 40  # uniform: 256


# --- integer inputs -------------------------------------------------------------------


def test_example_input_by_dtype():
    before = torch.get_rng_state()
    ids = example_input(3, (T,), "int64")
    assert ids.dtype == torch.int64 and ids.shape == (3, T) and not ids.any()
    x = example_input(2, [5])
    assert x.dtype == torch.float32 and x.std() > 0
    torch.testing.assert_close(x, example_input(2, [5]))  # private generator: repeatable
    assert torch.equal(before, torch.get_rng_state())  # the global RNG is untouched
    assert as_dtype("torch.int64") is torch.int64 and dtype_name(torch.long) == "int64"
    with pytest.raises(ValueError, match="dtype"):
        as_dtype("int65")


def test_profile_takes_token_ids():
    profiles = profile_layers(_lm(), (T,), microbatch_size=4, dtype=torch.int64)
    assert len(profiles) == LM["n_layers"] + 3
    emb = profiles[0]
    assert emb.act_in_bytes == T * 8  # int64 ids
    assert emb.act_out_bytes == T * LM["d_model"] * 4
    assert profiles[-1].act_out_bytes == T * 256 * 4
    assert all(p.fwd_flops > 0 for p in profiles[1:-2] + profiles[-1:])  # blocks, head


def test_stage_input_shapes_of_token_ids():
    shapes = stage_input_shapes(_lm, [T], [(0, 0), (1, 3), (4, 5)], "int64")
    assert shapes == [(T,), (T, LM["d_model"]), (T, LM["d_model"])]


def _lm_direct_worker(rdv, bounds, weights, batches, shape, queue) -> None:  # noqa: ANN001
    """One stage of the LM on the direct engine (rank 0 feeds int64 token ids)."""
    torch.set_num_threads(1)
    try:
        module = build_stage(_lm, *bounds, slice_state(weights, *bounds))
        res = run_stage(
            rdv,
            module,
            torch.optim.Adam(module.parameters(), lr=1e-3),
            "gpipe",
            2,
            len(batches),
            8,
            shape,
            batch_fn=(lambda s: batches[s]) if rdv.rank == 0 else None,
            loss_fn=lm_cross_entropy,
            metric_fn=token_correct,
            input_dtype="int64" if rdv.rank == 0 else None,
        )
        state = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
        queue.put((rdv.rank, res, state))  # numpy: a torch tensor would need this process
    except Exception as err:  # noqa: BLE001 - reported to the test
        queue.put((rdv.rank, repr(err), None))


@pytest.mark.processes
def test_direct_engine_trains_the_lm_on_token_ids_like_the_whole_model():
    """Integer inputs through the direct engine's shape probe, ``(B, T)`` int64 labels to
    the last stage (header + labels), LM loss: weights equal unsplit training."""
    torch.manual_seed(0)
    weights = _lm().state_dict()
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 256, (8, T), generator=gen), torch.randint(0, 256, (8, T), generator=gen))
        for _ in range(2)
    ]
    bounds = [(0, 2), (3, 5)]
    shapes = stage_input_shapes(_lm, [T], bounds, "int64")
    ctx = forkserver()
    queue = ctx.Queue()
    with RoundHost(2, timeout_s=60.0) as host:
        procs = [
            ctx.Process(
                target=_lm_direct_worker,
                args=(host.rendezvous(k), bounds[k], weights, batches, shapes[k], queue),
            )
            for k in range(2)
        ]
        for p in procs:
            p.start()
        got = dict((r, (res, st)) for r, res, st in (queue.get(timeout=120) for _ in procs))
        for p in procs:
            p.join(timeout=10)
    assert all(st is not None for _, st in got.values()), got
    merged = {k: torch.from_numpy(v) for r in (0, 1) for k, v in got[r][1].items()}
    ((expected, losses),) = reference_rounds(
        _lm, batches, 1, 2, 1e-3, microbatches=2, weights=weights, loss_fn=lm_cross_entropy
    )
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-4, atol=1e-6, msg=key)
    last = got[1][0]
    assert last.samples == 2 * 8 * T  # labels counted: tokens
    np.testing.assert_allclose(last.losses, losses, rtol=1e-5)


def test_server_evaluation_reports_perplexity_only_for_the_language_model():
    from flwr.app import ArrayRecord

    from sky_flower.jobs.sky import evaluate_fn_for
    from sky_flower.pipeline.data import Split

    lm = build_transformer_lm(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    ids = torch.randint(0, 16, (4, 8))
    test = Split(ids.numpy(), torch.roll(ids, -1, 1).numpy())
    arrays = ArrayRecord(lm.state_dict())
    found = evaluate_fn_for(lambda: lm, test, lm_cross_entropy, token_correct)(1, arrays)
    assert found["perplexity"] == pytest.approx(math.exp(found["loss"]))
    digits = nn.Linear(3, 2)
    test = Split(torch.randn(5, 3).numpy(), torch.randint(0, 2, (5,)).numpy())
    found = evaluate_fn_for(lambda: digits, test)(1, ArrayRecord(digits.state_dict()))
    assert "perplexity" not in found and 0.0 <= found["accuracy"] <= 1.0
