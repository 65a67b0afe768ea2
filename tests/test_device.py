"""Issue 31, device placement, on a CPU-only machine: the device setting resolves,
refuses what this machine cannot run (before Flower starts, naming the key), and the
benchmark round reports each node's device in ``benchmark.json``.

The GPU half (split == unsplit on a GPU, timings) needs a machine with CUDA:
``scripts/gpu_check.sh``. The CPU exactness of every transport with the device code in
place is what ``tests/test_split.py``, ``test_exact_state.py``, ``test_idempotent.py``
and ``test_direct.py`` check.
"""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import Context
from flwr.clientapp import ClientApp
from simhelpers import make_cfg
from sky_flower.strategies.sky import EventCallback, SkyModel, SkyStrategy

from sky_flower.app import emulation_from_node_config
from sky_flower.deploy.local import node_config
from sky_flower.emulation.devices import Emulation, check_fleet_devices, expand_fleet
from sky_flower.flower.inprocess import InProcessGrid
from sky_flower.jobs.common import write_json
from sky_flower.pipeline.data import load_split, owner_partition
from sky_flower.pipeline.device import (
    check_device,
    device_info,
    direct_backend,
    resolve_device,
)
from sky_flower.pipeline.models import build_mlp
from sky_flower.pipeline.stage import StageExecutor, build_stage, stage_optimizer
from sky_flower.sky import protocol as P
from sky_flower.sky.node.client import SkyClient
from sky_flower.sky.planning.benchmark import benchmark_table
from sky_flower.sky.settings import SkySettings

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


# ---- the setting ------------------------------------------------------------------------
@no_cuda
def test_auto_resolves_to_the_cpu_without_cuda() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert Emulation("n").device == "auto"
    assert Emulation("n").torch_device() == torch.device("cpu")


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_refused_without_cuda_naming_the_node_and_the_fix(spec: str) -> None:
    with pytest.raises(ValueError, match=r"node 'gpu': device is 'cuda.*CUDA is not available"):
        Emulation("gpu", device=spec).torch_device()
    with pytest.raises(ValueError, match="set it to auto or cpu"):
        resolve_device(spec)


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:-1", "cuda:x", "", "mps", 0, None])
def test_a_malformed_device_is_refused_naming_the_key(bad: object) -> None:
    with pytest.raises(ValueError, match=r"node 'n': device must be one of auto, cpu, cuda"):
        Emulation("n", device=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"node 'a': device must be one of"):
        expand_fleet({"nodes": [{"name": "a", "holds_data": True, "device": bad}]})
    with pytest.raises(ValueError, match=r"node config sky-device must be one of"):
        emulation_from_node_config({"sky-node": "n", "sky-device": bad})


def test_the_device_travels_in_fleet_files_and_node_configs() -> None:
    (a, b) = expand_fleet(
        {"nodes": [{"name": "a", "holds_data": True}, {"name": "b", "device": "cuda:1"}]}
    )
    assert (a.device, b.device) == ("auto", "cuda:1")
    generated = expand_fleet({"nodes": 3, "device": "cpu"})
    assert [n.device for n in generated] == ["cpu"] * 3
    assert "sky-device" not in node_config(a, 0, 2)  # auto: the node's own default
    assert 'sky-device="cuda:1"' in node_config(b, 1, 2)
    emu = emulation_from_node_config({"sky-node": "b", "sky-device": "cuda:1"})
    assert emu.device == "cuda:1"


@no_cuda
def test_a_job_with_a_cuda_node_is_refused_before_flower_starts(tmp_path) -> None:
    from sky_flower.run import run_job

    cfg = make_cfg(["fleet=skycomputing", "fleet.nodes=3", "+fleet.device=cuda"])
    with pytest.raises(ValueError, match=r"node 'node0': device is 'cuda'.*not available"):
        run_job(cfg, tmp_path)
    assert not (tmp_path / "benchmark.json").exists()
    with pytest.raises(ValueError, match=r"node 'cloud-gpu': device is 'cuda'"):
        run_job(make_cfg(["fleet=gpu3"]), tmp_path)  # the packaged GPU fleet
    with pytest.raises(ValueError, match="node 'b': device"):
        check_fleet_devices([Emulation("a", holds_data=True), Emulation("b", device="cuda")])


def test_direct_uses_nccl_only_when_every_stage_has_its_own_gpu() -> None:
    assert direct_backend(["cuda:0", "cuda:1"]) == "nccl"
    assert direct_backend(["cuda:0", "cuda:0"], ["h1", "h2"]) == "nccl"  # two machines
    assert direct_backend(["cuda:0", "cuda:0"]) == "gloo"  # one GPU, two ranks: NCCL refuses
    assert direct_backend(["cuda:0", "cpu"]) == "gloo"
    assert direct_backend(["cpu", "cpu"]) == "gloo"
    assert direct_backend([]) == "gloo"


def test_device_info_and_the_memory_cap() -> None:
    info = device_info(torch.device("cpu"))
    assert info.device == "cpu" and info.name and 0 < info.available_bytes <= info.total_bytes
    capped = Emulation("n", memory_mb=64)
    assert capped.memory_bytes(10 * 2**30) == 64 * 2**20  # a GPU's free memory, capped
    assert capped.memory_bytes(32 * 2**20) == 32 * 2**20
    assert check_device("Cuda:2") == "cuda:2"


# ---- the stage edges ----------------------------------------------------------------------
def test_a_stage_on_the_cpu_returns_cpu_tensors_and_state() -> None:
    """The executor's edges: whatever device the stage computes on, activations,
    gradients and state come back on the CPU (here the CPU itself: no copy, the same
    tensors, so CPU exactness is untouched)."""
    torch.manual_seed(0)
    module = build_stage(lambda: build_mlp(8, 16, 2), 0, 1, device="cpu")
    ex = StageExecutor(module, stage_optimizer(module, "sgd", 0.1), 2, device="cpu")
    y = ex.forward(torch.randn(4, 8))
    g = ex.backward(torch.randn(4, 8), torch.ones_like(y), input_grad=True, step=False)
    assert y.device.type == g.device.type == "cpu"
    assert all(t.device.type == "cpu" for t in ex.grads().values())
    assert ex.device == torch.device("cpu")


# ---- the benchmark round ------------------------------------------------------------------
@no_cuda
@pytest.mark.usefixtures("server_identity")
def test_benchmark_json_carries_each_nodes_device(tmp_path, caplog) -> None:
    """The benchmark round in-process (real SkyClient handlers on Flower's ClientApp):
    every node reports its device, its name and its memory; a node set to ``cuda`` on a
    machine without CUDA is left out naming why (a SuperNode's node config cannot be
    checked before Flower starts: its benchmark reply is the first place)."""
    train, _ = load_split("digits", 0.2, 0)
    data = owner_partition(train, 0, 1, 0)
    nodes = {
        "owner": Emulation("owner", holds_data=True, device="auto"),
        "helper": Emulation("helper", device="cpu", memory_mb=64),
        "gpu": Emulation("gpu", device="cuda"),
    }

    def model_fn() -> torch.nn.Sequential:
        return build_mlp(64, 32, 3)

    def load(context: Context):  # noqa: ANN202
        return data if context.node_config["sky-node"] == "owner" else None

    def emulation(context: Context) -> Emulation:
        return nodes[str(context.node_config["sky-node"])]

    app = SkyClient(model_fn, load, emulation_fn=emulation).register(ClientApp())
    grid = InProcessGrid(dict.fromkeys(nodes, app))
    events: dict[str, dict] = {}
    settings = SkySettings().replace(
        {
            "schedule.batch_size": 16,
            "schedule.microbatches": 2,
            "benchmark.repeats": 1,
            "benchmark.echo_repeats": 1,
            "benchmark.echo_jitter_s": 0.0,
            "benchmark.state_probe_mb": 0.0,
            "messaging.poll_interval_s": 1e-4,
        }
    )
    strategy = SkyStrategy(
        SkyModel(model_fn, [64]),
        settings,
        min_nodes=3,
        hooks=[EventCallback(lambda kind, payload: events.setdefault(kind, payload))],
    )
    profiles = strategy.benchmark(grid, list(grid.get_node_ids()))
    write_json(tmp_path / "benchmark.json", events["benchmark"])  # as the job writes it
    written = json.loads((tmp_path / "benchmark.json").read_text())
    by_name = {n["name"]: n for n in written["nodes"]}
    assert sorted(by_name) == ["helper", "owner"]  # "gpu" left out, saying why
    assert "node 'gpu': device is 'cuda', but CUDA is not available" in caplog.text
    cpu = device_info(torch.device("cpu")).name
    for n in by_name.values():
        assert (n["device"], n["device_name"]) == ("cpu", cpu)
    assert by_name["helper"]["memory_bytes"] == 64 * 2**20
    table = benchmark_table(profiles)
    assert "device" in table.splitlines()[0] and f"owner        cpu: {cpu}" in table
    # an older node's reply lacks the device keys: the CPU
    reply = P.ProfileReply(
        "old", False, 0, 1, 0.0, "", 0.0, 0.0, (1.0,), (1.0,), (0.0,)
    ).to_config_record()
    del reply["device"], reply["device_name"]
    old = P.ProfileReply.from_config_record(reply)
    assert (old.device, old.device_name) == ("cpu", P.NO_HOST)


def test_simulated_nodes_ask_ray_for_a_gpu_share_only_with_a_cuda_node() -> None:
    from sky_flower.jobs.common import backend_config
    from sky_flower.jobs.sky import simulation_gpus

    assert simulation_gpus({"a": "cpu", "b": "cpu"}, gpus=1) == 0.0
    assert simulation_gpus({"a": "cpu", "b": "cuda:0"}, gpus=0) == 0.0
    assert simulation_gpus({"a": "cpu", "b": "cuda:0", "c": "cpu"}, gpus=1) == pytest.approx(1 / 3)
    assert simulation_gpus({"a": "cuda:0", "b": "cuda:1"}, gpus=4) == 1.0
    assert backend_config(2, 0.5)["client_resources"] == {"num_cpus": 0.5, "num_gpus": 0.0}
