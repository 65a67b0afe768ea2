"""Plan without training: ``python -m sky_flower.plan [model=...] [fleet=...] [allocation=...]``.

The Hydra entry point (``conf/plan.yaml``); the job is :mod:`sky_flower.jobs.plan`
(``plan.json``, ``plan.txt``, ``plan_row.json`` in Hydra's output directory; no Flower).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from sky_flower.jobs.common import conf_dir
from sky_flower.jobs.plan import build_planning_problem, log, plan_job, summary_line

__all__ = ["build_planning_problem", "main", "plan_job", "summary_line"]


@hydra.main(config_path=conf_dir(), config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point. A failed job exits 1; in a multirun it is recorded (its
    ``plan_row.json`` carries the status and error) and the sweep goes on."""
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        result = plan_job(cfg, out_dir)
    except Exception as err:  # noqa: BLE001 - recorded in plan_row.json
        if not isinstance(err, ValueError):
            log.exception("planning crashed (outputs in %s)", out_dir)
        log.error("plan failed (%s): %s (outputs in %s)", type(err).__name__, err, out_dir)
        if multirun:
            return
        raise SystemExit(1) from None
    if not multirun:  # a sweep's tables stay in each job's plan.txt
        if result["plan"].get("pipelines"):  # the per-owner plans were logged above
            print(
                "One pipeline over the whole fleet (SkyComputing's setting; plan.json's "
                "top-level stages; the training job runs the per-owner pipelines above):"
            )
        print(result["table"])
    print(f"{summary_line(result['row'])}; plan.json in {out_dir}")


if __name__ == "__main__":
    from sky_flower.jobs.config_files import exit_on_bad_files

    exit_on_bad_files(conf_dir())  # an invalid fleet file: one line, not a traceback
    main()
