"""Flower message vs stream hop, timed from the ServerApp (``sky_flower.bench.deployment``,
table 1): per payload size of :data:`SIZES`, ``repeats`` Flower echoes
(``query.sky_echo``, a fresh ClientApp process each) and ``5 x repeats`` stream hops
against the first SuperNode; the round trips (s) go to ``results-path`` as JSON."""

import json
import time

import torch
from flwr.app import ArrayRecord, Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from sky_flower.flower.exchange import Exchange
from sky_flower.sky import protocol as P
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.transport.channel import Endpoint
from sky_flower.sky.transport.runner import message
from sky_flower.sky.transport.stream_probe import probe_link

SIZES = (1024, 4 << 20)  # bytes each way

client = SkyClient(
    model_fn=lambda: torch.nn.Sequential(torch.nn.Linear(1, 1)), load_data=lambda c: None
).register(ClientApp())
server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """Time both paths; write ``{"flower": {size: [s, ...]}, "stream": {...}}``."""
    repeats = int(context.run_config["repeats"])
    while not list(grid.get_node_ids()):
        time.sleep(0.5)
    nid = sorted(grid.get_node_ids())[0]
    ex = Exchange(grid, 120.0, poll_interval_s=0.01)
    out = {"flower": {}, "stream": {}}
    for size in SIZES:
        times = []
        for i in range(repeats + 1):  # the first echo warms up
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
