"""The processes of a local deployment: a SuperLink and SuperNodes on 127.0.0.1 with a
private ``FLWR_HOME`` each, ``flwr run --stream``, and stopping all of them (and their
children) by PID (:class:`LocalDeployment`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import IO

import psutil

from sky_flower.deploy.tls import Credentials
from sky_flower.emulation.devices import Emulation

PROCESS_NAMES = (
    "flower-superlink",
    "flower-supernode",
    "flower-superexec",
    "flwr-serverapp",
    "flwr-clientapp",
    "flwr-simulation",
)


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
    if node.device != "auto":
        items["sky-device"] = f'"{node.device}"'
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
        """Every live process started here and its children (by PID), and any Flower
        process with this deployment's ``FLWR_HOME`` that has lost its parent (a
        SuperNode that exits by itself, e.g. refused by the SuperLink, orphans its
        ``flower-superexec``)."""
        found: dict[int, psutil.Process] = {}
        for _, proc in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(proc.pid)
                for q in [p, *p.children(recursive=True)]:
                    found[q.pid] = q
        for q in flower_processes(self.workdir):
            found.setdefault(q.pid, q)
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


def sigterm_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """SIGTERM raises KeyboardInterrupt (so the launcher cleans up on both)."""
    from sky_flower.flower.shutdown import signals_interrupt

    return signals_interrupt(signals=(signal.SIGTERM,))
