"""The pipeline simulator against hand-worked cases, its closed forms, and its own invariants."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from sky_flower.core.simulate import KINDS, simulate, stage_order

TIME = st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=10.0))


@st.composite
def instances(draw, max_stages=6, max_mb=6):
    s = draw(st.integers(1, max_stages))
    m = draw(st.integers(1, max_mb))
    f = draw(st.lists(TIME, min_size=s, max_size=s))
    b = draw(st.lists(TIME, min_size=s, max_size=s))
    fl = draw(st.lists(TIME, min_size=s - 1, max_size=s - 1))
    bl = draw(st.lists(TIME, min_size=s - 1, max_size=s - 1))
    return f, b, fl, bl, m


def gpipe_step_time(f, b, fl, bl, m):
    """The module docstring's closed form of the ``gpipe`` order."""
    fwd, bwd = [*f, *fl], [*b, *bl]
    return (math.fsum(fwd) + (m - 1) * max(fwd)) + (math.fsum(bwd) + (m - 1) * max(bwd))


def steady_state_time(f, b, fl, bl):
    """The busiest resource's work per micro-batch: ``M`` times it bounds every kind."""
    return max([x + y for x, y in zip(f, b, strict=True)] + list(fl) + list(bl))


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def check_timeline(f, b, fl, bl, m, kind, res):
    """Durations, resource exclusivity, per-resource order, dependencies, no idle delay."""
    s = len(f)
    ops = {(o.resource, o.kind, o.microbatch): o for o in res.ops}
    assert len(ops) == len(res.ops) == 2 * s * m + 2 * (s - 1) * m
    eps = 1e-9
    orders = stage_order(kind, s, m)
    for k in range(s):
        seq = [ops[(f"stage{k}", a.op, a.microbatch)] for a in orders[k]]
        free = 0.0
        for o in seq:
            want = f[k] if o.kind == "F" else b[k]
            assert close(o.end_s - o.start_s, want)
            # inputs of this op
            deps = []
            if o.kind == "F" and k > 0:
                deps.append(ops[(f"link{k - 1}>{k}", "SF", o.microbatch)].end_s)
            if o.kind == "B":
                deps.append(ops[(f"stage{k}", "F", o.microbatch)].end_s)
                if k < s - 1:
                    deps.append(ops[(f"link{k + 1}>{k}", "SB", o.microbatch)].end_s)
            assert o.start_s >= free - eps and all(o.start_s >= d - eps for d in deps)
            assert close(o.start_s, max([free, *deps]))  # starts as soon as it can
            free = o.end_s
    for k in range(s - 1):
        for name, kind_, dur, src in (
            (f"link{k}>{k + 1}", "SF", fl[k], (f"stage{k}", "F")),
            (f"link{k + 1}>{k}", "SB", bl[k], (f"stage{k + 1}", "B")),
        ):
            free = 0.0
            for i in range(m):  # FIFO: readiness order is micro-batch order here
                o = ops[(name, kind_, i)]
                ready = ops[(*src, i)].end_s
                assert close(o.end_s - o.start_s, dur)
                assert o.start_s >= free - eps and o.start_s >= ready - eps
                assert close(o.start_s, max(free, ready))
                free = o.end_s
    assert close(res.step_time_s, max(o.end_s for o in res.ops))
    starts = [o.start_s for o in res.ops]
    assert starts == sorted(starts)
    for name, busy in res.busy_s.items():
        assert close(busy, sum(o.end_s - o.start_s for o in res.ops if o.resource == name))
    assert len(res.busy_s) == s + 2 * (s - 1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 2, 5])
def test_single_stage_is_m_times_f_plus_b(kind, m):
    res = simulate([1.5], [2.25], [], [], m, kind)
    assert res.step_time_s == pytest.approx(m * 3.75)
    assert res.busy_s == {"stage0": pytest.approx(m * 3.75)}


def test_hand_worked_two_stages():
    # S=2, M=2, f=(1,2), b=(3,4), links fwd 0.5, bwd 0.25.
    # gpipe: stage0 F0 0-1, F1 1-2; link SF0 1-1.5, SF1 2-2.5; stage1 F0 1.5-3.5,
    # F1 3.5-5.5, B0 5.5-9.5, B1 9.5-13.5; SB0 9.5-9.75, SB1 13.5-13.75;
    # stage0 B0 9.75-12.75, B1 13.75-16.75.
    a = ([1.0, 2.0], [3.0, 4.0], [0.5], [0.25])
    res = simulate(*a, 2, "gpipe")
    assert res.step_time_s == pytest.approx(16.75)
    assert gpipe_step_time(*a, 2) == pytest.approx(16.75)
    # 1f1b: stage0 warm-up F0 0-1, then F1 1-2, B0 9.75-12.75, B1 13.75-16.75 (same here).
    assert simulate(*a, 2, "1f1b").step_time_s == pytest.approx(16.75)
    # sequential: one micro-batch takes 1+0.5+2+4+0.25+3 = 10.75
    assert simulate(*a, 2, "sequential").step_time_s == pytest.approx(21.5)
    assert res.busy_s == pytest.approx(
        {"stage0": 8.0, "stage1": 12.0, "link0>1": 1.0, "link1>0": 0.5}
    )


@given(instances(), st.sampled_from(KINDS))
@settings(max_examples=examples(150), deadline=None)
def test_timeline_is_consistent(inst, kind):
    f, b, fl, bl, m = inst
    check_timeline(f, b, fl, bl, m, kind, simulate(f, b, fl, bl, m, kind))


@given(instances())
@settings(max_examples=examples(200), deadline=None)
def test_sequential_is_m_critical_paths(inst):
    f, b, fl, bl, m = inst
    one = sum(f) + sum(b) + sum(fl) + sum(bl)
    assert close(simulate(f, b, fl, bl, m, "sequential").step_time_s, m * one)


@given(instances(max_stages=8, max_mb=10))
@settings(max_examples=examples(300), deadline=None)
def test_gpipe_closed_form_is_exact(inst):
    f, b, fl, bl, m = inst
    sim = simulate(f, b, fl, bl, m, "gpipe").step_time_s
    assert math.isclose(sim, gpipe_step_time(f, b, fl, bl, m), rel_tol=1e-9, abs_tol=1e-12)


@given(
    st.integers(1, 8),
    st.integers(1, 10),
    st.floats(0.0, 10.0),
    st.floats(0.0, 10.0),
    st.sampled_from(["gpipe", "1f1b"]),
)
@settings(max_examples=examples(200), deadline=None)
def test_uniform_stages_no_links(s, m, f, b, kind):
    res = simulate([f] * s, [b] * s, [0.0] * (s - 1), [0.0] * (s - 1), m, kind)
    assert close(res.step_time_s, (m + s - 1) * (f + b))


@given(instances(), st.sampled_from(KINDS))
@settings(max_examples=examples(200), deadline=None)
def test_lower_bounds(inst, kind):
    f, b, fl, bl, m = inst
    step = simulate(f, b, fl, bl, m, kind).step_time_s
    eps = 1e-9 * max(step, 1.0)
    assert step >= m * max(x + y for x, y in zip(f, b, strict=True)) - eps
    assert step >= m * steady_state_time(f, b, fl, bl) - eps
    assert step >= sum(f) + sum(b) + sum(fl) + sum(bl) - eps


@given(instances())
@settings(max_examples=examples(200), deadline=None)
def test_pipelining_never_slower_than_sequential(inst):
    f, b, fl, bl, m = inst
    seq = simulate(f, b, fl, bl, m, "sequential").step_time_s
    eps = 1e-9 * max(seq, 1.0)
    assert simulate(f, b, fl, bl, m, "gpipe").step_time_s <= seq + eps
    assert simulate(f, b, fl, bl, m, "1f1b").step_time_s <= seq + eps


@pytest.mark.parametrize("s,m", [(1, 1), (1, 4), (4, 1), (4, 2), (4, 4), (4, 9), (7, 3)])
def test_peak_inflight(s, m):
    a = ([1.0] * s, [2.0] * s, [0.1] * (s - 1), [0.1] * (s - 1), m)
    assert simulate(*a, "1f1b").peak_inflight == [min(s - k, m) for k in range(s)]
    assert simulate(*a, "gpipe").peak_inflight == [m] * s
    assert simulate(*a, "sequential").peak_inflight == [1] * s


def test_1f1b_order_matches_torch_schedule():
    # torch's Schedule1F1B: warm-up min(M, S-k) forwards, then "B, F" pairs, then B's.
    def torch_order(s, m, k):
        w = min(m, s - k)
        order = [("F", i) for i in range(w)]
        fi, bi = w, 0
        while True:
            order.append(("B", bi))
            bi += 1
            if fi == m:
                break
            order.append(("F", fi))
            fi += 1
        order += [("B", i) for i in range(bi, m)]
        return order

    for s in range(1, 7):
        for m in range(1, 9):
            got = [[(a.op, a.microbatch) for a in o] for o in stage_order("1f1b", s, m)]
            assert got == [torch_order(s, m, k) for k in range(s)]


def test_accepts_numpy_arrays():
    f = np.array([1.0, 2.0])
    res = simulate(f, f, np.array([0.5]), np.array([0.5]), np.int64(3), "1f1b")
    assert res.step_time_s > 0


@pytest.mark.parametrize(
    "args,match",
    [
        (([], [], [], [], 1), "fwd_s must be a non-empty"),
        (([1.0], [1.0, 2.0], [], [], 1), r"bwd_s must be a 1-D sequence of length 1"),
        (([1.0, 1.0], [1.0, 1.0], [], [0.0], 1), r"fwd_link_s must be .* length 1"),
        (([1.0, 1.0], [1.0, 1.0], [0.0], [0.0, 0.0], 1), r"bwd_link_s must be .* length 1"),
        (([1.0, -1.0], [1.0, 1.0], [0.0], [0.0], 1), r"fwd_s\[1\] = -1.0"),
        (([1.0], [math.nan], [], [], 1), r"bwd_s\[0\] = nan.*finite"),
        (([1.0, 1.0], [1.0, 1.0], [math.inf], [0.0], 1), r"fwd_link_s\[0\] = inf"),
        (([1.0], [1.0], [], [], 0), "microbatches must be >= 1, got 0"),
        (([1.0], [1.0], [], [], 2.5), "microbatches must be an int"),
        (([1.0], [1.0], [], [], True), "microbatches must be an int"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        simulate(*args)


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"unknown schedule kind 'pipedream'.*gpipe, 1f1b"):
        simulate([1.0], [1.0], [], [], 1, "pipedream")


@pytest.mark.parametrize("s,m", [(1024, 8), (64, 256)])
def test_large_instances_are_fast(s, m):
    import time

    rng = np.random.default_rng(0)
    a = (rng.random(s), rng.random(s), rng.random(s - 1), rng.random(s - 1))
    # this process's CPU time, not wall time: the bound holds on a busy machine (other
    # users, or the other pytest-xdist worker) as on an idle one
    t0 = time.process_time()
    for kind in KINDS:
        simulate(*a, m, kind)
    assert time.process_time() - t0 < 3.0  # about 0.2 s each on a laptop-class CPU
    assert math.isclose(simulate(*a, m).step_time_s, gpipe_step_time(*a, m), rel_tol=1e-9)
