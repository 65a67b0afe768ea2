"""Helpers for simulation tests: Hydra config composition, leftover-process checks."""

from __future__ import annotations

import os
import time
import uuid

import psutil
from hydra import compose, initialize_config_dir

from sky_flower.run import _conf_dir

# Small, fast settings for runs in Flower's simulation engine: the benchmark round
# sends one profile and one echo per payload size to each node (a state probe and
# repeats cost messages, and a message through Ray costs about a second here).
FAST = [
    "model.hidden_width=256",
    "model.hidden_layers=5",
    "schedule.batch_size=128",
    "train.lr=0.001",
    "benchmark.repeats=1",
    "benchmark.echo_repeats=1",
    "benchmark.state_probe_mb=0",
]


def make_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=_conf_dir(), version_base="1.3"):
        return compose("config", overrides=overrides)


# Every process this test session starts (Ray's GCS, raylet and workers included) inherits
# this marker through its environment, even after it is re-parented: a Ray process
# without it belongs to another job on the machine and is never counted.
SESSION_MARK = "SKY_FLOWER_TEST_SESSION"
os.environ.setdefault(SESSION_MARK, f"{os.getpid()}-{uuid.uuid4().hex}")


def _ours(proc: psutil.Process) -> bool:
    """Whether ``proc`` was started by this test session (its environment has our mark)."""
    try:
        return proc.environ().get(SESSION_MARK) == os.environ[SESSION_MARK]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def ray_processes() -> list[psutil.Process]:
    """Ray processes (GCS, raylet, workers) started by this test session."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            text = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue  # exited; only waits to be reaped (this container's init may never)
        if ("raylet" in text or "gcs_server" in text or "ray::" in text) and _ours(proc):
            found.append(proc)
    return found


def wait_no_ray(timeout: float = 60.0, ignore: set[int] = frozenset()) -> list[psutil.Process]:
    """Wait (bounded) until no Ray process but those in ``ignore`` runs; return the rest.
    60 s: on a loaded machine Ray took more than 30 s to end three ClientApp actors after
    a run whose direct stages had stalled."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in ray_processes() if p.pid not in ignore]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def reference_weights(
    cfg, steps: int, microbatches: int, *, rnd: int = 1, weights: dict | None = None
) -> dict:
    """``reference_rounds`` for round ``rnd`` of a simulation job ``cfg``: the unsplit
    model trained in this process from ``weights`` (default: the initial model, seeded
    with ``cfg.seed``) on the data owner's first ``steps`` batches of round ``rnd``, the
    loss called once on each batch (forwards per micro-batch, ``microbatches`` equal
    ones), one ``cfg.train.optimizer`` step per batch (what every split schedule must
    compute). The batches are drawn as Sky's data owner draws them in round ``rnd``; a
    layer's randomness (dropout) is keyed as in round 1, so ``rnd`` > 1 is for models
    without dropout."""
    import torch
    from reference import _step_batch, reference_rounds

    from sky_flower.pipeline.data import load_split, owner_partition
    from sky_flower.pipeline.models import build_model

    if weights is None:
        torch.manual_seed(int(cfg.seed))
        weights = build_model(dict(cfg.model)).state_dict()
    train, _ = load_split("digits", 0.2, int(cfg.seed))
    data = owner_partition(train, 0, 1, int(cfg.seed))
    batch = int(cfg.schedule.batch_size)
    batches = [_step_batch(data, s, rnd, batch, int(cfg.seed)) for s in range(steps)]
    ((expected, _),) = reference_rounds(
        lambda: build_model(dict(cfg.model)),
        batches,
        rounds=1,
        steps=steps,
        lr=float(cfg.train.lr),
        microbatches=microbatches,
        seed=int(cfg.seed),
        optimizer=str(cfg.train.optimizer),
        weights=weights,
    )
    return expected
