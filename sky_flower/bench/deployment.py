"""Benchmark: Sky on a real SuperLink and SuperNodes on 127.0.0.1 (issue 27).

Two tables, each from real deployments started by the launcher (:mod:`sky_flower.deploy`):

1. **Hop latency**: one Flower message (``query.sky_echo`` through the SuperLink and a
   SuperNode, a fresh ClientApp process each) against one stream hop (an echo frame on
   the round's data plane, :mod:`sky_flower.sky.transport.stream_probe`), 1 KiB and 4 MiB each
   way, median and p90. A tiny probe app (written to the work directory) does both from
   its ServerApp against the fleet's first SuperNode.
2. **The same plan on relay, stream and direct**: the sky-app, ``allocation=even``
   (one stage per node), ``gpipe`` with 4 micro-batches, 1 round of ``--steps`` steps:
   measured step (median), predicted step, the round's wall time (``round_time_s``:
   set-up, steps and collection, Flower's messages included).

3. **Time to a target test accuracy, FedAvg against Sky** (``--only accuracy``): per
   fleet (``--fleets``: a straggler owner, a phone that cannot hold the model, a uniform
   fleet; ``conf/fleet/*_owners*.yaml``), a FedAvg probe app (written to the work
   directory: Flower's ``FedAvg`` on the example fedavg-app's model, data and test, each
   SuperNode's emulated slowdown and link applied as Sky applies them, and an owner
   whose memory cap cannot hold the model's training memory trains nothing) and the
   sky-app on ``transport='stream'`` (``allocation=heuristic``), both ``--rounds``
   rounds of one local epoch, Adam at ``--lr``, batch 32; per run the rounds and the
   wall time (sum of the rounds' times) to ``--target``, and the share of the owners'
   data trained.

Usage::

    python -m sky_flower.bench.deployment                  # all tables, about 45 min
    python -m sky_flower.bench.deployment --only hops      # table 1, about 2 min
    python -m sky_flower.bench.deployment --only accuracy  # table 3, about 30 min

Prints the tables and writes ``table.md`` and ``results.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sky_flower.core.profile import LayerProfile
from sky_flower.deploy import run_local
from sky_flower.emulation.devices import Emulation

SKY_APP = Path(__file__).resolve().parents[2] / "examples" / "sky-app"
SIZES = (1024, 4 << 20)

PROBE_TOML = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "hop-probe"
version = "1.0.0"
dependencies = ["flwr==1.42.0", "sky-flower"]

[tool.setuptools]
py-modules = ["hop_probe"]

[tool.flwr.app]
publisher = "sky-flower"

[tool.flwr.app.components]
serverapp = "hop_probe:server"
clientapp = "hop_probe:client"

[tool.flwr.app.config]
results-path = ""
repeats = 7
"""

PROBE_PY = '''"""Flower message vs stream hop, timed from the ServerApp (bench.deployment)."""
import json, statistics, time
import torch
from flwr.app import ArrayRecord, Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from sky_flower.flower.exchange import Exchange
from sky_flower.sky import protocol as P
from sky_flower.sky.transport.channel import Endpoint
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.transport.runner import message
from sky_flower.sky.transport.stream_probe import probe_link

client = SkyClient(model_fn=lambda: torch.nn.Sequential(torch.nn.Linear(1, 1)),
                   load_data=lambda c: None).register(ClientApp())
server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    repeats = int(context.run_config["repeats"])
    while not list(grid.get_node_ids()):
        time.sleep(0.5)
    nid = sorted(grid.get_node_ids())[0]
    ex = Exchange(grid, 120.0, poll_interval_s=0.01)
    out = {"flower": {}, "stream": {}}
    for size in SIZES:
        times = []
        for i in range(repeats + 1):
            payload = ArrayRecord({"p": torch.zeros(size, dtype=torch.uint8)})
            t0 = time.perf_counter()
            ex.request([message(nid, P.ECHO, {P.PAYLOAD: payload}, "echo")])
            if i:
                times.append(time.perf_counter() - t0)
        out["flower"][str(size)] = times
    small, big = SIZES
    fig = probe_link(ex, nid, lambda n: Endpoint(n), SIZES, 5 * repeats, extra=((big, big),))
    out["stream"] = {str(small): fig.rtts[(small, small)], str(big): fig.rtts[(big, big)]}
    with open(str(context.run_config["results-path"]), "w") as f:
        json.dump(out, f)
'''.replace("SIZES", repr(SIZES))


def p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def hops(workdir: Path, fleet: str, repeats: int) -> dict[str, Any]:
    """Table 1's figures: per path and size, the round trips (s), median and p90."""
    app = workdir / "hop-probe"
    app.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(PROBE_TOML.replace("repeats = 7", f"repeats = {repeats}"))
    (app / "hop_probe.py").write_text(PROBE_PY)
    _, _, res = run_local(app, fleet, workdir=workdir / "hops", timeout_s=900, echo=False)
    if not res or "flower" not in res:
        raise RuntimeError(f"the probe app wrote no figures: {res}")
    return {
        path: {
            size: {"median_s": statistics.median(v), "p90_s": p90(v), "n": len(v)}
            for size, v in res[path].items()
        }
        for path in ("flower", "stream")
    }


def transports(
    workdir: Path, fleet: str, steps: int, which: tuple[str, ...] = ("relay", "stream", "direct")
) -> dict[str, Any]:
    """Table 2's figures: per transport, the round's row of ``results.json``."""
    out: dict[str, Any] = {}
    base = (
        "num-server-rounds=1 echo-repeats=1 state-probe-mb=0.0 benchmark-repeats=2 "
        f"message-timeout-s=120.0 allocation='even' schedule-kind='gpipe' microbatches=4 "
        f"steps-per-round={steps}"
    )
    for transport in which:
        t0 = time.perf_counter()
        try:
            _, _, res = run_local(
                SKY_APP,
                fleet,
                run_config=f"{base} transport='{transport}'",
                workdir=workdir / transport,
                timeout_s=1200,
                echo=False,
            )
            (row,) = (res or {}).get("rounds") or [{"error": (res or {}).get("error")}]
        except Exception as err:  # noqa: BLE001 - recorded in the table
            row = {"error": f"{type(err).__name__}: {err}"[:300]}
        row["run_wall_s"] = time.perf_counter() - t0
        out[transport] = row
    return out


# --- table 3: time to a target test accuracy, FedAvg against Sky -------------------------
FEDAVG_APP = Path(__file__).resolve().parents[2] / "examples" / "fedavg-app"
ACCURACY_FLEETS = ("straggler_owners4", "phone_owners4", "uniform_owners3")
BATCH = 32  # the fedavg-app's batch size (task.train)

FEDAVG_TOML = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "fedavg-probe"
version = "1.0.0"
dependencies = ["flwr==1.42.0", "sky-flower"]

[tool.setuptools]
py-modules = ["fedavg_probe", "fedavg_task"]

[tool.flwr.app]
publisher = "sky-flower"

[tool.flwr.app.components]
serverapp = "fedavg_probe:server"
clientapp = "fedavg_probe:client"

[tool.flwr.app.config]
num-server-rounds = 5
lr = 0.003
local-epochs = 1.0
batch-size = 32
min-nodes = 1
results-path = ""
"""

FEDAVG_PY = '''"""FedAvg on emulated devices, timed per round (bench.deployment, table 3).

fedavg_task.py is examples/fedavg-app's task.py (model, data, test), copied. Training is
its loop (Adam, shuffled batches) with the node's emulation as Sky's stages apply it:
sleep slowdown x each step's compute (Emulation.after_compute), and the link delay of the
model both ways once per message. A node without data, or whose memory cap cannot hold
the model's training memory (the server sends it: weights, gradients, Adam state and the
batch's stashed activations), trains nothing: it replies 0 examples (no weight in FedAvg).
"""
import json, time
import torch
from torch import nn
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from sky_flower.app import emulation_from_node_config
from sky_flower.bench.deployment import model_training_bytes
from fedavg_task import Net, initial_weights, load_data, load_test, test

client = ClientApp()
server = ServerApp()


def train_emulated(net, data, epochs, lr, batch, emu):
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    losses = []
    for _ in range(max(1, round(epochs))):
        for idx in torch.randperm(len(y)).split(batch):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
            emu.after_compute(time.perf_counter() - t0)
            losses.append(loss.item())
    return sum(losses) / len(losses)


@client.train()
def train(msg: Message, context: Context) -> Message:
    emu = emulation_from_node_config(context.node_config)
    cfg = msg.content["config"]
    arrays, n, loss = msg.content["arrays"], 0, 0.0
    if emu.holds_data and emu.memory_bytes() >= int(cfg["need-bytes"]):
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        nc = context.node_config
        data = load_data(int(nc["partition-id"]), int(nc["num-partitions"]))
        loss = train_emulated(model, data, float(cfg["local-epochs"]), float(cfg["lr"]),
                              int(cfg["batch-size"]), emu)
        arrays, n = ArrayRecord(model.state_dict()), len(data)
    time.sleep(emu.link_delay_s(2 * arrays.count_bytes()))
    metrics = MetricRecord({"train_loss": loss, "num-examples": n})
    return Message(content=RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


class CountingFedAvg(FedAvg):
    """FedAvg that records, per round, the examples and owners that trained."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.trained = {}

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        ns = [int(m.content["metrics"]["num-examples"]) for m in replies if m.has_content()]
        self.trained[server_round] = (sum(ns), sum(1 for n in ns if n > 0))
        return super().aggregate_train(server_round, replies)


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, batch, k = int(cfg["num-server-rounds"]), int(cfg["batch-size"]), int(cfg["min-nodes"])
    t_wait = time.perf_counter()
    while len(list(grid.get_node_ids())) < k:  # every SuperNode, before round 1 (as Sky)
        time.sleep(0.5)
    wait_s = time.perf_counter() - t_wait
    need = model_training_bytes(Net(), [64], batch)
    test_set, marks = load_test(), {}

    def evaluate(rnd, arrays):
        t0 = time.perf_counter()
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = test(model, test_set)
        marks[rnd] = (t0, time.perf_counter())
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy = CountingFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=k,
                              min_available_nodes=k)
    config = ConfigRecord({"lr": float(cfg["lr"]), "local-epochs": float(cfg["local-epochs"]),
                           "batch-size": batch, "need-bytes": need})
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial_weights()),
                            train_config=config, num_rounds=rounds, evaluate_fn=evaluate)
    acc = {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
    rows = [
        {"round": r, "test_accuracy": acc.get(r), "round_time_s": marks[r][0] - marks[r - 1][1],
         "samples_trained": strategy.trained.get(r, (None, None))[0],
         "owners_trained": strategy.trained.get(r, (None, None))[1]}
        for r in range(1, rounds + 1) if r in marks
    ]
    out = {"initial_test_accuracy": acc.get(0), "rounds": rows, "need_bytes": need,
           "node_wait_s": wait_s, "completed": len(rows) == rounds, "error": None}
    with open(str(cfg["results-path"]), "w") as f:
        json.dump(out, f, indent=1)
'''


def training_bytes(layers: Sequence[LayerProfile], batch: int) -> float:
    """Bytes to train all of ``layers`` on one node at ``batch`` samples a step, as the
    planner counts a stage (:meth:`sky_flower.core.cost.CostModel.stage_memory` with the
    whole batch in flight): weights, gradients and optimizer state (frozen weights
    without either), plus ``batch`` x the
    activations autograd stashes per sample (the output's size when not measured)."""
    static = sum(lp.static_bytes for lp in layers)
    stash = sum(lp.act_out_bytes if lp.stash_bytes is None else lp.stash_bytes for lp in layers)
    return float(static + batch * stash)


def model_training_bytes(model: Any, input_shape: Sequence[int], batch: int) -> float:  # noqa: ANN401 - a torch module
    """:func:`training_bytes` of ``model`` profiled by the project's profiler (Adam)."""
    from sky_flower.core.profile import profile_layers

    return training_bytes(profile_layers(model, input_shape, batch), batch)


def fedavg_owners(fleet: Sequence[Emulation], need_bytes: float) -> list[str]:
    """The data owners FedAvg can use: those whose memory cap (none: no cap) holds
    ``need_bytes``, the whole model's training memory (:func:`training_bytes`)."""
    return [n.name for n in fleet if n.holds_data and n.memory_bytes(available=2**62) >= need_bytes]


def rounds_to_target(accuracies: Sequence[float | None], target: float) -> int | None:
    """The first round (1-based) whose test accuracy is at least ``target``; ``None``
    if none is (a missing accuracy, ``None``, never counts). Accuracies are float32
    means (324/360 is 0.8999999761581421), so ``target`` is met within 1e-6."""
    for r, acc in enumerate(accuracies, start=1):
        if acc is not None and acc >= target - 1e-6:
            return r
    return None


def time_to_target(rows: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """Seconds to ``target``: the sum of ``round_time_s`` over the rounds up to and
    including the first that reaches it (``rows`` in round order, from round 1);
    ``None`` if no round reaches it."""
    r = rounds_to_target([row.get("test_accuracy") for row in rows], target)
    return None if r is None else float(sum(row["round_time_s"] for row in rows[:r]))


def accuracy_row(res: Mapping[str, Any] | None, target: float) -> dict[str, Any]:
    """One run's figures for table 3 from its ``results.json``."""
    if not res or not res.get("rounds"):
        return {"error": (res or {}).get("error") or "no rounds in results.json"}
    rows = sorted(res["rounds"], key=lambda row: row["round"])
    failed = [row for row in rows if row.get("error")]
    accs = [row.get("test_accuracy") for row in rows]
    out: dict[str, Any] = {
        "accuracies": accs,
        "round_times_s": [row.get("round_time_s") for row in rows],
        "rounds_to_target": rounds_to_target(accs, target),
        "time_to_target_s": None if failed else time_to_target(rows, target),
        "samples_trained": rows[0].get("samples_trained"),
        "error": failed[0]["error"] if failed else None,
    }
    if rows[0].get("pipelines"):  # Sky: the plan and the owners' data
        out["plan"] = "; ".join("+".join(p["nodes"]) for p in rows[0]["pipelines"])
        out["owner_samples"] = sum(int(p["samples"]) for p in rows[0]["pipelines"])
    return out


def accuracy(
    workdir: Path, fleets: Sequence[str], rounds: int, lr: float, target: float
) -> dict[str, Any]:
    """Table 3's figures: per fleet, the FedAvg probe and the sky-app (stream) rows."""
    from sky_flower.app import load_fleet

    app = workdir / "fedavg-probe"
    app.mkdir(parents=True, exist_ok=True)
    (app / "pyproject.toml").write_text(FEDAVG_TOML)
    (app / "fedavg_probe.py").write_text(FEDAVG_PY)
    (app / "fedavg_task.py").write_text((FEDAVG_APP / "fedavg_app" / "task.py").read_text())
    sys.path.insert(0, str(FEDAVG_APP))
    try:
        from fedavg_app.task import Net

        need = model_training_bytes(Net(), [64], BATCH)
    finally:
        sys.path.remove(str(FEDAVG_APP))
    common = f"num-server-rounds={rounds} lr={lr} local-epochs=1.0 batch-size={BATCH}"
    sky = (
        f"{common} allocation='heuristic' transport='stream' schedule-kind='gpipe' "
        "microbatches=4 optimizer='adam' benchmark-repeats=1 echo-repeats=1 "
        "state-probe-mb=0.0 message-timeout-s=120.0"
    )
    out: dict[str, Any] = {"need_bytes": need}
    for fleet in fleets:
        nodes = load_fleet(fleet)
        runs = {
            "fedavg": (app, f"{common} min-nodes={len(nodes)}"),
            "sky": (SKY_APP, sky),
        }
        entry: dict[str, Any] = {
            "owners": [n.name for n in nodes if n.holds_data],
            "fedavg_owners": fedavg_owners(nodes, need),
        }
        for method, (path, config) in runs.items():
            t0, load0 = time.perf_counter(), os.getloadavg()[0]
            try:
                _, _, res = run_local(
                    path,
                    fleet,
                    run_config=config,
                    workdir=workdir / f"{fleet}-{method}",
                    timeout_s=1800,
                    echo=False,
                )
                row = accuracy_row(res, target)
            except Exception as err:  # noqa: BLE001 - recorded in the table
                row = {"error": f"{type(err).__name__}: {err}"[:300]}
            row["run_wall_s"] = time.perf_counter() - t0
            row["load_avg"] = [load0, os.getloadavg()[0]]  # 1-min load, start and end
            entry[method] = row
        out[fleet] = entry
    return out


def accuracy_table(acc: Mapping[str, Any], target: float) -> list[str]:
    """Table 3's lines (Markdown)."""

    def secs(v: float | None) -> str:
        return "not reached" if v is None else f"{v:.1f} s"

    lines = [
        f"| fleet | method | plan (round 1) | data used | rounds to {target:g} | time to "
        f"{target:g} | test accuracy per round | round times | run | FedAvg/Sky |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fleet, e in acc.items():
        if not isinstance(e, dict):
            continue
        f, s = e.get("fedavg", {}), e.get("sky", {})
        total = s.get("owner_samples")
        for method, row in (("FedAvg", f), ("Sky (stream)", s)):
            if row.get("error") and "accuracies" not in row:
                lines.append(f"| {fleet} | {method} | failed: {row['error']} | | | | | | | |")
                continue
            plan = row.get("plan") or "alone: " + ", ".join(e["fedavg_owners"])
            used = row.get("samples_trained")
            share = f"{used}/{total} ({used / total:.0%})" if used is not None and total else "-"
            ratio = ""
            if method != "FedAvg":
                ft, st = f.get("time_to_target_s"), s.get("time_to_target_s")
                ratio = f"{ft / st:.2f}x" if ft and st else "-"
            accs = " ".join("-" if a is None else f"{a:.3f}" for a in row["accuracies"])
            times = " ".join(f"{t:.0f}" for t in row["round_times_s"] if t is not None)
            err = f" (error: {row['error']})" if row.get("error") else ""
            load = row.get("load_avg")
            load_note = f" (load {load[0]:.1f} to {load[1]:.1f})" if load else ""
            lines.append(
                f"| {fleet} | {method} | {plan} | {share} | {row['rounds_to_target'] or '-'} | "
                f"{secs(row['time_to_target_s'])}{err} | {accs} | {times} s | "
                f"{row['run_wall_s']:.0f} s{load_note} | {ratio} |"
            )
    return lines


def tables(res: dict[str, Any]) -> str:
    """The printed tables (Markdown)."""
    lines = []
    if "hops" in res:
        h = res["hops"]
        lines += [
            "| payload (each way) | Flower message median | p90 | stream hop median | p90 "
            "| ratio |",
            "|---|---|---|---|---|---|",
        ]
        for size in (str(s) for s in SIZES):
            f, s = h["flower"][size], h["stream"][size]
            label = f"{int(size) // 1024} KiB" if int(size) < 2**20 else f"{int(size) >> 20} MiB"
            lines.append(
                f"| {label} | {f['median_s']:.3f} s | {f['p90_s']:.3f} s | "
                f"{s['median_s'] * 1e3:.1f} ms | {s['p90_s'] * 1e3:.1f} ms | "
                f"{f['median_s'] / s['median_s']:.0f}x |"
            )
        lines.append("")
    if "transports" in res:
        lines += [
            "| transport | measured step | predicted step | meas/pred | round time | run |",
            "|---|---|---|---|---|---|",
        ]
        for t, row in res["transports"].items():
            if row.get("error") or "measured_step_time_s" not in row:
                lines.append(f"| {t} | failed: {row.get('error')} | | | | |")
                continue
            m, p = row["measured_step_time_s"], row["predicted_step_time_s"]
            lines.append(
                f"| {t} | {m:.3f} s | {p:.3f} s | {m / p if p else float('nan'):.2f} | "
                f"{row['round_time_s']:.1f} s | {row['run_wall_s']:.0f} s |"
            )
        lines.append("")
    if "accuracy" in res:
        lines += accuracy_table(res["accuracy"], res["target"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleet", default="edge3")
    parser.add_argument("--only", choices=("hops", "transports", "accuracy"), default=None)
    parser.add_argument("--repeats", type=int, default=5, help="Flower echoes per size")
    parser.add_argument("--steps", type=int, default=2, help="steps of table 2's round")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_deployment"))
    parser.add_argument("--transports", default="relay,stream,direct", help="table 2's rows")
    parser.add_argument("--fleets", default=",".join(ACCURACY_FLEETS), help="table 3's fleets")
    parser.add_argument("--rounds", type=int, default=5, help="table 3: rounds per run")
    parser.add_argument("--lr", type=float, default=0.003, help="table 3: Adam's lr")
    parser.add_argument("--target", type=float, default=0.9, help="table 3: test accuracy")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "fleet": args.fleet,
    }
    if args.only in (None, "hops"):
        res["hops"] = hops(args.out.resolve(), args.fleet, args.repeats)
    if args.only in (None, "transports"):
        which = tuple(args.transports.split(","))
        res["transports"] = transports(args.out.resolve(), args.fleet, args.steps, which)
    if args.only in (None, "accuracy"):
        res["target"] = args.target
        fleets = tuple(args.fleets.split(","))
        res["accuracy"] = accuracy(args.out.resolve(), fleets, args.rounds, args.lr, args.target)
    text = tables(res)
    (args.out / "results.json").write_text(json.dumps(res, indent=1))
    (args.out / "table.md").write_text(text + "\n")
    print(f"{res['date']}, commit {commit}, {res['machine']}, fleet {args.fleet}\n{text}")


if __name__ == "__main__":
    main()
