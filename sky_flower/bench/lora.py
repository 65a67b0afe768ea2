"""LoRA benchmark: ``python -m sky_flower.bench.lora [--rounds N] [--steps S] [--out DIR]``.

Figures for issue 41 (LoRA on a frozen base): ``examples/lora-app``'s small Llama
(:mod:`lora_app.task`: 10 blocks, 8.2 M parameters) fine-tuned with LoRA (rank 4 on
the attention projections, the base frozen) against full fine-tuning of the same model
(``lora_r=0``: every weight trains), each through the app's own parts (its
``load_data``, its model as ``hf_model_fn`` converts it, its server-side evaluation on
held-out text) and the public API (:func:`sky_flower.app.register_sky_client`,
:func:`sky_flower.app.sky_strategy`), on an in-process Grid
(:class:`sky_flower.flower.inprocess.InProcessGrid`: every node's ClientApp in this
process, relay transport, one message per hop; no Ray, no SuperLink). It prints figures,
it asserts nothing. Runs:

1. **LoRA on ``lora4``** (the app's fleet: a data owner capped at 24 MiB, three helpers
   at 32 MiB, below the whole model's needs);
2. **full fine-tuning on ``lora4``**: :func:`sky_strategy`'s memory pre-check, whose
   refusal (the planner's message) is recorded; nothing trains;
3. **full fine-tuning on ``lora4_full``** (lora4's nodes, speeds and links with the
   memory full fine-tuning needs: owner 48 MiB, helpers 64 MiB);
4. **LoRA on ``lora4_full``**: the same fleet as run 3, so that step times and plans
   compare on equal nodes.

Per run: the plan (node: first-last unit), each stage's predicted memory against its
cap, the whole model's memory as the cost model counts it (what one node would need),
weights sent back per round against the whole model's bytes, the step time predicted
and measured (median per round, the slowest pipeline), the train loss and the server's
held-out loss and perplexity per round (round 0: the untrained model).

The step time measured here is the in-process relay's (each hop a message handled in
this process, the stage rebuilt from its weights for every message), not a deployment's.

Usage::

    python -m sky_flower.bench.lora                # 2 rounds of 5 steps per run
    python -m sky_flower.bench.lora --rounds 3 --steps 8

It prints the machine and the tables and writes ``table.md`` and ``results.json`` into
``--out`` (default ``outputs/bench_lora_<time>/``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.bench.models import stage_rows
from sky_flower.bench.zoo import EXAMPLES, example_module

APP = EXAMPLES / "lora-app"
RUNS = (  # (name, lora rank (0: full fine-tuning), fleet)
    ("LoRA r=4", 4, "lora4"),
    ("full fine-tuning", 0, "lora4"),
    ("full fine-tuning", 0, "lora4_full"),
    ("LoRA r=4", 4, "lora4_full"),
)
MIB = 2**20


def app_task() -> Any:  # noqa: ANN401 - the example app's task module
    """``examples/lora-app``'s ``lora_app.task``."""
    return example_module("lora-app", "lora_app.task")


def run_config(fleet: str, rounds: int, steps: int, results: Path) -> dict[str, Any]:
    """The app's run config (its ``pyproject.toml``) for ``fleet``, ``rounds`` rounds of
    ``steps`` steps, in process (no echo jitter, a short reply poll)."""
    from sky_flower.deploy import app_run_config

    return {
        **app_run_config(APP),
        "fleet": fleet,
        "num-server-rounds": rounds,
        "steps-per-round": steps,
        "echo-jitter-s": 0.0,
        "poll-interval-s": 0.002,
        "results-path": str(results),
    }


def bench_run(lora_r: int, fleet: str, rounds: int, steps: int, work: Path) -> dict[str, Any]:
    """One run of the app's model (``lora_r``) on ``fleet``; a refused plan records the
    refusal's text (``infeasible``) and trains nothing."""
    from flwr.app import ArrayRecord, MetricRecord
    from flwr.clientapp import ClientApp
    from flwr.common.config import parse_config_args

    from sky_flower.app import load_fleet, register_sky_client, sky_strategy
    from sky_flower.core.partition import InfeasibleMemoryError
    from sky_flower.deploy import node_config
    from sky_flower.flower.inprocess import InProcessGrid, server_identity

    task = app_task()
    model_fn = task.net_fn(lora_r=lora_r)
    seq = model_fn()
    row: dict[str, Any] = {
        "lora_r": lora_r,
        "fleet": fleet,
        "units": len(seq),
        "params": sum(p.numel() for p in seq.parameters()),
        "trainable_params": sum(p.numel() for p in seq.parameters() if p.requires_grad),
    }
    results = work / f"results-{lora_r}-{fleet}.json"
    run = run_config(fleet, rounds, steps, results)
    try:
        strategy = sky_strategy(run, model_fn)
    except InfeasibleMemoryError as err:
        row["infeasible"] = str(err)
        return row
    nodes = load_fleet(fleet)
    configs = {
        n.name: parse_config_args([node_config(n, i, len(nodes))]) for i, n in enumerate(nodes)
    }
    app = register_sky_client(ClientApp(), model_fn, task.load_data)
    grid = InProcessGrid(dict.fromkeys(configs, app), configs, run)
    test = task.load_test()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = task.get_model(lora_r=lora_r)
        model.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord(task.evaluate(model, test))

    server_identity()
    t0 = time.perf_counter()
    initial = ArrayRecord(task.get_model(lora_r=lora_r).state_dict())
    strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds, evaluate_fn=evaluate)
    row["run_s"] = time.perf_counter() - t0
    recorded = json.loads(results.read_text())
    row["error"] = recorded.get("error")
    plan = strategy.plan
    cost = strategy.cost
    row["model_memory_bytes"] = float(cost.stage_memory(0, len(seq) - 1))
    row["stages"] = stage_rows(plan)
    row["predicted_step_time_s"] = plan.predicted_step_time_s
    init = evaluate(0, initial)
    row["initial_test_loss"] = float(init["loss"])
    row["rounds"] = [
        {
            k: r.get(k)
            for k in (
                "round",
                "train_loss",
                "test_loss",
                "test_perplexity",
                "measured_step_time_s",
                "predicted_step_time_s",
                "round_time_s",
                "weights_sent_bytes",
                "full_weights_bytes",
            )
        }
        for r in recorded["rounds"]
    ]
    return row


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.1f}"


def _kib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1024:,.1f}"


def _name(row: dict[str, Any]) -> str:
    return f"LoRA r={row['lora_r']}" if row["lora_r"] else "full fine-tuning"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown tables: one summary row per run, then the plans, then the rounds."""
    summary, plans, rounds = [], [], []
    for r in rows:
        run = [_name(r), r["fleet"]]
        params = f"{r['trainable_params']:,} / {r['params']:,}"
        if "infeasible" in r:
            text = r["infeasible"].split("\n")[0].replace("|", "/")
            summary.append([*run, params, "", f"infeasible: {text}", "", "", "", ""])
            continue
        last = r["rounds"][-1]
        sent, full = last["weights_sent_bytes"], last["full_weights_bytes"]
        summary.append(
            [*run, params, _mib(r["model_memory_bytes"])]
            + [", ".join(f"{s['node']}: {s['first']}-{s['last']}" for s in r["stages"])]
            + [f"{_kib(sent)} ({_kib(full)}, {100 * sent / full:.1f} %)"]
            + [f"{r['predicted_step_time_s']:.3f}"]
            + [", ".join(f"{x['measured_step_time_s']:.2f}" for x in r["rounds"])]
            + [f"{r['initial_test_loss']:.3f} -> {last['test_loss']:.3f}"]
        )
        stages = [
            f"{s['node']} [{s['first']}-{s['last']}] "
            f"{_mib(s['memory_bytes'])}/{_mib(s['capacity_bytes'])}"
            for s in r["stages"]
        ]
        plans.append([*run, ", ".join(stages)])
        rounds += [
            [*run, x["round"], f"{x['train_loss']:.4f}", f"{x['test_loss']:.4f}"]
            + [f"{x['test_perplexity']:.1f}", f"{x['measured_step_time_s']:.2f}"]
            + [f"{x['round_time_s']:.1f}"]
            for x in r["rounds"]
        ]
    head = ["run", "fleet", "trainable / all params", "whole model MiB (one node)", "plan"]
    head += ["sent per round KiB (full KiB, %)", "step s predicted", "step s measured (median)"]
    rounds_head = ["run", "fleet", "round", "train loss", "held-out loss", "perplexity"]
    return "\n\n".join(
        [
            tables.markdown([*head, "held-out loss: start -> last round"], summary),
            "Predicted memory per stage (MiB used / cap):",
            tables.markdown(["run", "fleet", "stages"], plans),
            "Per round (train loss over the round's steps; held-out loss, perplexity):",
            tables.markdown([*rounds_head, "step s measured", "round s"], rounds),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """Command-line entry (see the module docstring)."""
    parser = cli.parser("lora", __doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    args = cli.parse(parser, argv)
    out = cli.out_dir(args.out, "lora")
    os.environ.setdefault("SKY_FLOWER_CACHE", str(out / "cache"))  # the app's base model
    info = cli.machine()
    print(cli.machine_line(info))
    print(f"{args.rounds} round(s) of {args.steps} steps per run, in process (relay)")
    t_start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as work:
        for name, lora_r, fleet in RUNS:
            t0 = time.perf_counter()
            row = bench_run(lora_r, fleet, args.rounds, args.steps, Path(work))
            row["bench_s"] = time.perf_counter() - t0
            rows.append(row)
            said = "infeasible" if "infeasible" in row else "trained"
            print(f"[{name} on {fleet}] {said}, {row['bench_s']:.1f} s", flush=True)
    total = time.perf_counter() - t_start
    text = table(rows)
    print()
    print(text)
    for r in rows:
        if "infeasible" in r:
            print(f"\nfull fine-tuning on {r['fleet']}, the planner's refusal:\n{r['infeasible']}")
    print(f"Benchmark finished in {total:.0f} s; outputs in {out}")
    results = {"machine": info, "total_s": total, "rows": rows}
    cli.write(out, f"{text}\n\nMachine: {info}; {total:.0f} s in all", results)


if __name__ == "__main__":
    main()
