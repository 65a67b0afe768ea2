"""Flower's own apps switched to Sky as they are: ``examples/quickstart-pytorch`` (Flower's
quickstart-pytorch: its CNN, its ``load_data`` returning DataLoaders over a
flwr_datasets partition with a lazy transform) and ``examples/quickstart-huggingface``
(dict batches through a padding collator, a ``transformers`` classifier). The diff of
each switch stays small; each Sky app trains on an in-process Grid exactly as unsplit
training of its model on its own batches (the simulation engine's run of them is in
test_example.py)."""

import difflib
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.common.config import parse_config_args
from reference import IN_PROCESS_RUN, reference_rounds
from sky_flower.strategies.sky import SkyStrategy

from sky_flower.app import load_fleet
from sky_flower.deploy import app_run_config, node_config
from sky_flower.flower.inprocess import InProcessGrid
from sky_flower.pipeline.graph import ModuleKeys, sequential_fn
from sky_flower.pipeline.sources import ModelInputs, as_source

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
APPS = {  # FedAvg app (as Flower writes it) -> the same app switched to Sky
    "quickstart-pytorch": ("pytorchexample", "pytorchexample_sky"),
    "quickstart-huggingface": ("huggingface_example", "huggingface_example_sky"),
}


def _changed_lines(a: Path, b: Path) -> list[str]:
    diff = difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), n=0)
    return [
        ln for ln in diff if ln[:1] in "+-" and not ln.startswith(("+++", "---")) and ln[1:].strip()
    ]


@pytest.mark.parametrize("app", list(APPS))
def test_the_switch_to_sky_is_a_small_diff(app):
    fedavg, sky = APPS[app]
    changed = []
    for name in ("task.py", "client_app.py", "server_app.py"):
        a = EXAMPLES / app / fedavg / name
        changed += _changed_lines(a, EXAMPLES / f"{app}-sky" / sky / name)
    assert 0 < len(changed) <= 12, changed
    assert not any(ln.startswith("-") and "load_data" in ln for ln in changed)  # as it is
    assert any("register_sky_client(app" in ln for ln in changed)
    assert any("sky_strategy(context.run_config" in ln for ln in changed)


def _app_modules(app: str):
    root = str(EXAMPLES / f"{app}-sky")
    if root not in sys.path:
        sys.path.insert(0, root)
    pkg = APPS[app][1]
    return [importlib.import_module(f"{pkg}.{m}") for m in ("task", "client_app", "server_app")]


@pytest.mark.parametrize("app", list(APPS))
def test_the_switched_app_trains_exactly_as_unsplit(app, tmp_path, monkeypatch, server_identity):
    """Flower's app, switched: its ServerApp's main on an in-process Grid of its
    ClientApp, split over a data owner and two helpers, equals unsplit training of the
    same (converted) model on the owner's batches from the app's own load_data."""
    monkeypatch.setenv("SKY_FLOWER_CACHE", str(tmp_path / "cache"))  # the text app's model
    monkeypatch.chdir(tmp_path)  # where the image app's ServerApp saves final_model.pt
    task, client_app, server_app = _app_modules(app)
    rounds, steps = 2, 3
    run = {
        **app_run_config(EXAMPLES / f"{app}-sky"),
        **IN_PROCESS_RUN,
        "fleet": "edge3",  # one data owner (the phone) and two helpers
        "allocation": "even",  # a split across all three
        "num-server-rounds": rounds,
        "steps-per-round": steps,
        "benchmark-repeats": 1,
        "echo-repeats": 1,
        "state-probe-mb": 0.0,
        "results-path": str(tmp_path / "results.json"),
    }
    fleet = load_fleet("edge3")  # node configs as `python -m sky_flower.deploy` writes them
    configs = {
        n.name: parse_config_args([node_config(n, i, len(fleet))]) for i, n in enumerate(fleet)
    }
    grid = InProcessGrid(dict.fromkeys(configs, client_app.app), configs, run)
    seen = []
    start = SkyStrategy.start

    def start_and_keep(self, *args, **kwargs):  # the ServerApp's own initial_arrays / result
        seen.append(kwargs["initial_arrays"].to_torch_state_dict())
        result = start(self, *args, **kwargs)
        seen.append(result.arrays.to_torch_state_dict())
        return result

    monkeypatch.setattr(SkyStrategy, "start", start_and_keep)
    server_app.main(grid, Context(0, 0, {}, RecordDict(), run))
    initial, final = seen
    assert list(final) == list(initial)  # the app's own keys in and out, as with FedAvg

    # unsplit: the converted model, on the owner's batches from the app's own load_data
    model_fn = MODEL_FNS[app](task, client_app)  # as the app passes it to register_sky_client
    keys = ModuleKeys.of(model_fn(), initial)
    phone = configs["phone"]
    loaded = client_app.load_data(
        phone["partition-id"], phone["num-partitions"], **_extra_args(client_app.load_data, run)
    )
    source = as_source(loaded, model_inputs=ModelInputs.of(model_fn()))
    want = reference_rounds(
        model_fn,
        source,
        rounds,
        steps,
        float(run["lr"]),
        batch_size=int(run["batch-size"]),
        weights=keys.to_converted(initial),
    )[-1][0]
    want = keys.to_original(want)
    for name, value in want.items():
        assert torch.equal(final[name], value), name
    assert any(not torch.equal(final[k], initial[k]) for k in initial)  # it trained
    rows = json.loads((tmp_path / "results.json").read_text())["rounds"]
    assert [len(r["stages"]) for r in rows] == [3] * rounds  # split over all three nodes


MODEL_FNS = {
    "quickstart-pytorch": lambda task, client_app: sequential_fn(task.Net, [3, 32, 32]),
    "quickstart-huggingface": lambda task, client_app: client_app.net_fn,
}


def _extra_args(load_data, run):
    from sky_flower.app import run_config_arguments

    return run_config_arguments(load_data, run)


@pytest.mark.parametrize(
    "page, app",
    [("README.md", "quickstart-pytorch"), ("docs/flower-app.md", "quickstart-huggingface")],
)
def test_the_docs_show_the_switch_as_it_is(page, app):
    """The page's diff block for ``app`` is the switch's changed lines, verbatim."""
    text = (Path(__file__).resolve().parents[1] / page).read_text()
    fedavg, sky = APPS[app]
    block = next(b for b in text.split("```diff\n")[1:] if f"+++ {sky}/" in b)
    lines = block.split("```", 1)[0].splitlines()
    shown = [ln for ln in lines if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    changed = []
    for name in ("client_app.py", "server_app.py"):
        a = EXAMPLES / app / fedavg / name
        changed += _changed_lines(a, EXAMPLES / f"{app}-sky" / sky / name)
    assert shown == changed
