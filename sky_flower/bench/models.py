"""Model benchmark: ``python -m sky_flower.bench.models [--models a,b] [--out DIR]``.

Figures for issue 40 ("any model a Flower user brings"), one row per model of the zoo
(:data:`sky_flower.bench.zoo.ZOO`: Flower's quickstart CNN, a torchvision-style ResNet-18
layout, a BERT classifier with its attention mask and dropout 0.1, tiny random Llama,
Mistral, Qwen2, Phi-3, Gemma, GPT-NeoX, GPT-2 and OPT). It prints figures, it asserts
nothing. Per model:

1. **Conversion**: the wall time of
   :func:`sky_flower.pipeline.graph.as_sequential` on ``example(2)`` (the first model's
   time includes ``torch.export``'s one-time warm-up in the process), the cuts it chose
   (``split_points``) and any warning it gave (a tied parameter merging units).
2. **Units**: entries of the converted ``nn.Sequential``.
3. **Bytes per cut**: the units run one after another on a batch of ``B = 8`` (no
   graph, buffers and the global generator left as they were); each unit's output
   ``numel() * element_size() / B`` but the last's is what crosses the cut after it, per
   sample (a cut that carries several tensors carries them packed as one).
4. **Plan**: the project's planner, without Flower: the converted model profiled
   (:func:`sky_flower.core.profile.profile_layers`, Adam) and timed on this host
   (:func:`sky_flower.core.profile.time_layers`, as ``python -m sky_flower.plan`` does
   for a listed fleet) at micro-batches of 4 (batch 8, 2 micro-batches, GPipe,
   ``direct``), on an emulated fleet of four nodes where the data owner cannot hold the
   model: ``owner`` (x2 slower) is capped at 40% of the whole model's memory as the cost
   model counts it (:meth:`sky_flower.core.cost.CostModel.stage_memory` over all units:
   parameters, gradients, Adam state, activations stashed for both micro-batches);
   ``helper1..3`` (x1, x1.5, x2) at 50% of it, or 1.1 x the largest unit where a unit
   needs more; every node 2 ms latency, 12.5 MB/s (100 Mbit/s). Allocation
   ``heuristic``, objective ``step``: the stages (node: first-last unit) and the
   predicted step time.
5. **Overhead**: one forward + backward (training mode) of the user's module and of its
   conversion on a batch of 8, timed side by side (alternating, median of 20).
6. **Exactness**: two steps (Adam, lr 1e-3, batch 8, 2 micro-batches, seed 0, round 1)
   of :func:`sky_flower.pipeline.stage.run_split_step` on synthetic data in the model's
   format, once with the converted model as one stage (the unsplit reference: one
   :class:`~sky_flower.pipeline.stage.StageExecutor` over all units) and once cut into
   three contiguous stages (two for a model of two units), both from the same weights.
   The max absolute difference over every weight and buffer (BatchNorm running
   statistics included) and whether all are bit-for-bit equal (expected: 0.0, yes).
   Then the same against every single cut: two stages ``0..c-1`` and ``c..`` for each
   ``c``, exact or the error the step raised.
   Data: images ``(B, 3, 32, 32)`` float with labels in ``[0, 10)``; LMs: int64 ids in
   ``[1, vocab)`` with next-token labels and
   :func:`sky_flower.pipeline.lm.lm_cross_entropy`; ``bert_cls``: ids with trailing
   padding (id 0) and labels in ``[0, 3)``.

A step that fails is recorded with its error text in the table and the JSON; the
others still run. torch runs on one thread (as ``tests/reference.py`` trains): the
models are tiny and gain nothing from a second thread, which only competes with the
other jobs of a shared host.

Usage::

    python -m sky_flower.bench.models                      # all models, about 35 s on 2 cores
    python -m sky_flower.bench.models --models llama,gpt2  # a subset

It prints the machine and the tables and writes ``table.md`` and ``results.json`` (the
full per-cut byte lists, the plans, the losses) into ``--out`` (default
``outputs/bench_models_<time>/``).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.bench.zoo import ZOO, ZooModel
from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.example import as_dtype
from sky_flower.core.partition import Plan, partition
from sky_flower.core.profile import (
    NodeProfile,
    default_optimizer_factory,
    profile_layers,
    time_layers,
)
from sky_flower.pipeline.graph import as_sequential
from sky_flower.pipeline.lm import lm_cross_entropy, token_correct
from sky_flower.pipeline.stage import (
    RngKey,
    StageExecutor,
    build_stage,
    run_split_step,
    slice_state,
    stage_optimizer,
    step_batch,
)

BATCH, MICRO, STEPS, LR, SEED, ROUND = 8, 2, 2, 1e-3, 0, 1
SCHEDULE = Schedule(batch_size=BATCH, microbatches=MICRO, kind="gpipe", transport="direct")
OWNER_SHARE, HELPER_SHARE = 0.4, 0.5  # of the whole model's memory
HELPER_SLOWDOWNS = (0.0, 0.5, 1.0)
OWNER_SLOWDOWN = 1.0
LATENCY_S, BANDWIDTH_BPS = 2e-3, 12.5e6
KIB = 1024
ERROR_CHARS = 420  # of an error's text in the table (results.json keeps all of it)


# --------------------------------------------------------------------------------------
# the machine, the data
# --------------------------------------------------------------------------------------
def objective(model: ZooModel) -> tuple[Callable | None, Callable | None]:
    """``(loss_fn, metric_fn)`` for :func:`run_split_step` (None: cross-entropy and
    correct predictions, the defaults)."""
    if model.kind == "lm":
        return lm_cross_entropy, token_correct
    return None, None


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# --------------------------------------------------------------------------------------
# the five measurements
# --------------------------------------------------------------------------------------
def convert(model: ZooModel) -> tuple[nn.Sequential, float, list[str]]:
    """The converted model, the seconds :func:`as_sequential` took, its warnings."""
    module = model.build(SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        seq = as_sequential(module, model.example(2))
        seconds = time.perf_counter() - t0
    said = [str(w.message) for w in caught if "LeafSpec" not in str(w.message)]
    return seq, seconds, said


def overhead(module: nn.Module, seq: nn.Sequential, x: torch.Tensor, repeats: int = 20) -> dict:
    """Milliseconds of one forward + backward (training mode, a sum of the output as the
    loss) of the user's module and of its conversion on ``x``, timed side by side
    (alternating, median of ``repeats`` each, after one warm-up), and their ratio."""
    import statistics

    module, seq = copy.deepcopy(module).train(), copy.deepcopy(seq).train()
    times: dict[str, list[float]] = {"module_ms": [], "converted_ms": []}
    with torch.random.fork_rng(devices=[]):
        for i in range(repeats + 1):
            for key, m in (("module_ms", module), ("converted_ms", seq)):
                t0 = time.perf_counter()
                m(x).float().sum().backward()
                if i:
                    times[key].append((time.perf_counter() - t0) * 1e3)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["ratio"] = out["converted_ms"] / out["module_ms"]
    return out


def cut_bytes(seq: nn.Sequential, x: torch.Tensor) -> list[float]:
    """Bytes per sample of each unit's output but the last's (what crosses each cut),
    the units run in order on ``x`` (a copy of ``seq``, no graph, generator restored)."""
    units = copy.deepcopy(seq)
    out = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        h = x
        for unit in list(units)[:-1]:
            h = unit(h)
            out.append(h.numel() * h.element_size() / x.shape[0])
    return out


def fleet(
    model_mem: float, largest_unit: float, fwd: list[float], bwd: list[float]
) -> list[NodeProfile]:
    """The owner (x2 slower, ``OWNER_SHARE`` of ``model_mem``) and three helpers, their
    per-unit times the host's ``fwd``/``bwd`` times ``1 + slowdown``."""
    helper_cap = max(HELPER_SHARE * model_mem, 1.1 * largest_unit)
    specs = [("owner", OWNER_SLOWDOWN, OWNER_SHARE * model_mem, True)]
    specs += [(f"helper{i + 1}", s, helper_cap, False) for i, s in enumerate(HELPER_SLOWDOWNS)]
    return [
        NodeProfile(
            name=name,
            layer_fwd_s=tuple(t * (1.0 + slow) for t in fwd),
            layer_bwd_s=tuple(t * (1.0 + slow) for t in bwd),
            memory_bytes=int(cap),
            latency_s=LATENCY_S,
            bandwidth_bps=BANDWIDTH_BPS,
            holds_data=owner,
            slowdown=slow,
        )
        for name, slow, cap, owner in specs
    ]


def plan_model(seq: nn.Sequential, model: ZooModel) -> dict[str, Any]:
    """Profile and time ``seq`` on this host, build :func:`fleet` around its memory and
    plan it there (``heuristic``, ``step``)."""
    mb = SCHEDULE.microbatch_size
    dtype = as_dtype(model.input_dtype)
    t0 = time.perf_counter()
    layers = profile_layers(
        copy.deepcopy(seq),
        model.input_shape,
        mb,
        make_optimizer=default_optimizer_factory("adam", LR),
        dtype=dtype,
    )
    fwd, bwd = time_layers(copy.deepcopy(seq), model.input_shape, mb, 1, 3, dtype=dtype)
    profile_s = time.perf_counter() - t0
    one = NodeProfile("one", tuple(fwd), tuple(bwd), 2**62)
    probe = CostModel(layers, [one], SCHEDULE)
    model_mem = probe.stage_memory(0, len(layers) - 1)
    largest = max(probe.stage_memory(j, j) for j in range(len(layers)))
    nodes = fleet(model_mem, largest, fwd, bwd)
    plan: Plan = partition(CostModel(layers, nodes, SCHEDULE), "heuristic", objective="step")
    return {
        "model_memory_bytes": model_mem,
        "largest_unit_bytes": largest,
        "nodes": [
            {"name": n.name, "slowdown": n.slowdown, "memory_bytes": n.memory_bytes} for n in nodes
        ],
        "stages": stage_rows(plan),
        "idle_nodes": plan.idle_nodes,
        "predicted_step_time_s": plan.predicted_step_time_s,
        "solve_time_s": plan.solve_time_s,
        "profile_s": profile_s,
        "table": plan.table(),
    }


def stage_rows(plan: Plan) -> list[dict[str, Any]]:
    """A plan's stages as a benchmark's result rows: node, layers ``first..last``, the
    stage's memory and its node's capacity (bytes)."""
    return [
        {
            "node": s.node,
            "first": s.first_layer,
            "last": s.last_layer,
            "memory_bytes": s.memory_bytes,
            "capacity_bytes": s.memory_capacity_bytes,
        }
        for s in plan.stages
    ]


def stage_bounds(units: int) -> list[tuple[int, int]]:
    """Three contiguous stages over ``units`` units (two for two units)."""
    if units < 2:
        raise ValueError(f"{units} unit: nothing to split")
    if units == 2:
        return [(0, 0), (1, 1)]
    a, b = units // 3, (2 * units) // 3
    return [(0, a - 1), (a, b - 1), (b, units - 1)]


def train(
    seq: nn.Sequential, model: ZooModel, bounds: list[tuple[int, int]]
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``STEPS`` steps of :func:`run_split_step` over stages ``bounds`` of ``seq``, from
    ``seq``'s weights (untouched): the merged state dict and the losses."""
    weights = {k: v.detach().clone() for k, v in seq.state_dict().items()}
    stages = []
    for a, b in bounds:
        module = build_stage(lambda: copy.deepcopy(seq), a, b, slice_state(weights, a, b))
        stages.append(StageExecutor(module, stage_optimizer(module, "adam", LR), MICRO))
    data = model.data(64, SEED)
    loss_fn, metric_fn = objective(model)
    losses = []
    for step in range(STEPS):
        x, y = step_batch(data, BATCH, ROUND, SEED, step)
        key = RngKey(SEED, ROUND, step)
        losses.append(run_split_step(stages, x, y, key, loss_fn=loss_fn, metric_fn=metric_fn))
    state = {k: v.detach().clone() for st in stages for k, v in st.module.state_dict().items()}
    return state, losses


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """Max absolute difference over every tensor of two state dicts, and whether all
    are equal bit for bit.

    Raises
    ------
    ValueError
        If they hold different keys.
    """
    if got.keys() != want.keys():
        odd = sorted(set(got) ^ set(want))
        raise ValueError(f"split and unsplit hold different keys: {odd[:6]}")
    diff, equal = 0.0, True
    for key, w in want.items():
        g = got[key]
        equal &= torch.equal(g, w)
        if g.numel():
            diff = max(diff, float((g.double() - w.double()).abs().max()))
    return diff, equal


def exactness(seq: nn.Sequential, model: ZooModel) -> dict[str, Any]:
    """Split against unsplit training (see the module docstring, item 5), then every
    single cut: two stages ``0..c-1``, ``c..`` for each ``c``, exact or the error."""
    bounds = stage_bounds(len(seq))
    start = {k: v.detach().clone() for k, v in seq.state_dict().items()}
    whole, whole_losses = train(seq, model, [(0, len(seq) - 1)])
    split, split_losses = train(seq, model, bounds)
    diff, equal = compare(split, whole)
    params = {n for n, _ in seq.named_parameters(remove_duplicate=False)}
    cuts: dict[int, str] = {}
    for c in range(1, len(seq)):
        try:
            d, e = compare(train(seq, model, [(0, c - 1), (c, len(seq) - 1)])[0], whole)
            cuts[c] = "exact" if e else f"max abs diff {d:.3g}"
        except Exception as err:  # noqa: BLE001 - recorded in the table
            cuts[c] = _error(err)
    return {
        "bounds": bounds,
        "max_abs_diff": diff,
        "exact": equal,
        "tensors": len(whole),
        "buffers": sum(1 for k in whole if k not in params),
        "changed": sum(1 for k, v in whole.items() if not torch.equal(v, start[k])),
        "loss_unsplit": whole_losses,
        "loss_split": split_losses,
        "single_cuts": cuts,
    }


def bench_model(name: str) -> dict[str, Any]:
    """Every measurement for zoo model ``name``; a failed one records its error."""
    model = ZOO[name]
    row: dict[str, Any] = {"model": name, "kind": model.kind}
    try:
        seq, row["convert_s"], row["warnings"] = convert(model)
    except Exception as err:  # noqa: BLE001 - recorded in the table
        row["error"] = _error(err)
        return row
    row["units"] = len(seq)
    row["split_points"] = list(seq.split_points)
    row["params"] = sum(p.numel() for p in seq.parameters())
    for key, fn in (
        ("cut_bytes", lambda: cut_bytes(seq, model.example(BATCH))),
        ("overhead", lambda: overhead(model.build(SEED), seq, model.example(BATCH))),
        ("plan", lambda: plan_model(seq, model)),
        ("exactness", lambda: exactness(seq, model)),
    ):
        try:
            row[key] = fn()
        except Exception as err:  # noqa: BLE001 - recorded in the table
            row[key] = {"error": _error(err)}
    return row


# --------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------
def _short(error: str) -> str:
    """An error's first paragraph, shortened, fit for a table cell."""
    first = error.strip().split("\n\n", 1)[0]
    return first[:ERROR_CHARS].replace("|", "/").replace("\n", " ")


def _failed(value: Any) -> str | None:  # noqa: ANN401 - a result or an error record
    if isinstance(value, dict) and "error" in value:
        return _short(str(value["error"]))
    return None


def _kib(nbytes: float) -> str:
    return f"{nbytes / KIB:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown tables: the summary, the bytes per cut, the plans."""
    summary, cuts, overheads, splits = [], [], [], []
    for r in rows:
        if "error" in r:
            summary.append([r["model"], f"failed: {_failed(r)}", "", "", "", "", "", "", ""])
            continue
        cells = [r["model"], f"{r['convert_s']:.2f}", str(r["units"])]
        cb = r["cut_bytes"]
        cells.append(_failed(cb) or (f"{max(cb):,.0f}" if cb else "-"))
        plan = r["plan"]
        if _failed(plan):
            cells += ["", f"failed: {_failed(plan)}", ""]
        else:
            owner = plan["nodes"][0]["memory_bytes"]
            cells.append(f"{_kib(owner)} / {_kib(plan['model_memory_bytes'])}")
            stages = ", ".join(f"{s['node']}: {s['first']}-{s['last']}" for s in plan["stages"])
            idle = f" ({', '.join(plan['idle_nodes'])} idle)" if plan["idle_nodes"] else ""
            cells += [stages + idle, f"{plan['predicted_step_time_s']:.4f}"]
        ex = r["exactness"]
        if _failed(ex):
            cells += [f"failed: {_failed(ex)}", ""]
        else:
            cells += [f"{ex['max_abs_diff']:.3g}", "yes" if ex["exact"] else "**no**"]
        summary.append(cells)
        if not _failed(cb):
            points = ", ".join(p.removeprefix("hf.") for p in r["split_points"])
            cuts.append([r["model"], points, ", ".join(f"{b:,.0f}" for b in cb)])
        oh = r.get("overhead")
        if oh is not None and not _failed(oh):
            overheads.append([r["model"], f"{oh['module_ms']:.2f}", f"{oh['converted_ms']:.2f}"])
            overheads[-1].append(f"{oh['ratio']:.2f}x")
        if not _failed(ex):
            single = ex["single_cuts"]
            ok = sum(v == "exact" for v in single.values())
            odd = "; ".join(
                f"cut before unit {c}: {_short(v)}" for c, v in single.items() if v != "exact"
            )
            splits.append(
                [r["model"], ", ".join(f"{a}-{b}" for a, b in ex["bounds"])]
                + [f"{ex['tensors']} ({ex['buffers']})", ex["changed"]]
                + [", ".join(f"{v:.4f}" for v in ex["loss_unsplit"])]
                + [f"{ok}/{len(single)}{'; ' + odd if odd else ''}"]
            )
    head = ["model", "convert s", "units", "max cut B/sample", "owner cap / model KiB"]
    head += ["plan (node: units)", "predicted step s", "split vs unsplit max abs diff", "exact"]
    split_head = ["model", "stages", "tensors (buffers)", "changed by training"]
    split_head += ["loss step 1, 2", "two stages, each single cut: exact"]
    return "\n\n".join(
        [
            tables.markdown(head, summary),
            "Bytes per sample crossing each cut (units in order):",
            tables.markdown(["model", "cuts before", "bytes per cut"], cuts),
            f"One forward + backward on a batch of {BATCH} (training mode, median):",
            tables.markdown(
                ["model", "module ms", "converted ms", "converted / module"], overheads
            ),
            "Split training (stages as unit ranges; tensors = weights + buffers):",
            tables.markdown(split_head, splits),
        ]
    )


def fleet_line() -> str:
    """One line describing the emulated fleet."""
    helpers = ", ".join(f"x{1 + s:g}" for s in HELPER_SLOWDOWNS)
    return (
        f"Fleet: owner (x{1 + OWNER_SLOWDOWN:g}, memory {OWNER_SHARE:.0%} of the model's) + "
        f"3 helpers ({helpers}, memory {HELPER_SHARE:.0%} of the model's or 1.1 x the largest "
        f"unit), {LATENCY_S * 1e3:g} ms, {BANDWIDTH_BPS / 1e6:g} MB/s; batch {BATCH}, "
        f"{MICRO} micro-batches, GPipe, direct, heuristic, objective step"
    )


def main(argv: list[str] | None = None) -> None:
    """Command-line entry (see the module docstring)."""
    parser = cli.parser("models", __doc__)
    parser.add_argument("--models", default="", help="comma-separated zoo names (default all)")
    args = cli.parse(parser, argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()] or list(ZOO)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        parser.error(f"unknown models {unknown}: choose from {', '.join(ZOO)}")
    out = cli.out_dir(args.out, "models")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    # one thread, as tests/reference.py trains: tiny models gain nothing from a second
    torch.set_num_threads(1)
    info = cli.machine()
    print(cli.machine_line(info))
    print(fleet_line())
    t_start = time.perf_counter()
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = bench_model(name)
        row["bench_s"] = time.perf_counter() - t0
        rows.append(row)
        print(f"[{name}] {row['bench_s']:.1f} s", flush=True)
    total = time.perf_counter() - t_start
    text = table(rows)
    print()
    print(text)
    for r in rows:
        for said in r.get("warnings", []):
            print(f"warning ({r['model']}): {said}")
    print(f"Benchmark finished in {total:.0f} s; outputs in {out}")
    page = f"{fleet_line()}\n\n{text}\n\nMachine: {info}; {total:.0f} s in all"
    cli.write(out, page, {"machine": info, "total_s": total, "rows": rows})


if __name__ == "__main__":
    main()
