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

The FedAvg-vs-Sky time-to-accuracy table of the issue is not produced here (not done).

Usage::

    python -m sky_flower.bench.deployment                  # both tables, about 15 min
    python -m sky_flower.bench.deployment --only hops      # table 1, about 2 min

Prints the tables and writes ``table.md`` and ``results.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from sky_flower.deploy import run_local

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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleet", default="edge3")
    parser.add_argument("--only", choices=("hops", "transports"), default=None)
    parser.add_argument("--repeats", type=int, default=5, help="Flower echoes per size")
    parser.add_argument("--steps", type=int, default=2, help="steps of table 2's round")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_deployment"))
    parser.add_argument("--transports", default="relay,stream,direct", help="table 2's rows")
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
    text = tables(res)
    (args.out / "results.json").write_text(json.dumps(res, indent=1))
    (args.out / "table.md").write_text(text + "\n")
    print(f"{res['date']}, commit {commit}, {res['machine']}, fleet {args.fleet}\n{text}")


if __name__ == "__main__":
    main()
