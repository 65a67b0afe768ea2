"""Benchmark: a fleet that drifts under a fixed plan against online re-planning (issue 16).

Two scenarios on one fleet (a data owner and three helpers; an MLP on digits, relay
``sequential``, ``allocation=heuristic``, Adam with ``train.optimizer_state=keep``):

- ``slow``: helper ``h1`` runs 4x slower from round 3 of 10 (``slowdown_schedule``);
- ``leave``: ``h1`` leaves at round 3 (``leave_round``): round 3 fails, the strategy
  drops it and re-plans (from the benchmark's profiles when static, from the updated
  ones when re-planning online).

Each runs three ways: ``static`` (``replan.mode=off``), ``online`` (``replan.mode=on``)
and ``oracle``: the fleet as it is after the drift from round 1 (its own benchmark and
plan), whose median step is the "new optimum". Reported per run: the measured step time
of every round, the test accuracy, the time to a target accuracy (summed round times
until the global model first reaches it), and the recovery time: rounds from the drift
round to the first round back within 10 % of the new optimum ("-": never).

**In-process, not Flower's simulation engine.** :class:`InProcessGrid` hands every
message synchronously to its node's ClientApp in this process (each node its own
``Context``), so there is no Ray and no per-message polling tick (the simulation
engine's 0.1 s, which would drown the emulated compute). The Sky strategy, the
ClientApp handlers, the relay protocol and the emulated slowdowns (sleeps) are the real
ones; a helper's link and Flower's network are not emulated. Absolute step times are
therefore smaller than under ``flwr run``; the ratios between the runs are the point.

Usage::

    python -m sky_flower.bench.drift            # 10 rounds, about 5 minutes on 2 cores
    python -m sky_flower.bench.drift --quick    # smaller model and rounds, about 2 minutes

It prints the tables (markdown) and writes ``table.md`` and ``results.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.clientapp import ClientApp

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.emulation.devices import Emulation
from sky_flower.flower.inprocess import InProcessGrid, server_identity
from sky_flower.pipeline.data import Split, load_split, owner_partition
from sky_flower.pipeline.models import build_mlp
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.settings import SkySettings
from sky_flower.strategies.sky import SkyModel, SkyStrategy
from sky_flower.tables import num

DRIFT_ROUND = 3
SLOW = 3.0  # slowdown 3: 4x slower


def fleet(scenario: str, oracle: bool) -> list[Emulation]:
    """The fleet of ``scenario`` (``slow`` or ``leave``); ``oracle``: as after the drift."""
    h1: dict[str, Any] = {"name": "h1", "slowdown": 0.0}
    if scenario == "slow":
        h1 = (
            {**h1, "slowdown": SLOW} if oracle else {**h1, "slowdown_schedule": {DRIFT_ROUND: SLOW}}
        )
    nodes = [
        Emulation(name="owner", holds_data=True, slowdown=8.0),
        Emulation(**h1),
        Emulation(name="h2", slowdown=1.0),
        Emulation(name="h3", slowdown=3.0),
    ]
    if scenario == "leave":
        nodes = (
            [n for n in nodes if n.name != "h1"]
            if oracle
            else [
                n if n.name != "h1" else Emulation(name="h1", leave_round=DRIFT_ROUND)
                for n in nodes
            ]
        )
    return nodes


def run_one(scenario: str, how: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run (``how``: static, online, oracle): per round step, accuracy, round time."""
    torch.manual_seed(0)
    train, test = load_split("digits", 0.2, 0)
    data = owner_partition(train, 0, 1, 0)

    def model_fn() -> torch.nn.Sequential:
        return build_mlp(64, args.width, args.layers)

    nodes = fleet(scenario, how == "oracle")
    by_name = {n.name: n for n in nodes}

    def load(context: Context) -> Split | None:
        return data if context.node_config["sky-node"] == "owner" else None

    def emulation(context: Context) -> Emulation:
        return by_name[str(context.node_config["sky-node"])]

    app = SkyClient(model_fn, load, emulation_fn=emulation).register(ClientApp())
    grid = InProcessGrid({n.name: app for n in nodes})
    settings = SkySettings().replace(
        {
            "allocation.method": "heuristic",
            "schedule.batch_size": args.batch,
            "schedule.microbatches": 1,
            "train.lr": 1e-3,
            "train.steps_per_round": args.steps,
            "benchmark.repeats": 3,
            "benchmark.echo_repeats": 1,
            "benchmark.echo_jitter_s": 0.0,
            "benchmark.state_probe_mb": 0.0,
            "messaging.poll_interval_s": 1e-4,  # in process: hardly a pause
            "failure.max_failed_rounds": 2,
            "replan.mode": "on" if how == "online" else "off",
            "train.optimizer_state": "keep",
        }
    )
    strategy = SkyStrategy(SkyModel(model_fn, [64]), settings, min_nodes=len(nodes))
    x, y = torch.from_numpy(test.x), torch.from_numpy(test.y)

    def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        model = model_fn()
        model.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            acc = float((model(x).argmax(1) == y).float().mean())
        return MetricRecord({"accuracy": acc})

    torch.manual_seed(0)
    initial = ArrayRecord(model_fn().state_dict())
    strategy.start(grid, initial, num_rounds=args.rounds, evaluate_fn=evaluate)
    rounds = [
        {
            "round": r.round,
            "step_s": r.measured_step_time_s,
            "round_s": r.round_time_s,
            "acc": r.test.get("accuracy"),
            "nodes": sorted({st.node for st in r.stages or []}),
        }
        for r in strategy.rounds
    ]
    return {"rounds": rounds, "replans": [r.to_dict() for r in strategy.replans]}


def summarise(runs: dict[str, dict], target: float) -> dict[str, dict[str, Any]]:
    """Per run: time to ``target`` accuracy (s) and recovery rounds after the drift."""
    oracle = [r["step_s"] for r in runs["oracle"]["rounds"] if r["step_s"] is not None]
    late = [
        r["step_s"]
        for r in runs["oracle"]["rounds"]
        if r["round"] > DRIFT_ROUND + 1 and r["step_s"]
    ]
    optimum = float(np.median(late or oracle))  # the oracle's "median step after" column
    out: dict[str, dict[str, Any]] = {}
    for how, run in runs.items():
        elapsed, to_target = 0.0, None
        for r in run["rounds"]:
            elapsed += r["round_s"] or 0.0
            if to_target is None and r["acc"] is not None and r["acc"] >= target:
                to_target = elapsed
        back = next(
            (
                r["round"] - DRIFT_ROUND
                for r in run["rounds"]
                if r["round"] >= DRIFT_ROUND
                and r["step_s"] is not None
                and r["step_s"] <= 1.1 * optimum
            ),
            None,
        )
        after = [r["step_s"] for r in run["rounds"] if r["round"] > DRIFT_ROUND + 1 and r["step_s"]]
        out[how] = {
            "time_to_target_s": to_target,
            "recovery_rounds": back if how != "oracle" else 0,
            "median_step_after_s": float(np.median(after)) if after else None,
            "total_s": elapsed,
            "replans": len(run["replans"]),
        }
    out["oracle"]["optimum_step_s"] = optimum
    return out


def table(scenario: str, runs: dict[str, dict], summary: dict[str, dict], target: float) -> str:
    """The scenario's markdown tables: step time per round, then the summary."""
    n = max(len(r["rounds"]) for r in runs.values())
    steps = [
        [how, *(num(r["step_s"], missing="failed") for r in run["rounds"])]
        for how, run in runs.items()
    ]
    rows = [
        [how, num(s["median_step_after_s"]), num(s["time_to_target_s"], ".1f")]
        + [num(s["recovery_rounds"], "d"), s["replans"]]
        for how, s in summary.items()
    ]
    head = ["run", "median step after s", f"time to {target:.2f} acc s", "recovery rounds"]
    return "\n\n".join(
        [
            f"{scenario}: measured step s per round (drift at round {DRIFT_ROUND})",
            tables.markdown(["run", *(str(i + 1) for i in range(n))], steps),
            tables.markdown([*head, "re-plans"], rows),
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both scenarios three ways, print the tables, write ``results.json``."""
    p = cli.parser("drift", __doc__, quick="smaller model, fewer steps")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--target", type=float, default=0.9, help="test accuracy to reach")
    args = cli.parse(p, argv)
    quick, full = (512, 6, 4, 128), (512, 8, 8, 256)  # width, layers, steps/round, batch
    args.width, args.layers, args.steps, args.batch = quick if args.quick else full
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    server_identity()
    out = cli.out_dir(args.out, "drift")
    results: dict[str, Any] = {}
    texts = []
    for scenario in ("slow", "leave"):
        runs = {how: run_one(scenario, how, args) for how in ("static", "online", "oracle")}
        summary = summarise(runs, args.target)
        results[scenario] = {"runs": runs, "summary": summary}
        texts.append(table(scenario, runs, summary, args.target))
        print(texts[-1], "\n", flush=True)
    cli.write(out, "\n\n".join(texts), results)
    return results


if __name__ == "__main__":
    main()
