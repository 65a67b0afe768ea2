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
4. ``flwr run <app> --stream`` with the run config (``fleet`` set to the launched fleet),
   its log shown and kept in ``<workdir>/run.log``;
5. every process started here (and their children: ``flower-superexec``,
   ``flwr-serverapp``, ``flwr-clientapp``) is stopped by PID at the end, also on a
   failure, on a timeout and on Ctrl-C / SIGTERM.

App dependencies come from this environment (``--disable-runtime-dependency-installation``):
install sky-flower where the SuperLink and SuperNodes run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import IO

import psutil

from sky_flower.emulation.devices import Emulation

PROCESS_NAMES = (
    "flower-superlink",
    "flower-supernode",
    "flower-superexec",
    "flwr-serverapp",
    "flwr-clientapp",
    "flwr-simulation",
)


MAX_NODES = 16  # SuperNode processes one host is asked to run


class DeployError(RuntimeError):
    """The deployment could not start, or the run failed (the message says which)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bind port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    """``name`` from this interpreter's environment (``.venv/bin``), else from PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise DeployError(f"{name} not found: install sky-flower (it installs flwr) here")
    return found


# --------------------------------------------------------------------------------------
# certificates and node keys
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Credentials:
    """Paths of the files :func:`make_credentials` writes."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]  # OpenSSH private keys; public key at ``<key>.pub``


def make_credentials(out: Path, num_nodes: int, days: int = 2) -> Credentials:
    """Generate a CA, a server certificate for 127.0.0.1 / localhost signed by it, and
    ``num_nodes`` SuperNode key pairs (ECDSA P-384, OpenSSH format, what
    ``flower-supernode --auth-supernode-private-key`` and ``flwr supernode register``
    take).

    Parameters
    ----------
    out : Path
        Directory to write into (created).
    num_nodes : int
        SuperNode key pairs to generate.
    days : int
        Validity of the certificates, days.

    Returns
    -------
    Credentials
        The written files' paths.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sky-flower local CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    srv_key = ec.generate_private_key(ec.SECP384R1())
    srv_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(srv_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    creds = Credentials(
        ca_cert=out / "ca.crt",
        server_cert=out / "server.pem",
        server_key=out / "server.key",
        node_keys=tuple(out / f"node{i}" for i in range(num_nodes)),
    )
    creds.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    creds.server_cert.write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    creds.server_key.write_bytes(pem_key(srv_key))
    for path in creds.node_keys:
        key = ec.generate_private_key(ec.SECP384R1())
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            )
        )
        path.with_suffix(".pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
            )
        )
    for path in [creds.server_key, *creds.node_keys]:
        path.chmod(0o600)
    return creds


# --------------------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------------------
def node_config(node: Emulation, partition_id: int, num_partitions: int) -> str:
    """The ``--node-config`` string of a SuperNode emulating ``node``."""
    items = {
        "sky-node": f'"{node.name}"',
        "sky-holds-data": str(node.holds_data).lower(),
        "sky-slowdown": f"{node.slowdown:g}",
        "sky-latency-ms": f"{node.latency_ms:g}",
        "partition-id": str(partition_id),
        "num-partitions": str(num_partitions),
    }
    if node.memory_mb is not None:
        items["sky-memory-mb"] = f"{node.memory_mb:g}"
    if node.bandwidth_mb_s is not None:
        items["sky-bandwidth-mb-s"] = f"{node.bandwidth_mb_s:g}"
    if node.fail_on:
        items["sky-fail-on"] = f'"{node.fail_on}"'
        items["sky-fail-mode"] = f'"{node.fail_mode}"'
    return " ".join(f"{k}={v}" for k, v in items.items())


@dataclass
class LocalDeployment:
    """A SuperLink and SuperNodes on 127.0.0.1, stopped by PID on :meth:`stop`.

    Use as a context manager (stops on exit, also on an exception or Ctrl-C).

    Parameters
    ----------
    workdir : Path
        Where homes, logs, certificates and keys go.
    tls : bool
        TLS (a local CA) and SuperNode authentication (registered keys only).
    simulation : bool
        Start the SuperLink with ``--simulation`` (its own simulation runtime; no
        SuperNodes are started then, ``num-supernodes`` comes from the federation config).
    """

    workdir: Path
    tls: bool = False
    simulation: bool = False
    port: int = 0
    creds: Credentials | None = None
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    _logs: list[IO[bytes]] = field(default_factory=list)
    seen_pids: set[int] = field(default_factory=set)

    # --- set-up --------------------------------------------------------------------
    def _home(self, name: str) -> dict[str, str]:
        env = dict(os.environ)
        home = self.workdir / "home" / name
        home.mkdir(parents=True, exist_ok=True)
        env["FLWR_HOME"] = str(home)
        env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
        env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1")  # default 1 s per hop
        # the SuperLink / SuperNode start flower-superexec etc. by name: this env's first
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        (self.workdir / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
        log_file = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log_file)
        proc = subprocess.Popen(
            cmd,
            env=self._home(name),
            cwd=self.workdir,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches us only; we stop it by PID
        )
        self.procs.append((name, proc))
        self.seen_pids.add(proc.pid)
        return proc

    def log_text(self, name: str) -> str:
        """The log of process ``name`` so far."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start_superlink(self, timeout_s: float = 60.0) -> None:
        """Start the SuperLink and wait until its HTTP API answers.

        Raises
        ------
        DeployError
            If it exits or does not answer within ``timeout_s`` (its log is quoted).
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cmd = [
            _bin("flower-superlink"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
            "--database",
            str(self.workdir / "state.db"),
        ]
        if self.simulation:
            cmd.append("--simulation")
        if self.tls:
            assert self.creds is not None
            cmd += [
                "--ssl-ca-certfile",
                str(self.creds.ca_cert),
                "--ssl-certfile",
                str(self.creds.server_cert),
                "--ssl-keyfile",
                str(self.creds.server_key),
                "--enable-supernode-auth",
            ]
        else:
            cmd.append("--insecure")
        proc = self._spawn("superlink", cmd)
        self._write_cli_config()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DeployError(
                    f"flower-superlink exited with code {proc.returncode}:\n"
                    + self.log_text("superlink")[-2000:]
                )
            if self._healthy():
                return
            time.sleep(0.5)
        raise DeployError(f"flower-superlink did not answer within {timeout_s:g} s")

    def _healthy(self) -> bool:
        """True once the SuperLink's HTTP API answers ``/health``."""
        import httpx

        scheme = "https" if self.tls else "http"
        verify: bool | str = str(self.creds.ca_cert) if self.tls and self.creds else False
        try:
            res = httpx.get(f"{scheme}://127.0.0.1:{self.port}/health", timeout=2, verify=verify)
            return res.is_success
        except httpx.HTTPError:
            return False

    def _write_cli_config(self) -> None:
        home = self.workdir / "home" / "cli"
        home.mkdir(parents=True, exist_ok=True)
        conn = [f'address = "127.0.0.1:{self.port}"']
        if self.tls:
            assert self.creds is not None
            conn.append(f'root-certificates = "{self.creds.ca_cert}"')
        else:
            conn.append("insecure = true")
        (home / "config.toml").write_text(
            '[superlink]\ndefault = "sky"\n\n[superlink.sky]\n' + "\n".join(conn) + "\n"
        )

    def _cli(self, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        """Run ``flwr <args>`` against this SuperLink (bounded by ``timeout_s``)."""
        return subprocess.run(
            [_bin("flwr"), *args],
            env=self._home("cli"),
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def register_node_key(self, public_key: Path, timeout_s: float = 60.0) -> None:
        """``flwr supernode register <public_key>`` (TLS + auth only).

        Raises
        ------
        DeployError
            If the SuperLink does not accept the key.
        """
        res = self._cli(["supernode", "register", str(public_key), "sky"], timeout_s)
        if res.returncode != 0:
            raise DeployError(
                f"flwr supernode register {public_key} failed: {res.stdout}{res.stderr}"
            )

    def start_supernode(
        self,
        index: int,
        config: str,
        private_key: Path | None = None,
        max_wait_s: float = 120.0,
    ) -> subprocess.Popen:
        """Start SuperNode ``index`` with ``--node-config config``.

        ``private_key`` (TLS + auth) authenticates it; a SuperNode gives up after
        ``max_wait_s`` without its SuperLink (it also stops by itself).
        """
        cmd = [
            _bin("flower-supernode"),
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--port",
            str(free_port()),
            "--node-config",
            config,
            "--max-wait-time",
            f"{max_wait_s:g}",
        ]
        if self.tls:
            assert self.creds is not None
            cmd += ["--root-certificates", str(self.creds.ca_cert)]
            if private_key is not None:
                cmd += ["--auth-supernode-private-key", str(private_key)]
        else:
            cmd.append("--insecure")
        return self._spawn(f"supernode{index}", cmd)

    def start_fleet(self, fleet: Sequence[Emulation]) -> None:
        """One SuperNode per fleet node (credentials and key registration with TLS)."""
        for i, node in enumerate(fleet):
            key = None
            if self.tls:
                assert self.creds is not None
                key = self.creds.node_keys[i]
                self.register_node_key(key.with_suffix(".pub"))
            self.start_supernode(i, node_config(node, i, len(fleet)), key)

    # --- the run --------------------------------------------------------------------
    def flwr_run(
        self,
        app: Path,
        run_config: str = "",
        federation_config: str = "",
        timeout_s: float = 900.0,
        echo: bool = True,
    ) -> str:
        """``flwr run <app> sky --stream``; returns its output (also in ``run.log``).

        Raises
        ------
        DeployError
            If ``flwr run`` fails, a process exits early, or the run outlasts
            ``timeout_s`` seconds.
        """
        cmd = [_bin("flwr"), "run", str(app.resolve()), "sky", "--stream"]
        if run_config:
            cmd += ["--run-config", run_config]
        if federation_config:
            cmd += ["--federation-config", federation_config]
        out_path = self.workdir / "run.log"
        lines: list[str] = []
        proc = subprocess.Popen(
            cmd,
            env=self._home("cli"),
            cwd=self.workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.procs.append(("flwr-run", proc))
        self.seen_pids.add(proc.pid)
        deadline = time.monotonic() + timeout_s
        queue: Queue[str | None] = Queue()

        def pump() -> None:  # a thread: the pipe is read line by line without blocking us
            assert proc.stdout is not None
            for line in proc.stdout:
                queue.put(line)
            queue.put(None)

        threading.Thread(target=pump, daemon=True).start()
        with open(out_path, "w") as out:
            while True:
                try:
                    line = queue.get(timeout=0.5)
                except Empty:
                    line = ""
                if line is None:
                    break
                if line:
                    lines.append(line)
                    out.write(line)
                    out.flush()
                    if echo:
                        sys.stdout.write(line)
                        sys.stdout.flush()
                if time.monotonic() > deadline:
                    raise DeployError(f"the run did not finish within {timeout_s:g} s")
                self._check_alive()
            proc.wait(timeout=30)
        text = "".join(lines)
        if proc.returncode != 0:
            raise DeployError(f"flwr run exited with code {proc.returncode}:\n{text[-3000:]}")
        return text

    def _check_alive(self) -> None:
        for name, proc in self.procs:
            if name == "superlink" and proc.poll() is not None:
                raise DeployError(
                    f"flower-superlink exited with code {proc.returncode} during the run:\n"
                    + self.log_text("superlink")[-2000:]
                )

    # --- tear-down ------------------------------------------------------------------
    def descendants(self) -> list[psutil.Process]:
        """Every live process started here and its children (by PID)."""
        found: dict[int, psutil.Process] = {}
        for _, proc in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(proc.pid)
                for q in [p, *p.children(recursive=True)]:
                    found[q.pid] = q
        self.seen_pids.update(found)
        return list(found.values())

    def stop(self, grace_s: float = 10.0) -> list[int]:
        """Stop every process started here and their children, by PID: SIGTERM, then
        SIGKILL after ``grace_s``. Returns the PIDs still alive after that (none)."""
        for _ in range(3):  # a dying SuperLink may still spawn; look again
            procs = self.descendants()
            if not procs:
                break
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.terminate()
            _, alive = psutil.wait_procs(procs, timeout=grace_s)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(alive, timeout=grace_s)
        for _, proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
        for f in self._logs:
            f.close()
        return [pid for pid in self.seen_pids if psutil.pid_exists(pid) and _alive(pid)]

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def flower_processes(workdir: Path) -> list[psutil.Process]:
    """Live Flower processes (:data:`PROCESS_NAMES` in their command line) whose
    ``FLWR_HOME`` lies under ``workdir``: what a deployment there may have left."""
    root = str(Path(workdir).resolve())
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if not any(name in cmd for name in PROCESS_NAMES) or not _alive(proc.pid):
                continue
            if proc.environ().get("FLWR_HOME", "").startswith(root):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt (so the launcher cleans up on both)."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


ROUND_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+|-)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def parse_rounds(log_text: str) -> list[dict[str, float]]:
    """The per-round table rows in a Sky run's log (``round, train_loss, test_accuracy,
    step_time_s, predicted_s, round_s``), and round 0 (``Initial global evaluation``)."""
    rows: list[dict[str, float]] = []
    for line in log_text.splitlines():
        clean = re.sub(r"\x1b\[[0-9;]*m", "", line)
        clean = clean.split(":", 1)[1] if clean.lstrip().startswith("INFO") else clean
        m = ROUND_ROW.match(clean)
        if m and m.group(3) != "-":
            rows.append(
                {
                    "round": int(m.group(1)),
                    "train_loss": float(m.group(2)),
                    "test_accuracy": float(m.group(3)),
                    "step_time_s": float(m.group(4)),
                    "predicted_s": float(m.group(5)),
                    "round_s": float(m.group(6)),
                }
            )
        m0 = re.search(r"Initial global evaluation: .*'accuracy': ([\d.e-]+)", clean)
        if m0:
            rows.append({"round": 0, "test_accuracy": float(m0.group(1))})
    return rows


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


def evaluate_accuracies(log_text: str) -> dict[int, float]:
    """Round -> server-side test accuracy from the ``Final results:`` block that
    Flower's ``Strategy.start`` (FedAvg) and ``SkyStrategy.start`` both log."""
    if "ServerApp-side Evaluate Metrics:" not in log_text:
        return {}
    block = re.sub(r"\x1b\[[0-9;]*m", "", log_text.rsplit("ServerApp-side Evaluate Metrics:", 1)[1])
    found = re.findall(r"(\d+): \{'accuracy': '([-+.\deE]+)'", block)
    return {int(r): float(a) for r, a in found}


def run_local(
    app: Path,
    fleet_name: str,
    tls: bool = False,
    simulation: bool = False,
    run_config: str = "",
    workdir: Path | None = None,
    timeout_s: float = 900.0,
    echo: bool = True,
) -> tuple[str, list[int]]:
    """Start a local deployment for fleet ``fleet_name``, run ``app``, stop everything.

    Returns
    -------
    (str, list of int)
        ``flwr run``'s output, and the PIDs of every process that was started.

    Raises
    ------
    DeployError
        If a process fails to start, the run fails, or processes are left behind.
    ValueError
        On an unknown fleet (lists the packaged ones).
    """
    from sky_flower.app import load_fleet

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
    if "fleet" in app_run_config(app):  # a Sky app: the server plans for this fleet
        run_config = " ".join(x for x in (f"fleet='{fleet_name}'", run_config) if x)
    check_run_config(app, run_config)
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="sky-deploy-")
        workdir = Path(tmp.name)
    dep = LocalDeployment(workdir=workdir, tls=tls, simulation=simulation)
    try:
        with _sigterm_as_interrupt():
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
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.cleanup()
    if left:
        raise DeployError(f"processes left behind: {left}")
    return text, pids


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry: see the module docstring. Exit status 0 when the run finished
    with its final summary, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m sky_flower.deploy", description=__doc__.splitlines()[0]
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
        text, pids = run_local(
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
    rows = parse_rounds(text)
    summary = {
        "processes_started_and_stopped": len(pids),
        "test_accuracy": evaluate_accuracies(text),  # any app whose strategy logs a Result
        "rounds": rows,  # Sky's per-round table
    }
    print(json.dumps(summary))
    return 0 if "Final results:" in text else 1


if __name__ == "__main__":
    raise SystemExit(main())
