"""Ctrl-C and SIGTERM stop a run cleanly: the strategy is told first and blames no
node for the messages the shutdown breaks, the job writes ``results.json`` saying it
was interrupted, and exits 130 with one line."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
from reference import ProcessPerMessageGrid, sky_app_on_grid
from sky_flower.strategies.sky import SkyNodeError

from sky_flower.flower.shutdown import signals_interrupt
from sky_flower.jobs.common import INTERRUPTED, describe_error, main_job
from sky_flower.sky import protocol as P

QUICK = {"benchmark-repeats": 1, "echo-repeats": 1, "state-probe-mb": 0.0, "allocation": "even"}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_tells_the_run_first_then_interrupts_and_the_handlers_come_back(sig):
    told = []
    before = signal.getsignal(sig)
    with pytest.raises(KeyboardInterrupt), signals_interrupt(lambda: told.append(sig)):
        os.kill(os.getpid(), sig)
        threading.Event().wait(5.0)  # the handler runs here, in the main thread
    assert told == [sig]
    assert signal.getsignal(sig) is before


def test_an_interrupted_job_says_so_in_one_line_and_exits_130(tmp_path, caplog):
    def run(cfg, out_dir):  # noqa: ANN001, ANN202 - the job, interrupted
        raise KeyboardInterrupt

    refused = []
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exc:
        main_job(run, refused.append, str, None, tmp_path, multirun=True)
    assert exc.value.code == 130  # a sweep stops too
    assert refused == []  # not a refused setting
    assert [r.getMessage() for r in caplog.records] == [
        f"{INTERRUPTED}: the rounds so far are in {tmp_path}"
    ]
    assert describe_error(KeyboardInterrupt()) == f"KeyboardInterrupt: {INTERRUPTED}"
    # Flower's simulation runtime turns SIGTERM into SystemExit(15)
    assert describe_error(SystemExit(15)) == f"SystemExit: {INTERRUPTED}"


class StoppedMidRound(ProcessPerMessageGrid):
    """Stops the run (as the signal handler does) while round 1's first stage message
    is delivered: the round breaks the way a shutdown breaks it."""

    stop = None

    def deliver(self, node_id, message):  # noqa: ANN001, ANN201
        if message.metadata.message_type == P.SETUP and self.stop is not None:
            self.stop()
        return super().deliver(node_id, message)


def test_a_round_broken_by_a_stop_blames_no_node_and_ends_the_run(server_identity):
    """The round the stop broke is neither recorded as a failed round nor judged: no
    node is dropped, no re-plan, the run ends at once naming the round."""
    run = {**QUICK, "fleet": "uniform3", "steps-per-round": 2, "num-server-rounds": 3}
    strategy, grid, start = sky_app_on_grid(StoppedMidRound, run)
    grid.stop = strategy.request_stop
    with pytest.raises(SkyNodeError, match=r"stopped by the caller in round 1"):
        strategy.start(**start)
    assert strategy.failed_rounds == [] and strategy.rounds == []
    assert strategy.dropped == {}
    assert sorted(n.name for n in strategy.node_profiles) == ["node0", "node1", "node2"]


def test_the_jobs_last_word_is_not_overwritten_by_a_strategy_that_ends_after_it(tmp_path):
    """The simulation engine crashed (e.g. Ray did not start): the job writes that
    error; the strategy thread, stopped by it, ends later with "run stopped by the
    caller" and must not replace the real cause in ``results.json``."""
    import json

    from sky_flower.jobs.common import SkyRecorder
    from sky_flower.sky.rounds.hooks import RunEnd, RunRecords

    path = tmp_path / "results.json"
    recorder = SkyRecorder(path, "heuristic", "edge4")
    recorder.write("RuntimeError: Simulation Runtime crashed.", final=True)
    recorder.on_end(RunEnd(RunRecords(), SkyNodeError("run stopped by the caller")))
    assert json.loads(path.read_text())["error"] == "RuntimeError: Simulation Runtime crashed."
