"""Benchmark: Sky on a real SuperLink and SuperNodes on 127.0.0.1 (issue 27).

Four tables, each from real deployments started by the launcher (:mod:`sky_flower.deploy`):

1. **Hop latency**: one Flower message (``query.sky_echo`` through the SuperLink and a
   SuperNode, a fresh ClientApp process each) against one stream hop (an echo frame on
   the round's data plane, :mod:`sky_flower.sky.transport.stream_probe`), 1 KiB and 4 MiB each
   way, median and p90. A tiny probe app (``examples/hop-probe``) does both from its
   ServerApp against the fleet's first SuperNode.
2. **The same plan on relay, stream and direct**: the sky-app, ``allocation=even``
   (one stage per node), ``gpipe`` with 4 micro-batches, 1 round of ``--steps`` steps:
   measured step (median), predicted step, the round's wall time (``round_time_s``:
   set-up, steps and collection, Flower's messages included).

3. **Time to a target test accuracy, FedAvg against Sky** (``--only accuracy``): per
   fleet (``--fleets``: a straggler owner, a phone that cannot hold the model, a uniform
   fleet; ``conf/fleet/*_owners*.yaml``), a FedAvg probe app (``examples/fedavg-probe``,
   assembled in the work directory by :func:`fedavg_probe`: Flower's ``FedAvg`` on the
   example fedavg-app's model, data and test, each SuperNode's emulated slowdown and
   link applied as Sky applies them, and an owner whose memory cap cannot hold the
   model's training memory trains nothing), once per local-epoch count of
   ``--fedavg-epochs``, and the sky-app on ``transport='stream'``
   with stage sessions (``allocation=heuristic``, one local epoch), ``--rounds`` rounds
   each, Adam at ``--lr``, batch 32. The time to ``--target`` is counted **from the
   run's launch** (the launcher's start: SuperLink, SuperNodes, ``flwr run``, Sky's
   benchmark round and session set-up all included) to the arrival of the log line that
   reports the evaluation of the first round at the target (each line of ``flwr run
   --stream`` is stamped as it arrives, ``run.timed.log`` in the run's work directory);
   the sum of the rounds' times up to it is kept beside it. Also: the share of the
   owners' data trained.
4. **Stage sessions round by round** (``--only rounds``): per fleet (``--fleets``), the
   sky-app on ``transport='stream'``, ``allocation=even`` (equal layer counts, nodes in
   fleet order: the same plan in every variant), ``gpipe`` with 4 micro-batches of 16,
   ``--rounds`` rounds of ``--round-steps`` steps: (a) deployed with stage sessions
   (``stream-sessions=true``), (b) deployed with a set-up message per stage per round
   (``stream-sessions=false``), both on the launcher with ``--tls``, (c) the same plan in
   Flower's simulation engine: the Hydra job (``python -m sky_flower.run``) with the
   sky-app's model shape, batch, schedule, steps, optimizer, benchmark and polling
   settings (:func:`hydra_overrides`; the app itself under ``flwr run``'s simulation
   runtime would plan differently: its SuperNodes carry no ``sky-holds-data``, so each
   owns data; ``--variants`` ``flwr_simulation`` runs it anyway). Per variant: round 1
   and the median steady-state round (rounds 2 on), Flower messages per round, measured
   / predicted per round (round time and step), and the steady-state round against the
   simulation engine's.

Usage::

    python -m sky_flower.bench.deployment                  # all tables, about 70 min
    python -m sky_flower.bench.deployment --only hops      # table 1, about 2 min
    python -m sky_flower.bench.deployment --only accuracy  # table 3, about 40 min
    python -m sky_flower.bench.deployment --only rounds    # table 4, about 15 min
    # the reduced runs of docs/benchmarks/2026-12-06-stream-sessions.md (4 and 9 min)
    python -m sky_flower.bench.deployment --only rounds --fleets edge3 --rounds 6
    python -m sky_flower.bench.deployment --only accuracy --fleets straggler_owners4 \\
        --fedavg-epochs 1,2

(Times on the project's shared 2-core VM.)

Prints the tables and writes ``table.md`` and ``results.json`` into ``--out`` (both
rewritten after every run, so a cut benchmark keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from sky_flower import tables
from sky_flower.bench import cli
from sky_flower.bench.zoo import EXAMPLES, example_module
from sky_flower.core.profile import LayerProfile
from sky_flower.deploy import read_results, run_local
from sky_flower.emulation.devices import Emulation

SKY_APP = EXAMPLES / "sky-app"


def p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, int(0.9 * len(s)))]


def hops(workdir: Path, fleet: str, repeats: int) -> dict[str, Any]:
    """Table 1's figures: per path and size, the round trips (s), median and p90."""
    _, _, res = run_local(
        EXAMPLES / "hop-probe",
        fleet,
        run_config=f"repeats={repeats}",
        workdir=workdir / "hops",
        timeout_s=900,
        echo=False,
    )
    if not res or "flower" not in res:
        raise RuntimeError(f"the probe app wrote no figures: {res}")
    return {
        path: {
            size: {"median_s": statistics.median(v), "p90_s": p90(v), "n": len(v)}
            for size, v in res[path].items()
        }
        for path in ("flower", "stream")
    }


def transports(
    workdir: Path, fleet: str, steps: int, which: tuple[str, ...] = ("relay", "stream", "direct")
) -> dict[str, Any]:
    """Table 2's figures: per transport, the round's row of ``results.json``."""
    out: dict[str, Any] = {}
    base = (
        "num-server-rounds=1 echo-repeats=1 state-probe-mb=0.0 benchmark-repeats=2 "
        f"message-timeout-s=120.0 allocation='even' schedule-kind='gpipe' microbatches=4 "
        f"steps-per-round={steps}"
    )
    for transport in which:
        t0 = time.perf_counter()
        try:
            _, _, res = run_local(
                SKY_APP,
                fleet,
                run_config=f"{base} transport='{transport}'",
                workdir=workdir / transport,
                timeout_s=1200,
                echo=False,
            )
            (row,) = (res or {}).get("rounds") or [{"error": (res or {}).get("error")}]
        except Exception as err:  # noqa: BLE001 - recorded in the table
            row = {"error": f"{type(err).__name__}: {err}"[:300]}
        row["run_wall_s"] = time.perf_counter() - t0
        out[transport] = row
    return out


# --- table 3: time to a target test accuracy, FedAvg against Sky -------------------------
FEDAVG_APP = EXAMPLES / "fedavg-app"
ACCURACY_FLEETS = ("straggler_owners4", "phone_owners4", "uniform_owners3")
BATCH = 32  # the fedavg-app's batch size (task.train)


def fedavg_probe(app: Path) -> Path:
    """Assemble the FedAvg probe app (``examples/fedavg-probe``) in ``app``, with the
    fedavg-app's ``task.py`` beside it as ``fedavg_task.py``; return ``app``."""
    shutil.copytree(EXAMPLES / "fedavg-probe", app, dirs_exist_ok=True)
    shutil.copy(FEDAVG_APP / "fedavg_app" / "task.py", app / "fedavg_task.py")
    return app


def training_bytes(layers: Sequence[LayerProfile], batch: int) -> float:
    """Bytes to train all of ``layers`` on one node at ``batch`` samples a step, as the
    planner counts a stage (:meth:`sky_flower.core.cost.CostModel.stage_memory` with the
    whole batch in flight): weights, gradients and optimizer state (frozen weights
    without either), plus ``batch`` x the
    activations autograd stashes per sample (the output's size when not measured)."""
    static = sum(lp.static_bytes for lp in layers)
    stash = sum(lp.act_out_bytes if lp.stash_bytes is None else lp.stash_bytes for lp in layers)
    return float(static + batch * stash)


def model_training_bytes(model: Any, input_shape: Sequence[int], batch: int) -> float:  # noqa: ANN401 - a torch module
    """:func:`training_bytes` of ``model`` profiled by the project's profiler (Adam)."""
    from sky_flower.core.profile import profile_layers

    return training_bytes(profile_layers(model, input_shape, batch), batch)


def fedavg_owners(fleet: Sequence[Emulation], need_bytes: float) -> list[str]:
    """The data owners FedAvg can use: those whose memory cap (none: no cap) holds
    ``need_bytes``, the whole model's training memory (:func:`training_bytes`)."""
    return [n.name for n in fleet if n.holds_data and n.memory_bytes(available=2**62) >= need_bytes]


def rounds_to_target(accuracies: Sequence[float | None], target: float) -> int | None:
    """The first round (1-based) whose test accuracy is at least ``target``; ``None``
    if none is (a missing accuracy, ``None``, never counts). Accuracies are float32
    means (324/360 is 0.8999999761581421), so ``target`` is met within 1e-6."""
    for r, acc in enumerate(accuracies, start=1):
        if acc is not None and acc >= target - 1e-6:
            return r
    return None


def time_to_target(rows: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """Seconds to ``target``: the sum of ``round_time_s`` over the rounds up to and
    including the first that reaches it (``rows`` in round order, from round 1);
    ``None`` if no round reaches it."""
    r = rounds_to_target([row.get("test_accuracy") for row in rows], target)
    return None if r is None else float(sum(row["round_time_s"] for row in rows[:r]))


# --- a run's log, stamped line by line as flwr run --stream delivers it ------------------
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SKY_ROUND_LINE = re.compile(  # report.log_round_line: round, loss, test acc, step, pred, round
    r"^INFO\s*:\s+(\d+)\s+\S+\s+(?:[\d.]+|-)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s*$"
)
FLOWER_ROUND_LINE = re.compile(r"\[ROUND (\d+)/\d+\]")  # Flower's Strategy.start
STRATEGY_START = re.compile(r"Starting (\w+) strategy")


class TimedLines(io.TextIOBase):
    """A stand-in for ``sys.stdout`` that keeps every line written to it with the time
    it arrived (s after ``t0``, a :func:`time.time`), and writes them, stamped, to
    ``path``: ``run_local(echo=True)`` echoes each line of ``flwr run --stream`` as it
    comes (Flower uploads a run's log every 0.2 s and streams it every 0.5 s, so a line
    arrives about a second after the run logged it)."""

    def __init__(self, t0: float, path: Path) -> None:
        super().__init__()
        self.t0, self.lines, self._buf = t0, [], ""
        self._file = open(path, "w")  # noqa: SIM115 - closed in close()

    def write(self, text: str) -> int:
        """Keep each complete line with its arrival time."""
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            t = time.time() - self.t0
            self.lines.append((t, line))
            self._file.write(f"{t:9.3f} {line}\n")
        self._file.flush()
        return len(text)

    def close(self) -> None:
        """Close the stamped log."""
        self._file.close()
        super().close()


def log_marks(lines: Sequence[tuple[float, str]]) -> dict[str, Any]:
    """When (s after the launch) a run's log showed: its strategy starting
    (``strategy_start_s``), round 1 starting (``round1_start_s``: Sky's per-round table
    header, after its benchmark round and plan; Flower's ``[ROUND 1/N]``), and each
    round's server-side evaluation (``evaluated_s``, round -> s: Sky's per-round line,
    logged after the evaluation; Flower's ``└──> MetricRecord`` after ``Global
    evaluation``). ``lines`` as :class:`TimedLines` keeps them."""
    out: dict[str, Any] = {"strategy_start_s": None, "round1_start_s": None, "evaluated_s": {}}
    current, evaluating = 0, False
    for t, raw in lines:
        line = ANSI.sub("", raw).rstrip()
        if out["strategy_start_s"] is None and STRATEGY_START.search(line):
            out["strategy_start_s"] = t
        if m := FLOWER_ROUND_LINE.search(line):
            current, evaluating = int(m.group(1)), False
            if current == 1 and out["round1_start_s"] is None:
                out["round1_start_s"] = t
        elif "Global evaluation" in line:
            evaluating = True
        elif evaluating and "MetricRecord" in line:
            out["evaluated_s"].setdefault(current, t)
            evaluating = False
        elif re.search(r"INFO\s*:\s+round\s+train loss", line) and out["round1_start_s"] is None:
            out["round1_start_s"] = t
        elif m := SKY_ROUND_LINE.match(line):
            out["evaluated_s"].setdefault(int(m.group(1)), t)
    return out


@contextlib.contextmanager
def stamped(workdir: Path) -> Iterator[tuple[TimedLines, dict[str, Any]]]:
    """A run's log sink, every line stamped from now (``run.timed.log`` in ``workdir``),
    and its marks, filled when the block ends: :func:`log_marks` with ``launch_unix_s``,
    ``run_wall_s`` and ``load_avg`` (1-min load at the start and end)."""
    workdir.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.time(), os.getloadavg()[0]
    sink, marks = TimedLines(t0, workdir / "run.timed.log"), {}
    try:
        yield sink, marks
    finally:
        sink.close()
        marks.update(log_marks(sink.lines), launch_unix_s=t0, run_wall_s=time.time() - t0)
        marks["load_avg"] = [load0, os.getloadavg()[0]]


def timed_run(
    app: Path, fleet: str, workdir: Path, timeout_s: float, **kw: Any
) -> tuple[dict[str, Any] | None, dict[str, Any], str | None]:
    """``run_local`` with every log line stamped from the launch (:func:`stamped`): the
    run's ``results.json``, its marks and the error that ended it."""
    res, err = None, None
    with stamped(workdir) as (sink, marks), contextlib.redirect_stdout(sink):
        try:
            _, _, res = run_local(app, fleet, workdir=workdir, timeout_s=timeout_s, **kw)
        except Exception as e:  # noqa: BLE001 - recorded in the table
            err = f"{type(e).__name__}: {e}"[:300]
            res = read_results(workdir / "results.json")  # what it wrote before it failed
    return res, marks, err


# --- table 3: rows ----------------------------------------------------------------------
def accuracy_row(res: Mapping[str, Any] | None, target: float) -> dict[str, Any]:
    """One run's figures for table 3 from its ``results.json`` (the time from the launch,
    ``time_to_target_s``, comes from its log: :func:`with_launch_times`)."""
    if not res or not res.get("rounds"):
        return {"error": (res or {}).get("error") or "no rounds in results.json"}
    rows = sorted(res["rounds"], key=lambda row: row["round"])
    failed = [row for row in rows if row.get("error")]
    accs = [row.get("test_accuracy") for row in rows]
    out: dict[str, Any] = {
        "accuracies": accs,
        "round_times_s": [row.get("round_time_s") for row in rows],
        "rounds_to_target": rounds_to_target(accs, target),
        "rounds_sum_to_target_s": None if failed else time_to_target(rows, target),
        "samples_trained": rows[0].get("samples_trained"),
        "error": failed[0]["error"] if failed else None,
    }
    if rows[0].get("pipelines"):  # Sky: the plan and the owners' data
        out["plan"] = "; ".join("+".join(p["nodes"]) for p in rows[0]["pipelines"])
        out["owner_samples"] = sum(int(p["samples"]) for p in rows[0]["pipelines"])
    if rows[0].get("setup_s") is not None:  # Sky on stream: the sessions' set-up
        out["setup_s"] = [row.get("setup_s") for row in rows]
        out["flower_messages"] = [row.get("flower_messages") for row in rows]
    return out


def with_launch_times(row: dict[str, Any], marks: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` (:func:`accuracy_row`) with the times from the run's launch (its
    :func:`log_marks`): ``time_to_target_s`` (the log line of the first round at the
    target; ``None`` if none reached it or the line was not found),
    ``round1_start_s``, ``strategy_start_s``, ``evaluated_s`` per round in order."""
    evaluated = {int(r): t for r, t in marks.get("evaluated_s", {}).items()}
    r = row.get("rounds_to_target")
    row["time_to_target_s"] = None if r is None or row.get("error") else evaluated.get(r)
    row["round1_start_s"] = marks.get("round1_start_s")
    row["strategy_start_s"] = marks.get("strategy_start_s")
    row["evaluated_s"] = [evaluated.get(i) for i in range(1, len(row.get("accuracies", [])) + 1)]
    row["run_wall_s"] = marks.get("run_wall_s")
    row["load_avg"] = marks.get("load_avg")
    return row


def accuracy(
    workdir: Path,
    fleets: Sequence[str],
    rounds: int,
    lr: float,
    target: float,
    fedavg_epochs: Sequence[int] = (1,),
    out: dict[str, Any] | None = None,
    save: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Table 3's figures: per fleet, the FedAvg probe (once per local-epoch count of
    ``fedavg_epochs``: ``fedavg_e<N>``) and the sky-app (stream, sessions) rows, filled
    into ``out`` run by run (``save()`` after each)."""
    from sky_flower.app import load_fleet

    app = fedavg_probe(workdir / "fedavg-probe")
    net = example_module("fedavg-app", "fedavg_app.task").Net()
    need = model_training_bytes(net, [64], BATCH)
    common = f"num-server-rounds={rounds} lr={lr} batch-size={BATCH}"
    sky = (
        f"{common} local-epochs=1.0 allocation='heuristic' transport='stream' "
        "stream-sessions=true schedule-kind='gpipe' microbatches=4 optimizer='adam' "
        "benchmark-repeats=1 echo-repeats=1 state-probe-mb=0.0 message-timeout-s=120.0"
    )
    out = {} if out is None else out
    out["need_bytes"] = need
    for fleet in fleets:
        nodes = load_fleet(fleet)
        runs = {"sky": (SKY_APP, sky)}  # first: a cut benchmark keeps Sky's run
        runs.update(
            (f"fedavg_e{e}", (app, f"{common} local-epochs={float(e)} min-nodes={len(nodes)}"))
            for e in fedavg_epochs
        )
        entry: dict[str, Any] = {
            "owners": [n.name for n in nodes if n.holds_data],
            "fedavg_owners": fedavg_owners(nodes, need),
        }
        out[fleet] = entry
        for method, (path, config) in runs.items():
            res, marks, err = timed_run(
                path, fleet, workdir / f"{fleet}-{method}", 1800, run_config=config, echo=True
            )
            row = accuracy_row(res, target)
            if err:
                row["error"] = err
            entry[method] = with_launch_times(row, marks)
            save()
    return out


def fedavg_methods(entry: Mapping[str, Any]) -> list[str]:
    """An accuracy entry's FedAvg runs (``fedavg_e<N>``), by local epochs."""
    keys = [k for k in entry if k.startswith("fedavg_e")]
    return sorted(keys, key=lambda k: int(k.removeprefix("fedavg_e")))


def best_fedavg(entry: Mapping[str, Any]) -> str | None:
    """The FedAvg run that reached the target soonest from its launch (None: none did)."""
    timed = [
        (entry[k]["time_to_target_s"], k)
        for k in fedavg_methods(entry)
        if entry[k].get("time_to_target_s") is not None
    ]
    return min(timed)[1] if timed else None


def accuracy_table(acc: Mapping[str, Any], target: float) -> list[str]:
    """Table 3's lines (Markdown)."""

    def secs(v: float | None) -> str:
        return tables.num(v, ".1f", " s", missing="not reached")

    head = ["fleet", "method", "plan (round 1)", "data used", f"rounds to {target:g}"]
    head += [f"time to {target:g} from launch", "round 1 starts"]
    head += [f"sum of rounds to {target:g}", "test accuracy per round", "round times", "run"]
    rows = []
    for fleet, e in acc.items():
        if not isinstance(e, dict):
            continue
        s, best = e.get("sky", {}), best_fedavg(e)
        total = s.get("owner_samples")
        methods = [(k, f"FedAvg, {k.removeprefix('fedavg_e')} epoch(s)") for k in fedavg_methods(e)]
        for key, method in [*methods, ("sky", "Sky (stream, sessions)")]:
            if key not in e:
                continue
            row = e[key]
            if row.get("error") and "accuracies" not in row:
                rows.append([fleet, method, f"failed: {row['error']}", *[""] * 9])
                continue
            used = row.get("samples_trained")
            share = f"{used}/{total} ({used / total:.0%})" if used is not None and total else "-"
            ratio = ""
            if key == "sky" and s.get("time_to_target_s"):
                st, parts = s["time_to_target_s"], []
                for k in dict.fromkeys(x for x in ("fedavg_e1", best) if x in e):
                    ft = e[k].get("time_to_target_s")
                    label = k.removeprefix("fedavg_e") + " ep"
                    label += ", best" if k == best else ""
                    parts.append(f"{ft / st:.2f}x ({label})" if ft else f"- ({label})")
                ratio = "; ".join(parts)
            load = row.get("load_avg")
            rows.append(
                [
                    fleet,
                    method + (" (best FedAvg)" if key == best else ""),
                    row.get("plan") or "alone: " + ", ".join(e["fedavg_owners"]),
                    share,
                    row["rounds_to_target"] or "-",
                    secs(row.get("time_to_target_s"))
                    + (f" (error: {row['error']})" if row.get("error") else ""),
                    tables.num(row.get("round1_start_s"), ".0f", " s"),
                    secs(row.get("rounds_sum_to_target_s")),
                    " ".join(tables.num(a) for a in row["accuracies"]),
                    " ".join(f"{t:.1f}" for t in row["round_times_s"] if t is not None) + " s",
                    tables.num(row.get("run_wall_s"), ".0f", " s")
                    + (f" (load {load[0]:.1f} to {load[1]:.1f})" if load else ""),
                    ratio,
                ]
            )
    return tables.markdown([*head, "FedAvg/Sky"], rows).splitlines()


# --- table 4: stage sessions round by round -----------------------------------------------
ROUND_FLEETS = ("edge3", "straggler_owners4")
ROUND_STEPS = 7  # one epoch of edge3's data owner in the sky-app (479 samples, batch 64)
ROUND_LABELS = {
    "sessions": "deployed, sessions",
    "no_sessions": "deployed, set-up per round",
    "simulation": "simulation engine (Hydra job), sessions",
    # the same app under flwr run's simulation runtime: its SuperNodes carry only
    # partition-id / num-partitions, so every one owns data (sky_flower.app.owns_data):
    # another plan, kept as an extra
    "flwr_simulation": "flwr run simulation runtime, sessions (another plan)",
}
ROUND_VARIANTS = ("sessions", "no_sessions", "simulation")


def hydra_overrides(fleet: str, rounds: int, steps: int, sessions: bool) -> list[str]:
    """The Hydra job's overrides for the sky-app's table-4 run config: its model (the
    digits MLP, 3 hidden blocks of 256), batch, schedule, optimizer, lr, benchmark and
    polling, ``allocation=even``, ``steps`` steps a round."""
    return [
        f"fleet={fleet}",
        "allocation=even",
        "transport=stream",
        "schedule.kind=gpipe",
        "schedule.microbatches=4",
        "schedule.batch_size=64",
        f"stream.sessions={str(sessions).lower()}",
        f"num_rounds={rounds}",
        f"train.steps_per_round={steps}",
        "train.lr=0.001",
        "train.optimizer=adam",
        "model.hidden_width=256",
        "model.hidden_layers=3",
        "benchmark.warmup=2",
        "benchmark.repeats=2",
        "benchmark.echo_repeats=1",
        "benchmark.state_probe_mb=0",
        "failure.message_timeout_s=120",
        "messaging.poll_interval_s=0.05",
    ]


def hydra_job(
    overrides: Sequence[str], workdir: Path, timeout_s: float
) -> tuple[dict[str, Any] | None, dict[str, Any], str | None]:
    """``python -m sky_flower.run <overrides>`` (Flower's simulation engine) with its
    output in ``workdir``, every line stamped from the launch as :func:`timed_run`
    does: its ``results.json``, :func:`log_marks` (with ``run_wall_s``, ``load_avg``)
    and the error that ended it. Past ``timeout_s`` the job and its children are
    stopped by PID."""
    import psutil

    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "sky_flower.run", *overrides, f"hydra.run.dir={workdir}"]
    (workdir / "job.cmd").write_text(" ".join(cmd) + "\n")
    err = None
    with stamped(workdir) as (sink, marks):
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout_s)
            if code != 0:
                err = f"python -m sky_flower.run exited with code {code} (see run.timed.log)"
        except subprocess.TimeoutExpired:
            err = f"the Hydra job did not finish within {timeout_s:g} s"
            with contextlib.suppress(psutil.NoSuchProcess):
                procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
                for q in procs:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        q.kill()
            proc.wait(timeout=30)
        reader.join(timeout=30)
    return read_results(workdir / "results.json"), marks, err


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` (None when either is missing or ``b`` is 0)."""
    return None if a is None or not b else a / b


def session_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Table 4's figures of one run from its ``results.json`` rounds: round 1 (its time,
    set-up, Flower messages), the steady state (rounds 2 on that trained: median round
    time, Flower messages per round, median measured / predicted of the round time
    and of the step, and how many rounds lie within 25 % of their prediction) and the
    per-round lists."""
    rows = sorted(rows, key=lambda r: r["round"])
    good = [r for r in rows if not r.get("error") and r.get("round_time_s") is not None]
    per_round = [ratio(r.get("round_time_s"), r.get("predicted_round_time_s")) for r in good]
    per_step = [ratio(r.get("measured_step_time_s"), r.get("predicted_step_time_s")) for r in good]
    out: dict[str, Any] = {
        "rounds": [r["round"] for r in good],
        "failed_rounds": [r["round"] for r in rows if r.get("error")],
        "round_time_s": [r["round_time_s"] for r in good],
        "predicted_round_time_s": [r.get("predicted_round_time_s") for r in good],
        "measured_step_time_s": [r.get("measured_step_time_s") for r in good],
        "predicted_step_time_s": [r.get("predicted_step_time_s") for r in good],
        "setup_s": [r.get("setup_s") for r in good],
        "flower_messages": [r.get("flower_messages") for r in good],
        "session_round": [r.get("session_round") for r in good],
        "steps": [r.get("steps") for r in good],
        "round_ratio": per_round,
        "step_ratio": per_step,
    }
    first = good[0] if good and good[0]["round"] == 1 else None
    out["round1_s"] = first["round_time_s"] if first else None
    out["round1_setup_s"] = first.get("setup_s") if first else None
    out["round1_messages"] = first.get("flower_messages") if first else None
    steady = [i for i, r in enumerate(good) if r["round"] > 1]

    def median(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if vals else None

    def within(values: list[float | None]) -> int:
        return sum(1 for v in values if v is not None and abs(v - 1) <= 0.25)

    pick = lambda key: [out[key][i] for i in steady]  # noqa: E731
    out["steady_rounds"] = len(steady)
    out["steady_round_s"] = median(pick("round_time_s"))
    msgs = [m for m in pick("flower_messages") if m is not None]
    out["steady_messages"] = (min(msgs), max(msgs)) if msgs else None
    out["steady_round_ratio"] = median(pick("round_ratio"))
    out["steady_step_ratio"] = median(pick("step_ratio"))
    out["steady_round_within_25"] = within(pick("round_ratio"))
    out["steady_step_within_25"] = within(pick("step_ratio"))
    out["round_ratio_range"] = _range(pick("round_ratio"))
    out["step_ratio_range"] = _range(pick("step_ratio"))
    return out


def _range(values: list[float | None]) -> tuple[float, float] | None:
    vals = [v for v in values if v is not None]
    return (min(vals), max(vals)) if vals else None


def session_rounds(
    workdir: Path,
    fleets: Sequence[str],
    rounds: int,
    steps: int,
    variants: Sequence[str] = ROUND_VARIANTS,
    out: dict[str, Any] | None = None,
    save: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Table 4's figures: per fleet and variant (:data:`ROUND_LABELS`), the run's
    :func:`session_summary`, its plan, run wall time and load, filled into ``out`` run
    by run (``save()`` after each)."""
    base = (
        f"num-server-rounds={rounds} steps-per-round={steps} echo-repeats=1 "
        "state-probe-mb=0.0 benchmark-repeats=2 message-timeout-s=120.0 allocation='even' "
        "transport='stream' schedule-kind='gpipe' microbatches=4"
    )
    out = {} if out is None else out
    for fleet in fleets:
        entry: dict[str, Any] = out.setdefault(fleet, {})
        for variant in variants:
            where = workdir / f"rounds-{fleet}-{variant}"
            sessions = variant != "no_sessions"
            if variant == "simulation":
                overrides = hydra_overrides(fleet, rounds, steps, sessions)
                res, marks, err = hydra_job(overrides, where, 1200)
            else:
                simulation = variant == "flwr_simulation"
                res, marks, err = timed_run(
                    SKY_APP,
                    fleet,
                    where,
                    1200,
                    run_config=f"{base} stream-sessions={str(sessions).lower()}",
                    simulation=simulation,
                    tls=not simulation,
                    echo=True,
                )
            row = session_summary((res or {}).get("rounds") or [])
            row["error"] = err or (res or {}).get("error")
            if res and res.get("rounds"):
                first = min(res["rounds"], key=lambda r: r["round"])
                pipes = first.get("pipelines") or []
                row["plan"] = "; ".join("+".join(p["nodes"]) for p in pipes)
                row["test_accuracy"] = [r.get("test_accuracy") for r in res["rounds"]]
            row.update(
                run_wall_s=marks["run_wall_s"],
                load_avg=marks["load_avg"],
                round1_start_s=marks["round1_start_s"],
                stream_sessions=sessions,
            )
            entry[variant] = row
            save()
    return out


def rounds_table(res: Mapping[str, Any]) -> list[str]:
    """Table 4's lines (Markdown)."""

    f = tables.num

    def rng(r: Sequence[float] | None) -> str:
        return "" if not r else f" ({r[0]:.2f}-{r[1]:.2f})"

    head = ["fleet", "variant", "round 1 (set-up, msgs)", "steady round, median"]
    head += ["Flower msgs per steady round", "round meas/pred, median (range)"]
    head += ["step meas/pred, median (range)", "steady rounds within 25 % (round, step)"]
    rows = []
    for fleet, entry in res.items():
        sim = entry.get("simulation", {}).get("steady_round_s")
        for variant, row in entry.items():
            label = ROUND_LABELS.get(variant, variant)
            if not row.get("rounds"):
                rows.append([fleet, label, f"failed: {row.get('error')}", *[""] * 7])
                continue
            msgs = row.get("steady_messages")
            load = row.get("load_avg")
            n = row.get("steady_rounds", 0)
            rows.append(
                [
                    fleet,
                    label,
                    f"{f(row['round1_s'], '.1f', ' s')} ({f(row['round1_setup_s'], '.1f', ' s')}, "
                    f"{f(row['round1_messages'], 'd')})",
                    f(row["steady_round_s"], ".2f", " s"),
                    "-" if not msgs else msgs[0] if msgs[0] == msgs[1] else f"{msgs[0]}-{msgs[1]}",
                    f(row["steady_round_ratio"], ".2f") + rng(row.get("round_ratio_range")),
                    f(row["steady_step_ratio"], ".2f") + rng(row.get("step_ratio_range")),
                    f"{row['steady_round_within_25']}/{n}, {row['steady_step_within_25']}/{n}",
                    "-"
                    if variant == "simulation"
                    else f(ratio(row.get("steady_round_s"), sim), ".2f", "x"),
                    f"{row['run_wall_s']:.0f} s"
                    + (f" (load {load[0]:.1f} to {load[1]:.1f})" if load else "")
                    + (f" (error: {row['error']})" if row.get("error") else ""),
                ]
            )
    lines = tables.markdown([*head, "vs simulation (steady round)", "run"], rows).splitlines()
    head = ["fleet", "variant", "round", "time s", "predicted s", "meas/pred", "step s"]
    head += ["predicted step s", "meas/pred", "set-up s", "Flower msgs", "session round"]
    columns = [
        ("round_time_s", ".2f"),
        ("predicted_round_time_s", ".3f"),
        ("round_ratio", ".2f"),
        ("measured_step_time_s", ".4f"),
        ("predicted_step_time_s", ".4f"),
        ("step_ratio", ".2f"),
        ("setup_s", ".2f"),
        ("flower_messages", "d"),
        ("session_round", "d"),
    ]
    rows = [
        [fleet, ROUND_LABELS.get(variant, variant), rnd]
        + [f(row[key][i], spec) for key, spec in columns]
        for fleet, entry in res.items()
        for variant, row in entry.items()
        for i, rnd in enumerate(row.get("rounds") or [])
    ]
    return [*lines, "", *tables.markdown(head, rows).splitlines()]


def page(res: dict[str, Any]) -> str:
    """The printed tables (Markdown)."""
    parts = []
    if "hops" in res:
        h, rows = res["hops"], []
        for size in h["flower"]:
            f, s = h["flower"][size], h["stream"][size]
            label = f"{int(size) // 1024} KiB" if int(size) < 2**20 else f"{int(size) >> 20} MiB"
            rows.append(
                [
                    label,
                    f"{f['median_s']:.3f} s",
                    f"{f['p90_s']:.3f} s",
                    f"{s['median_s'] * 1e3:.1f} ms",
                    f"{s['p90_s'] * 1e3:.1f} ms",
                    f"{f['median_s'] / s['median_s']:.0f}x",
                ]
            )
        head = ["payload (each way)", "Flower message median", "p90", "stream hop median"]
        parts.append(tables.markdown([*head, "p90", "ratio"], rows))
    if "transports" in res:
        rows = []
        for t, row in res["transports"].items():
            if row.get("error") or "measured_step_time_s" not in row:
                rows.append([t, f"failed: {row.get('error')}", "", "", "", ""])
                continue
            m, p = row["measured_step_time_s"], row["predicted_step_time_s"]
            rows.append(
                [
                    t,
                    f"{m:.3f} s",
                    f"{p:.3f} s",
                    f"{m / p if p else float('nan'):.2f}",
                    f"{row['round_time_s']:.1f} s",
                    f"{row['run_wall_s']:.0f} s",
                ]
            )
        head = ["transport", "measured step", "predicted step", "meas/pred", "round time", "run"]
        parts.append(tables.markdown(head, rows))
    if "accuracy" in res:
        parts.append("\n".join(accuracy_table(res["accuracy"], res["target"])))
    if "rounds" in res:
        parts.append("\n".join(rounds_table(res["rounds"])))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleet", default="edge3", help="tables 1 and 2's fleet")
    parser.add_argument(
        "--only", choices=("hops", "transports", "accuracy", "rounds"), default=None
    )
    parser.add_argument("--repeats", type=int, default=5, help="Flower echoes per size")
    parser.add_argument("--steps", type=int, default=2, help="steps of table 2's round")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_deployment"))
    parser.add_argument("--transports", default="relay,stream,direct", help="table 2's rows")
    parser.add_argument(
        "--fleets",
        default=None,
        help=f"tables 3 and 4's fleets (default: {','.join(ACCURACY_FLEETS)} for table 3, "
        f"{','.join(ROUND_FLEETS)} for table 4)",
    )
    parser.add_argument("--rounds", type=int, default=10, help="tables 3 and 4: rounds per run")
    parser.add_argument("--lr", type=float, default=0.003, help="table 3: Adam's lr")
    parser.add_argument("--target", type=float, default=0.9, help="table 3: test accuracy")
    parser.add_argument(
        "--fedavg-epochs", default="1,2,4", help="table 3: FedAvg's local epochs, one run each"
    )
    parser.add_argument(
        "--round-steps", type=int, default=ROUND_STEPS, help="table 4: steps per round"
    )
    parser.add_argument(
        "--variants",
        default=",".join(ROUND_VARIANTS),
        help=f"table 4's runs per fleet, of {','.join(ROUND_LABELS)}",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = cli.commit()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
        "cpus": os.cpu_count(),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "fleet": args.fleet,
    }

    def save() -> str:
        text = page(res)
        (args.out / "results.json").write_text(json.dumps(res, indent=1))
        (args.out / "table.md").write_text(text + "\n")
        return text

    if args.only in (None, "hops"):
        res["hops"] = hops(args.out.resolve(), args.fleet, args.repeats)
        save()
    if args.only in (None, "transports"):
        which = tuple(args.transports.split(","))
        res["transports"] = transports(args.out.resolve(), args.fleet, args.steps, which)
        save()
    if args.only in (None, "accuracy"):
        res["target"] = args.target
        fleets = tuple(args.fleets.split(",")) if args.fleets else ACCURACY_FLEETS
        epochs = tuple(int(e) for e in args.fedavg_epochs.split(","))
        res["accuracy"] = {}
        accuracy(
            args.out.resolve(),
            fleets,
            args.rounds,
            args.lr,
            args.target,
            epochs,
            out=res["accuracy"],
            save=save,
        )
    if args.only in (None, "rounds"):
        fleets = tuple(args.fleets.split(",")) if args.fleets else ROUND_FLEETS
        variants = tuple(args.variants.split(","))
        unknown = sorted(set(variants) - set(ROUND_LABELS))
        if unknown:
            parser.error(f"--variants {unknown}: choose from {', '.join(ROUND_LABELS)}")
        res["rounds"] = {}
        session_rounds(
            args.out.resolve(),
            fleets,
            args.rounds,
            args.round_steps,
            variants,
            out=res["rounds"],
            save=save,
        )
    text = save()
    print(f"{res['date']}, commit {commit}, {res['machine']}, fleet {args.fleet}\n{text}")


if __name__ == "__main__":
    main()
