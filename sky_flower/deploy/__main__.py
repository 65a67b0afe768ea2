"""``python -m sky_flower.deploy <app> [--fleet NAME] [--tls] [--simulation] [--run-config
...] [--workdir DIR] [--timeout S]``: see :mod:`sky_flower.deploy`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from sky_flower.deploy import RESULTS_KEY, DeployError, round_accuracies, run_local
from sky_flower.deploy import __doc__ as deploy_doc


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry: see :mod:`sky_flower.deploy`. Prints a JSON summary of the run's
    ``results.json``, or, for an app that writes none (no ``results-path`` key), one that
    says so and how to add it; exit status 0 when it completed (an app that writes no
    ``results.json``: when ``flwr run`` succeeded), 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m sky_flower.deploy", description=deploy_doc.splitlines()[0]
    )
    parser.add_argument("app", type=Path, help="the Flower app directory (pyproject.toml)")
    parser.add_argument("--fleet", default="edge4", help="packaged fleet (conf/fleet/*.yaml)")
    parser.add_argument("--tls", action="store_true", help="TLS + SuperNode authentication")
    parser.add_argument(
        "--simulation", action="store_true", help="SuperLink's simulation runtime, no SuperNodes"
    )
    parser.add_argument("--run-config", default="", help="e.g. \"allocation='optimal'\"")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs/keys here")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the run")
    args = parser.parse_args(argv)
    if not (args.app / "pyproject.toml").exists():
        parser.error(f"{args.app} has no pyproject.toml: pass a Flower app directory")
    try:
        _, pids, results = run_local(
            args.app,
            args.fleet,
            tls=args.tls,
            simulation=args.simulation,
            run_config=args.run_config,
            workdir=args.workdir,
            timeout_s=args.timeout,
        )
    except KeyboardInterrupt:
        print("interrupted: every process started was stopped", file=sys.stderr)
        return 130
    except (DeployError, ValueError) as err:
        print(f"deployment failed: {err}", file=sys.stderr)
        return 1
    if results is None:  # flwr run finished (a failed one raised DeployError)
        print(json.dumps(_no_results(args.app, len(pids))))
        return 0
    summary = {
        "processes_started_and_stopped": len(pids),
        "test_accuracy": round_accuracies(results),
        "rounds": results.get("rounds"),
        "error": results.get("error"),
    }
    print(json.dumps(summary))
    return 0 if results.get("completed") and not results.get("error") else 1


def _no_results(app: Path, processes: int) -> dict[str, object]:
    """The summary of a run whose app writes no ``results.json``: what happened, and how
    to get the rounds and test accuracy here."""
    return {
        "processes_started_and_stopped": processes,
        "flwr_run": "finished (its log is above)",
        "results": None,
        "note": (
            f"the app wrote no results.json, so there are no rounds or test accuracy to "
            f"summarise here: {app / 'pyproject.toml'} declares no {RESULTS_KEY} key in "
            f'[tool.flwr.app.config]. Add {RESULTS_KEY} = "" there (the launcher then '
            "sets it to <workdir>/results.json); a Sky app's sky_strategy writes the file, "
            "another app writes it itself (examples/fedavg-app's save_results)"
        ),
    }


if __name__ == "__main__":
    raise SystemExit(main())
