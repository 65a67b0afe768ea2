"""Benchmark: step time of one plan through five executions (issue 4, item 5).

For each model (the default MLP, and a wider one where compute dominates), each stage
count ``S`` and each micro-batch count ``M`` it times the same training step (batch
``B``, ``M`` micro-batches, Adam, one stage per node, layers split evenly) through:

(a) ``unsplit``: one process running the unsplit model (native speed, one thread);
(b) ``pipelining``: ``torch.distributed.pipelining`` alone, one local process per stage
    (:func:`sky_flower.pipeline.direct.run_local`), no Flower;
(c) ``direct``: ``transport=direct`` under Flower (simulation engine, all stages at once);
(d) ``relay-pipe``: relay, pipelined (``schedule.kind=gpipe`` on ``transport=relay``;
    "n/a" where :class:`sky_flower.strategies.sky.SkyStrategy` refuses it);
(e) ``relay``: relay, unpipelined (``schedule.kind=sequential``).

The fleet is emulated: ``S`` nodes, slowdowns alternating x2 / x1 (node 0, the data
owner, x2), no link emulation; (b) runs with the same slowdowns. Step times are medians
over ``--steps`` steps of one round, after the round has started: the round's set-up
(joining the process group; for (b) also starting the processes) is reported apart.
(c) and (d) are also set against the planner's prediction
(:mod:`sky_flower.core.cost` on the run's own benchmark round).

One simulation engine per (model, S) runs every Flower case in turn (one strategy per
case, each with its own benchmark round, one round each), so the engine's start-up is
paid once.

Usage::

    python -m sky_flower.bench.transport            # full grid, about 10 min on 2 cores
    python -m sky_flower.bench.transport --quick    # MLP, S in {1, 2, 4}, M in {1, 4}

It prints the table and writes ``table.md`` and ``results.json`` into ``--out``
(default ``outputs/bench_transport_<time>/``). Every simulation starts Ray: on a shared
machine wrap it in ``flock /tmp/sky-ray.lock``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from functools import partial
from typing import Any

import torch

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.emulation.devices import Emulation
from sky_flower.pipeline.data import load_split, owner_partition
from sky_flower.pipeline.direct import run_local
from sky_flower.pipeline.models import build_model
from sky_flower.pipeline.stage import step_batch
from sky_flower.tables import num

MODELS = {
    "mlp": {"name": "mlp", "in_features": 64, "hidden_width": 1024, "hidden_layers": 8},
    "mlp-wide": {"name": "mlp", "in_features": 64, "hidden_width": 2048, "hidden_layers": 8},
}
CASES = ("unsplit", "pipelining", "direct", "relay-pipe", "relay")
BATCH = 64
LR = 1e-4


def fleet_for(S: int) -> list[Emulation]:
    """``S`` emulated nodes: slowdowns x2, x1, x2, x1, ...; node 0 holds the data."""
    return [
        Emulation(name=f"n{i}", holds_data=i == 0, slowdown=1.0 if i % 2 == 0 else 0.0)
        for i in range(S)
    ]


def even_bounds(num_layers: int, S: int) -> list[tuple[int, int]]:
    """``allocation=even``'s split of ``num_layers`` layers over ``S`` stages (the first
    ``num_layers mod S`` stages get one layer more)."""
    counts = [num_layers // S + (1 if i < num_layers % S else 0) for i in range(S)]
    starts = [sum(counts[:i]) for i in range(S)]
    return [(a, a + c - 1) for a, c in zip(starts, counts, strict=True)]


def owner_batches(steps: int, rnd: int = 1, seed: int = 0) -> list[tuple[Any, Any]]:
    """The data owner's first ``steps`` batches of round ``rnd`` (as the client draws them)."""
    train, _ = load_split("digits", 0.2, seed)
    data = owner_partition(train, 0, 1, seed)
    return [step_batch(data, BATCH, rnd, seed, step) for step in range(steps)]


def time_unsplit(model_cfg: dict, M: int, steps: int) -> float:
    """(a): median step time (s) of the unsplit model, one thread, native speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(model_cfg)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        times = []
        for x, y in owner_batches(steps + 1):
            t0 = time.perf_counter()
            opt.zero_grad()
            for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
                (torch.nn.functional.cross_entropy(model(xm), ym) / M).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def time_pipelining(model_cfg: dict, S: int, M: int, kind: str, steps: int) -> dict[str, float]:
    """(b): ``torch.distributed.pipelining`` in ``S`` local processes, same slowdowns."""
    torch.manual_seed(0)
    model = build_model(model_cfg)
    bounds = even_bounds(len(model), S)
    t0 = time.perf_counter()
    _, results = run_local(
        model_cfg,
        bounds,
        model.state_dict(),
        owner_batches(steps + 1),
        kind=kind,
        microbatches=M,
        lr=LR,
        slowdowns=[n.slowdown for n in fleet_for(S)],
        timeout_s=120.0,
    )
    wall = time.perf_counter() - t0
    per_step = [max(r.step_times_s[i] for r in results) for i in range(steps + 1)]
    return {"step_s": statistics.median(per_step[1:]), "setup_s": wall - sum(per_step)}


def flower_cases(
    model_cfg: dict, S: int, Ms: list[int], steps: int, kind: str
) -> dict[tuple[str, int], dict[str, Any]]:
    """(c), (d), (e) for every ``M`` in one simulation engine of ``S`` nodes."""
    from flwr.app import ArrayRecord, Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from sky_flower.sky.node.client import SkyClient, fleet_emulation, owner_data_fn
    from sky_flower.sky.settings import SkySettings
    from sky_flower.strategies.sky import SkyModel, SkyStrategy

    fleet = fleet_for(S)
    model_fn = partial(build_model, model_cfg)
    torch.manual_seed(0)
    initial = ArrayRecord(model_fn().state_dict())
    out: dict[tuple[str, int], dict[str, Any]] = {}
    links: dict[int, tuple[float, float, float]] = {}

    def make(M: int, transport: str, case_kind: str) -> SkyStrategy:
        settings = SkySettings().replace(
            {
                "allocation.method": "even",
                "schedule.batch_size": BATCH,
                "schedule.microbatches": M,
                "schedule.kind": case_kind,
                "schedule.transport": transport,
                "train.optimizer": "adam",
                "train.lr": LR,
                "train.steps_per_round": steps + 1,
                "benchmark.warmup": 1,
                "benchmark.repeats": 3,
                "benchmark.echo_repeats": 3,
                "benchmark.state_probe_mb": 4.0,
                "direct.timeout_s": 60.0,
            }
        )
        return SkyStrategy(
            SkyModel(model_fn, [int(model_cfg["in_features"])]),
            settings,
            node_order=[n.name for n in fleet],
            min_nodes=S,
            link_cache=links,  # the relay link does not depend on M: time it once
        )

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for M in Ms:
            for case, transport, case_kind in (
                ("direct", "direct", kind if not (kind == "1f1b" and M < S) else "gpipe"),
                ("relay-pipe", "relay", "gpipe"),
                ("relay", "relay", "sequential"),
            ):
                try:
                    strategy = make(M, transport, case_kind)
                except ValueError as err:
                    out[(case, M)] = {"error": f"n/a: relay pipelining not available ({err})"}
                    continue
                try:
                    strategy.start(grid=grid, initial_arrays=initial, num_rounds=1)
                    row = strategy.rounds[-1]
                    out[(case, M)] = {
                        "step_s": row.measured_step_time_s,
                        "predicted_s": row.predicted_step_time_s,
                        "setup_s": row.setup_s,
                        "kind": case_kind,
                        **before_after(strategy, row),
                    }
                except Exception as err:  # noqa: BLE001 - recorded in the table
                    out[(case, M)] = {"error": f"{type(err).__name__}: {err}"[:200]}

    client_app = SkyClient(
        model_fn=model_fn,
        load_data=owner_data_fn(fleet, "digits", 0.2, 0),
        emulation_fn=fleet_emulation(fleet),
    ).register(ClientApp())
    cpus = os.cpu_count() or 1
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=S,
        backend_config={
            "client_resources": {"num_cpus": min(0.5, cpus / S), "num_gpus": 0.0},
            "init_args": {"num_cpus": cpus, "logging_level": "error"},
        },
    )
    return out


def before_after(strategy: Any, row: Any) -> dict[str, Any]:  # noqa: ANN401 - a RoundRecord
    """The round's prediction by the cost model before calibration (the same benchmark
    with :func:`sky_flower.core.calibration.uncalibrated` nodes, the same plan), and per
    stage measured against predicted compute (s per step), before and after."""
    from sky_flower.core.calibration import uncalibrated
    from sky_flower.core.cost import CostModel
    from sky_flower.sky.planning.planning import plan_spec

    cost, spec = strategy.cost, plan_spec(strategy.plan)
    old = CostModel(cost.layers, uncalibrated(cost.nodes), cost.schedule)
    M = cost.schedule.microbatches
    t_old = old.terms(spec)
    return {
        "predicted_before_s": old.step_time(spec),
        "stages": [
            {
                "node": st.node,
                "measured_s": st.measured_compute_s,
                "predicted_s": st.predicted_compute_s,
                "predicted_before_s": M * float(t_old.fwd[k] + t_old.bwd[k]),
            }
            for k, st in enumerate(row.stages or [])
        ],
    }


def _ratios(x: dict[str, Any], key: str) -> str:
    """``measured / x[key]`` of a cell, and its stages' range (``min-max``)."""
    if "step_s" not in x or not x.get(key):
        return "-"
    stages = [st["measured_s"] / st[key] for st in x.get("stages", []) if st.get(key)]
    rng = f" ({min(stages):.2f}-{max(stages):.2f})" if stages else ""
    return f"{x['step_s'] / x[key]:.2f}{rng}"


def calibration_table(rows: list[dict[str, Any]]) -> str:
    """Measured / predicted step time per Flower cell, by the cost model before and
    after calibration (in parentheses: the stages' measured / predicted compute)."""
    rows = [
        [r["model"], r["S"], r["M"], case, num(x["step_s"]), num(x.get("predicted_before_s"))]
        + [num(x.get("predicted_s")), _ratios(x, "predicted_before_s"), _ratios(x, "predicted_s")]
        for r in rows
        for case in ("direct", "relay-pipe", "relay")
        if "step_s" in (x := r.get(case, {}))
    ]
    head = ["model", "S", "M", "case", "measured s", "predicted before", "predicted after"]
    return tables.markdown([*head, "meas/pred before (stages)", "meas/pred after (stages)"], rows)


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (seconds per step; ratios)."""

    def cell(x: dict[str, Any]) -> str:
        if "error" in x:
            return "n/a" if x["error"].startswith("n/a") else "failed"
        return num(x.get("step_s"))

    def ratio(a: dict[str, Any], b: dict[str, Any], missing: str = "-") -> str:
        return num(a["step_s"] / b["step_s"], ".2f") if "step_s" in a and "step_s" in b else missing

    cells = []
    for r in rows:
        c, b, d = r.get("direct", {}), r.get("pipelining", {}), r.get("relay-pipe", {})
        cp, dp = {"step_s": c.get("predicted_s")}, {"step_s": d.get("predicted_s")}
        cells.append(
            [r["model"], r["S"], r["M"], num(r.get("unsplit")), cell(b), cell(c), cell(d)]
            + [cell(r.get("relay", {})), ratio(c, b), num(c.get("predicted_s"))]
            + [ratio(c, cp), ratio(d, dp, "n/a"), num(b.get("setup_s"), ".2f")]
            + [num(c.get("setup_s"), ".2f")]
        )
    head = ["model", "S", "M", "(a) unsplit", "(b) pipelining", "(c) direct", "(d) relay-pipe"]
    head += ["(e) relay", "(c)/(b)", "(c) predicted", "(c) meas/pred", "(d) meas/pred"]
    return tables.markdown([*head, "(b) set-up", "(c) set-up"], cells)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry (see the module docstring)."""
    parser = cli.parser("transport", __doc__, quick="MLP only, S in {1,2,4}, M in {1,4}")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per case")
    parser.add_argument("--kind", default="gpipe", choices=("gpipe", "1f1b"))
    args = cli.parse(parser, argv)
    models = ["mlp"] if args.quick else list(MODELS)
    Ss, Ms = [1, 2, 4], [1, 4] if args.quick else [1, 4, 8]
    steps = args.steps or (4 if args.quick else 6)
    out = cli.out_dir(args.out, "transport")
    logging.getLogger("flwr").setLevel(logging.WARNING)
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in models:
        cfg = MODELS[name]
        for S in Ss:
            kind = args.kind
            print(f"[{name}, S={S}] Flower cases (c, d, e) for M in {Ms} ...", flush=True)
            flower = flower_cases(cfg, S, Ms, steps, kind)
            for M in Ms:
                row: dict[str, Any] = {"model": name, "S": S, "M": M, "kind": kind}
                row["unsplit"] = time_unsplit(cfg, M, steps)
                pk = kind if not (kind == "1f1b" and M < S) else "gpipe"
                print(f"[{name}, S={S}, M={M}] (a) and (b) ...", flush=True)
                try:
                    row["pipelining"] = time_pipelining(cfg, S, M, pk, steps)
                except Exception as err:  # noqa: BLE001 - recorded
                    row["pipelining"] = {"error": f"{type(err).__name__}: {err}"[:200]}
                for case in ("direct", "relay-pipe", "relay"):
                    row[case] = flower.get((case, M), {"error": "not run"})
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    text = table(rows) + "\n\nCalibration (issue 16):\n\n" + calibration_table(rows)
    print(text)
    print(f"Benchmark finished in {time.perf_counter() - t_start:.0f} s; outputs in {out}")
    cli.write(out, text, rows)  # strictly valid JSON (NaN/inf: null)


if __name__ == "__main__":
    main()
