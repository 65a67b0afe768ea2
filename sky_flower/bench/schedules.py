"""Benchmark: GPipe, 1F1B, interleaved 1F1B and zero bubble on the direct transport (issue 16).

One plan, ``S = 4`` stages, ``M = 8`` micro-batches of a batch of 64, the MLP of
``conf/model/mlp.yaml`` (9 layers, width 1024), layers split evenly over the stages
(``interleaved`` / ``zero_bubble``: ``v = 2`` chunks per stage,
:func:`sky_flower.core.virtual.split_chunks`). Each schedule runs ``--steps`` steps in
``torch.distributed.pipelining`` with one local process per stage
(:func:`sky_flower.pipeline.direct.run_local`, the engine of a ``direct`` round without
Flower), the fleet emulated as the transport benchmark does (slowdowns x2, x1, x2, x1:
each stage sleeps its slowdown times its measured compute).

Printed per schedule: the measured step (median over the steps after the first, the
slowest stage's), the predicted step (:func:`sky_flower.core.schedule.predict` on
per-layer times measured here, times each node's slowdown; no link cost: the processes
share a host), the ranks' idle share of the step, simulated and measured (``1 -
sum of stage compute / (S x step)``; measured compute is the stages' own timing, sleeps
included), and the predicted peak memory per stage (parameters, gradients, Adam state
and the simulated peak of stashed activations, MiB).

Usage::

    python -m sky_flower.bench.schedules [--steps 8] [--width 1024]

No Flower, no Ray (the lock is not needed). About 1 min on 2 cores.
"""

from __future__ import annotations

import statistics

import torch

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.bench.transport import even_bounds
from sky_flower.core.cost import CostModel, Schedule
from sky_flower.core.profile import NodeProfile, profile_layers, time_layers
from sky_flower.core.schedule import DIRECT_KINDS, predict
from sky_flower.pipeline.direct import run_local
from sky_flower.pipeline.models import build_model

S, M, BATCH, CHUNKS = 4, 8, 64, 2
SLOWDOWNS = (1.0, 0.0, 1.0, 0.0)  # x2, x1, x2, x1


def cost_model(model_cfg: dict, kind: str) -> CostModel:
    """The cost model of this host's layer times, each node's slowdown applied."""
    torch.set_num_threads(1)
    model = build_model(model_cfg)
    layers = profile_layers(model, [64], BATCH // M)
    fwd, bwd = time_layers(model, [64], BATCH // M, warmup=3, repeats=9)
    nodes = [
        NodeProfile(
            f"n{i}",
            tuple(f * (1 + s) for f in fwd),
            tuple(b * (1 + s) for b in bwd),
            2**40,
            holds_data=i == 0,
        )
        for i, s in enumerate(SLOWDOWNS)
    ]
    return CostModel(layers, nodes, Schedule(BATCH, M, kind, "direct", chunks=CHUNKS))


def measure(model_cfg: dict, kind: str, stages: list, steps: int) -> tuple[float, float]:
    """Measured median step (s) and idle share of one round of ``kind``."""
    torch.manual_seed(0)
    weights = build_model(model_cfg).state_dict()
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH, 64, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen))
        for _ in range(steps)
    ]
    bounds = [(a, b) for _, a, b in stages]
    _, results = run_local(
        model_cfg,
        bounds,
        weights,
        batches,
        kind=kind,
        microbatches=M,
        slowdowns=SLOWDOWNS,
        ranks=S,
        timeout_s=120.0,
    )
    per_step = [max(r.step_times_s[i] for r in results) for i in range(steps)]
    step = statistics.median(per_step[1:]) if steps > 1 else per_step[0]
    total = sum(per_step)
    busy = sum(r.compute_s * (1 + s) for r, s in zip(results, SLOWDOWNS, strict=True))
    return step, 1.0 - busy / (S * total)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; print the table; return its rows."""
    ap = cli.parser("schedules", __doc__, out=False)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    args = cli.parse(ap, argv)
    model_cfg = {"name": "mlp", "in_features": 64, "hidden_width": args.width, "hidden_layers": 8}
    cost = cost_model(model_cfg, "gpipe")
    plan = [(i, a, b) for i, (a, b) in enumerate(even_bounds(cost.num_layers, S))]
    rows = []
    for kind in DIRECT_KINDS:
        pred = predict(cost, plan, kind, CHUNKS)
        parts = pred.chunk_layers
        step, idle = measure(model_cfg, kind, parts, args.steps)
        rows.append(
            {
                "kind": kind,
                "chunks": pred.chunks,
                "measured_step_s": step,
                "predicted_step_s": pred.step_time_s,
                "bubble_simulated": pred.bubble_share,
                "bubble_measured": idle,
                "memory_mib": [m / 2**20 for m in pred.memory_bytes],
            }
        )
    print(f"S={S}, M={M}, batch {BATCH}, MLP width {args.width}, slowdowns {SLOWDOWNS}")
    cells = [
        [r["kind"], r["chunks"], f"{r['measured_step_s']:.3f}", f"{r['predicted_step_s']:.3f}"]
        + [f"{r['measured_step_s'] / r['predicted_step_s']:.2f}", f"{r['bubble_simulated']:.0%}"]
        + [f"{r['bubble_measured']:.0%}", ", ".join(f"{m:.1f}" for m in r["memory_mib"])]
        for r in rows
    ]
    head = ["schedule", "v", "measured step s", "predicted s", "meas/pred", "bubble sim"]
    print(tables.markdown([*head, "bubble meas", "peak memory per stage MiB (predicted)"], cells))
    return rows


if __name__ == "__main__":
    main()
