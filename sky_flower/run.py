"""Main entry point: ``python -m sky_flower.run [allocation=even|heuristic|optimal] [fleet=...]``.

A Hydra app (``conf/config.yaml``; groups ``allocation``, ``fleet``, ``model``,
``dataset``, ``transport``, ``strategy``). The default ``strategy=sky`` runs the Sky job
(:mod:`sky_flower.jobs.sky`: benchmark round, plan, split training in Flower's simulation
engine); ``strategy=hermes|bsp|asp|ssp`` Hermes or its baselines
(:mod:`sky_flower.jobs.hermes`), ``strategy=dpsgd|d2|dsgt|detag`` a decentralized strategy
(:mod:`sky_flower.jobs.decentralized`). Each writes into Hydra's output directory
(``results.json`` and, per job, ``benchmark.json``, ``plan.json``, ``model.pt``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from sky_flower.flower.quiet import quiet_third_party
from sky_flower.jobs.added_keys import check_added_keys
from sky_flower.jobs.common import conf_dir, main_job

_conf_dir = conf_dir  # the name tests and sky_flower.plan used before sky_flower.jobs


def job_for(cfg: DictConfig) -> str:
    """``"sky"``, ``"hermes"`` or ``"decentralized"``: which job ``cfg.strategy.name`` runs."""
    from sky_flower.jobs.hermes import is_hermes

    if is_hermes(cfg):
        return "hermes"
    return (
        "sky"
        if str(OmegaConf.select(cfg, "strategy.name", default="sky")) == "sky"
        else ("decentralized")
    )


def run_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Run the job ``cfg`` selects (see :func:`job_for`); write its files to ``out_dir``;
    return its results (the job's ``results.json``).

    Raises
    ------
    ValueError
        On invalid configuration, before Flower starts.
    Exception
        The job's node error if a node fails (``results.json`` is still written).
    """
    return _jobs(cfg, out_dir)[0](cfg, out_dir)


def _jobs(cfg: DictConfig, out_dir: Path) -> tuple[Callable, Callable, Callable]:
    """``(run, refused, summary)`` of the job ``cfg`` selects (see ``main_job``)."""
    kind = job_for(cfg)
    if kind == "hermes":
        from sky_flower.jobs import hermes as job
    elif kind == "decentralized":
        from sky_flower.jobs import decentralized as job  # type: ignore[no-redef]
    else:
        from sky_flower.jobs import sky as job  # type: ignore[no-redef]
    return job.run_job, job.refused(cfg, out_dir), job.summary


@hydra.main(config_path=conf_dir(), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point. A failed job exits 1; in a multirun it is recorded (its
    ``results.json`` carries the error) and the sweep goes on."""
    quiet_third_party()  # after Hydra set up logging: alembic's level must survive it
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    run, refused, summary = _jobs(cfg, out_dir)

    def checked(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
        check_added_keys(hydra_cfg.overrides.task, conf_dir())  # +trian.lr=...: refused
        return run(cfg, out_dir)

    main_job(checked, refused, summary, cfg, out_dir, hydra_cfg.mode == RunMode.MULTIRUN)


if __name__ == "__main__":
    from sky_flower.jobs.added_keys import exit_on_unknown_keys
    from sky_flower.jobs.config_files import exit_on_bad_files

    exit_on_bad_files(conf_dir())  # an invalid fleet file: one line, not a traceback
    exit_on_unknown_keys(conf_dir())  # trian.lr=0.1: "did you mean train?", one line
    main()
