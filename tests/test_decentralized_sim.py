"""Decentralized strategies end to end in Flower's simulation engine, checked against the
benchmark's one-process fast path; bad settings refused before Flower starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from simhelpers import make_cfg

from sky_flower.bench.decentralized import simulate
from sky_flower.gossip.matrices import gossip_matrix
from sky_flower.gossip.training import FlatModel, node_splits
from sky_flower.pipeline.data import load_split
from sky_flower.run import run_job

SMALL = [
    "strategy.num_nodes=4",
    "strategy.topology=ring",
    "strategy.homogeneity=0",
    "strategy.hidden_width=8",
    "strategy.lr=0.2",
    "simulation.num_cpus_per_node=0.5",
]


@pytest.mark.simulation
@pytest.mark.slow  # the same rows through Flower's ClientApps in make test: test_exchange.py
@pytest.mark.parametrize(
    ("name", "extra", "fast"),
    # one engine run: the Hydra job's settings (lazy mixing) to the rows; the three
    # update rules' rows (DeTAG paper and ATC, D2 lazy) through Flower's real ClientApps in
    # process: tests/test_exchange.py's test_decentralized_through_the_exchange_equals_the_
    # fast_path (a Ray start-up is tens of seconds on 2 cores)
    [("d2", ["strategy.lazy_mixing=true"], {"lazy": True})],
    ids=["d2-lazy"],
)
def test_flower_equals_the_fast_path(name, extra, fast, tmp_path, no_leftover_processes):
    """4 SuperNodes on a ring, fully sorted data: DeTAG (phases of 2 rounds, both
    variants) and D2 on the lazy ring ``(I + W) / 2`` (the plain 4-ring is refused): the
    rows Flower produces (loss of the averaged model from the nodes' own data, consensus
    distance, test accuracy) are those of the benchmark's fast path."""
    fast = dict(fast)
    lazy = fast.pop("lazy", False)
    phases = ["strategy.phase_rounds=2"] if name == "detag" else []
    cfg = make_cfg([f"strategy={name}", *SMALL, *phases, "strategy.rounds=8", *extra])
    results = run_job(cfg, tmp_path)
    assert results["error"] is None
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["strategy"] == name and saved["network"]["nodes"] == 4
    assert saved["lazy_mixing"] is lazy
    if lazy:  # (I + W) / 2 of the 4-ring (lambda_min -1/3): lambda_min 1/3
        assert saved["network"]["lambda_min"] == pytest.approx(1 / 3)
    rows = saved["rounds"]
    step = 2 if name == "detag" else 1
    assert [r["round"] for r in rows] == list(range(0, 9, step))
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns
    assert rows[0]["consensus_distance"] == 0 and rows[-1]["consensus_distance"] > 0

    train, test = load_split("digits", 0.2, 0)
    expected = simulate(
        name,
        gossip_matrix("ring", 4, lazy=lazy),
        FlatModel(8),
        node_splits(train, 4, 0.0, 0),
        test,
        rounds=8,
        lr=0.2,
        **fast,
    )
    for key in ("loss", "test_accuracy", "consensus_distance"):
        np.testing.assert_allclose(
            [r[key] for r in rows], [r[key] for r in expected], rtol=1e-4, atol=1e-6, err_msg=key
        )
    np.testing.assert_allclose(
        [r["node_loss"] for r in rows[1:]], [r["node_loss"] for r in expected[1:]], rtol=1e-4
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy=d2"], r"D2 needs lambda_min\(W\) > -1/3.*ring.*-0\.3333.*lazy_mixing=true"),
        (["strategy=d2", "strategy.lazy_mixing=yes"], "lazy_mixing must be true or false"),
        (["strategy=detag", "strategy.detag_variant=overlap"], "'overlap' is now 'paper'"),
        (["strategy=dpsgd", "strategy.topology=mesh"], "unknown topology 'mesh'"),
        (["strategy=dsgt", "strategy.spectral_gap=0"], r"spectral_gap must be in \(0, 1\]"),
        (["strategy=dsgt", "strategy.num_nodes=1"], "at least 2 nodes"),
        (["strategy=dsgt", "strategy.homogeneity=120"], r"homogeneity must be in \[0, 100\]"),
        (["strategy=detag", "strategy.rounds=1", "strategy.phase_rounds=3"], "shorter than one"),
        (["strategy=dsgt", "strategy.batch_size=1000"], "examples per node"),
        (["strategy=dsgt", "strategy.lr=-1"], "lr must be > 0"),
        (["strategy=detag", "strategy.phase_rounds=1.5"], "phase_rounds must be an integer"),
        (["strategy=dpsgd", "strategy.detag_variant=bogus"], "detag_variant must be one of"),
        (["strategy=dpsgd", "strategy.phase_rule=cube"], "phase_rule must be one of"),
    ],
)
def test_bad_settings_refused_before_flower_starts(overrides, message, tmp_path):
    cfg = make_cfg([*SMALL, *overrides])
    with pytest.raises(ValueError, match=message):
        run_job(cfg, tmp_path)
    assert not (tmp_path / "results.json").exists()  # nothing ran


def test_default_strategy_is_sky():
    cfg = make_cfg([])
    assert cfg.strategy.name == "sky"
    detag = make_cfg(["strategy=detag"])
    assert detag.strategy.topology == "exponential" and detag.strategy.phase_rounds == 0
