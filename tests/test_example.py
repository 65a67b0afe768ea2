"""The README's FedAvg-to-Sky example runs as written (Flower simulation, 3 nodes)."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fedavg_to_sky.py"


@pytest.mark.simulation
def test_fedavg_app_switched_to_sky_trains(no_leftover_processes):
    spec = importlib.util.spec_from_file_location("fedavg_to_sky", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # untrained: ~0.1; two rounds of split training on the one data owner's third
    assert module.run("sky", num_rounds=2) > 0.7
