"""Local deployment launcher: a SuperLink and N SuperNodes on 127.0.0.1, then ``flwr run``.

::

    python -m sky_flower.deploy examples/sky-app                    # plain, fleet edge4
    python -m sky_flower.deploy examples/sky-app --tls              # TLS + node auth
    python -m sky_flower.deploy examples/sky-app --fleet edge3 --run-config "num-server-rounds=2"
    python -m sky_flower.deploy examples/sky-app --simulation       # simulation runtime

Everything uses Flower's own processes and CLI (``flower-superlink``,
``flower-supernode``, ``flwr supernode register``, ``flwr run --stream``):

1. a private ``FLWR_HOME`` per process in a work directory (a temporary one unless
   ``--workdir``), free ports picked by binding port 0;
2. with ``--tls``: a CA, a server certificate for 127.0.0.1 / localhost and one P-384
   key pair per SuperNode, generated here (``cryptography``); the SuperLink runs with
   ``--ssl-*`` and ``--enable-supernode-auth``, each public key is registered with
   ``flwr supernode register`` before its SuperNode starts (a SuperNode whose key is
   not registered is refused by the SuperLink);
3. one SuperNode per node of the fleet, its ``--node-config`` carrying its emulated
   device (``sky-node``, ``sky-holds-data``, ``sky-slowdown``, ``sky-memory-mb``,
   ``sky-latency-ms``, ``sky-bandwidth-mb-s``) and its data partition
   (``partition-id``, ``num-partitions``);
4. ``flwr run <app> --stream`` with the run config (``fleet`` set to the launched fleet,
   ``results-path`` to ``<workdir>/results.json`` for an app with that key), its log
   shown and kept in ``<workdir>/run.log``; the run's results are read from that JSON
   file (never from the log);
5. every process started here (and their children: ``flower-superexec``,
   ``flwr-serverapp``, ``flwr-clientapp``) is stopped by PID at the end, also on a
   failure, on a timeout and on Ctrl-C / SIGTERM.

App dependencies come from this environment (``--disable-runtime-dependency-installation``):
install sky-flower where the SuperLink and SuperNodes run.

Modules: :mod:`sky_flower.deploy.tls` (credentials), :mod:`sky_flower.deploy.local`
(processes), :mod:`sky_flower.deploy.__main__` (the command line); here the checks before
anything starts and :func:`run_local`.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from sky_flower.deploy.local import (
    PROCESS_NAMES,
    DeployError,
    LocalDeployment,
    flower_processes,
    free_port,
    node_config,
    sigterm_as_interrupt,
)
from sky_flower.deploy.tls import Credentials, make_credentials

__all__ = [
    "PROCESS_NAMES",
    "Credentials",
    "DeployError",
    "LocalDeployment",
    "MAX_NODES",
    "app_run_config",
    "check_run_config",
    "flower_processes",
    "free_port",
    "make_credentials",
    "node_config",
    "read_results",
    "run_local",
    "round_accuracies",
]

MAX_NODES = 16  # SuperNode processes one host is asked to run
RESULTS_KEY = "results-path"  # the run-config key an app writes its results.json to


def app_run_config(app: Path) -> dict:
    """The app's ``[tool.flwr.app.config]`` (its run-config keys and defaults).

    Raises
    ------
    DeployError
        If ``app`` has no readable ``pyproject.toml``.
    """
    import tomllib

    path = app / "pyproject.toml"
    try:
        project = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise DeployError(f"cannot read {path}: {err} (pass a Flower app directory)") from err
    return dict(project.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}))


def check_run_config(app: Path, overrides: str) -> dict:
    """Refuse a bad ``--run-config`` before any process starts; return the merged config.

    An override must name a key of the app's ``[tool.flwr.app.config]`` (Flower refuses
    others with only "Invalid run configuration"); for a Sky app (one with an
    ``allocation`` key) the values are checked by
    :func:`sky_flower.app.validate_run_config`.

    Raises
    ------
    DeployError
        On an unknown key (lists the valid ones), a malformed string, or a bad value
        (lists the valid choices).
    """
    from flwr.common.config import parse_config_args

    defaults = app_run_config(app)
    try:
        given = parse_config_args([overrides]) if overrides.strip() else {}
    except Exception as err:  # noqa: BLE001 - click's message says what is wrong
        raise DeployError(f"--run-config {overrides!r}: {err}") from err
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise DeployError(
            f"unknown run config key(s) {unknown} for {app}: valid keys are {', '.join(defaults)}"
        )
    merged = {**defaults, **given}
    if "allocation" in defaults:
        from sky_flower.app import validate_run_config

        try:
            validate_run_config(merged, app_keys=tuple(defaults))
        except ValueError as err:
            raise DeployError(str(err)) from err
    return merged


def run_local(
    app: Path,
    fleet_name: str,
    tls: bool = False,
    simulation: bool = False,
    run_config: str = "",
    workdir: Path | None = None,
    timeout_s: float = 900.0,
    echo: bool = True,
) -> tuple[str, list[int], dict[str, Any] | None]:
    """Start a local deployment for fleet ``fleet_name``, run ``app``, stop everything.

    An app with a ``results-path`` run-config key writes its results there: unless
    ``run_config`` sets it, ``<workdir>/results.json`` (read back before a temporary
    work directory is removed). On SuperNodes (not ``simulation``) a Sky app whose
    ``run_config`` picks no transport runs ``transport='stream'``
    (:func:`with_deployment_transport`).

    Returns
    -------
    (str, list of int, dict or None)
        ``flwr run``'s output, the PIDs of every process that was started, and the
        run's ``results.json`` (``None``: the app has no ``results-path`` key; one with
        ``completed`` false and an ``error`` if the run wrote none).

    Raises
    ------
    DeployError
        If a process fails to start, the run fails, or processes are left behind.
    ValueError
        On an unknown fleet (lists the packaged ones), or a ``workdir`` that is a file.
    """
    fleet, run_config = _checked(app, fleet_name, run_config, timeout_s)
    if not simulation:
        run_config = with_deployment_transport(app, run_config)
    if tls:
        refuse_plaintext_direct(run_config)
    if workdir is not None:
        workdir = Path(workdir).resolve()  # the processes run in other directories
        if workdir.exists() and not workdir.is_dir():
            raise ValueError(f"workdir {workdir} is a file: pass a directory (it is created)")
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="sky-deploy-")
        workdir = Path(tmp.name)
    run_config, results_path = _with_results_path(app, run_config, workdir)
    dep = LocalDeployment(workdir=workdir, tls=tls, simulation=simulation)
    try:
        with sigterm_as_interrupt():
            if tls:
                dep.creds = make_credentials(workdir / "creds", len(fleet))
            dep.start_superlink()
            federation = ""
            if simulation:
                federation = (
                    f"num-supernodes={len(fleet)} client-resources-num-cpus=1 "
                    f"init-args-num-cpus={len(fleet)}"
                )
            else:
                dep.start_fleet(fleet)
            text = dep.flwr_run(app, run_config, federation, timeout_s=timeout_s, echo=echo)
    finally:
        left = dep.stop()
        pids = sorted(dep.seen_pids)
        results = None
        if results_path is not None:  # the app writes results.json: it must be there
            results = read_results(results_path) or {
                "error": f"the run wrote no {results_path} (see run.log)",
                "completed": False,
            }
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.cleanup()
    if left:
        raise DeployError(f"processes left behind: {left}")
    return text, pids, results


def _checked(app: Path, fleet_name: str, run_config: str, timeout_s: float) -> tuple[Any, str]:
    """The fleet's nodes and the run config with ``fleet`` set (a Sky app), checked
    before anything starts (see :func:`run_local`)."""
    from sky_flower.app import load_fleet
    from sky_flower.emulation.devices import check_fleet_devices

    fleet = load_fleet(fleet_name)
    if len(fleet) > MAX_NODES:
        raise DeployError(
            f"fleet {fleet_name!r} has {len(fleet)} nodes; this launcher starts one SuperNode "
            f"process per node on this host, at most {MAX_NODES}: use a smaller fleet"
        )
    if re.search(r"(^|\s)fleet\s*=", run_config):
        raise ValueError(
            f"--run-config sets fleet ({run_config!r}): the launcher starts the SuperNodes of "
            f"--fleet and tells the app; pass --fleet NAME instead (now {fleet_name!r})"
        )
    if not timeout_s > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {timeout_s:g}")
    try:  # every SuperNode runs on this host: a CUDA node here needs CUDA here
        check_fleet_devices(fleet)
    except ValueError as err:
        raise DeployError(f"fleet {fleet_name!r}: {err}") from err
    if "fleet" in app_run_config(app):  # a Sky app: the server plans for this fleet
        run_config = " ".join(x for x in (f"fleet='{fleet_name}'", run_config) if x)
    check_run_config(app, run_config)
    return fleet, run_config


def with_deployment_transport(app: Path, run_config: str) -> str:
    """``run_config`` with ``transport='stream'`` first, for a Sky app (one with a
    ``transport`` key) whose run config does not choose a transport: in deployment a
    relay hop is a Flower message (seconds each), a stream hop a frame on the round's
    data plane (:mod:`sky_flower.sky.transport.stream`), so the plans assume the stream."""
    if "transport" not in app_run_config(app) or re.search(r"(^|\s)transport\s*=", run_config):
        return run_config
    return " ".join(x for x in ("transport='stream'", run_config) if x)


PLAINTEXT_DIRECT = (
    "transport='direct' sends activations, gradients and stage weights between the stage "
    "nodes in plaintext (gloo's TCP sockets have no encryption), and every stage node must "
    "reach every other one and the server's TCPStore"
)


def refuse_plaintext_direct(run_config: str) -> None:
    """Refuse ``transport='direct'`` in a TLS-secured run (:data:`PLAINTEXT_DIRECT`).

    Raises
    ------
    DeployError
        Naming the risk and the fixes: ``transport='stream'`` (TLS, outbound only) or a
        run without ``--tls`` on a trusted network.
    """
    if re.search(r"(^|\s)transport\s*=\s*['\"]direct['\"]", run_config):
        raise DeployError(
            f"--tls asks for an encrypted run, but {PLAINTEXT_DIRECT}. Use "
            "transport='stream' (TLS, stage nodes connect out to the server only), or drop "
            "--tls on a trusted network"
        )


def _with_results_path(app: Path, run_config: str, workdir: Path) -> tuple[str, Path | None]:
    """``run_config`` with ``results-path`` set (to ``<workdir>/results.json`` unless it
    names one) for an app with that key, and the path; ``(run_config, None)`` else. A
    stale file there is removed first."""
    from flwr.common.config import parse_config_args

    if RESULTS_KEY not in app_run_config(app):
        return run_config, None
    given = parse_config_args([run_config]) if run_config.strip() else {}
    if given.get(RESULTS_KEY):
        path = Path(str(given[RESULTS_KEY])).resolve()
    else:
        path = (Path(workdir) / "results.json").resolve()
        run_config = " ".join(x for x in (run_config, f"{RESULTS_KEY}='{path}'") if x)
    path.unlink(missing_ok=True)
    return run_config, path


def read_results(path: Path) -> dict[str, Any] | None:
    """The ``results.json`` a run wrote at ``path`` (``None`` if it wrote none)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def round_accuracies(results: dict[str, Any] | None) -> dict[int, float]:
    """Round -> server-side test accuracy of a run's ``results.json`` (round 0: the
    initial model's)."""
    if not results:
        return {}
    found = {0: results.get("initial_test_accuracy")}
    found.update({int(r["round"]): r.get("test_accuracy") for r in results.get("rounds", [])})
    return {r: float(a) for r, a in found.items() if a is not None}
