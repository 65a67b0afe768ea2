"""Bad command-line input ends in a clean error, not a traceback (and writes nothing).

Each entry point runs once as a real subprocess (``sys.executable -m ...``: exit status,
stderr, stdout of the process); its other cases call the same ``main(argv)`` in process
(a fresh interpreter imports torch again: several seconds each).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from inprocess_cli import hydra_main

from sky_flower import compare, plan_sweep
from sky_flower.bench import decentralized as bench

BENCH = "sky_flower.bench.decentralized"


def _run(module, *args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


# ------------------------------------------------------------------------------------
# python -m sky_flower.bench.decentralized

BAD_BENCH = {  # the rest of the review's cases run in process, below
    "--homogeneity 150": "--homogeneity: X must be in [0, 100]",
    "--topology ring --gaps 0.5": "use --topology complete",
    "--rounds 0": "--rounds: at least 1",
}


@pytest.mark.processes
def test_bench_bad_flags_are_usage_errors(tmp_path, capsys):
    """The first flags as ``python -m``, a real process; the others through the same
    ``main(argv)`` in process: exit status 2, the usage and the message on stderr,
    nothing on stdout, nothing written."""
    first, *others = BAD_BENCH
    proc = _run(BENCH, *first.split(), "--out", tmp_path / "out")
    ended = {first: (proc.returncode, proc.stdout, proc.stderr)}
    for flags in others:
        with pytest.raises(SystemExit) as exc:
            bench.main([*flags.split(), "--out", str(tmp_path / "out")])
        captured = capsys.readouterr()
        ended[flags] = (exc.value.code, captured.out, captured.err)
    for flags, (code, out, err) in ended.items():
        assert code == 2, (flags, err)
        assert "Traceback" not in err, (flags, err)
        assert err.startswith("usage: python -m sky_flower.bench.decentralized"), (flags, err)
        assert BAD_BENCH[flags] in err.splitlines()[-1], (flags, err)
        assert out == ""
    assert "topology=complete" not in "".join(BAD_BENCH)
    assert not (tmp_path / "out").exists()  # refused before any run


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--lrs -1", "--lrs: step sizes must be > 0"),
        ("--topology bogus", "argument --topology: invalid choice: 'bogus'"),
        ("--batch-size 0", "--batch-size: at least 1"),
        ("--nodes 1", "--nodes: at least 2"),
        ("--homogeneity -5", "--homogeneity"),
        ("--homogeneity nan", "--homogeneity"),
        ("--gaps 0", "--gaps: spectral gap must be in (0, 1]"),
        ("--gaps 1.5", "--gaps: spectral gap must be in (0, 1]"),
        ("--lrs 0", "--lrs"),
        ("--lrs inf", "--lrs"),
        ("--batch-size 1000", "--batch-size: 1000 is more than the"),
        ("--hidden-width -1", "--hidden-width"),
        ("--target-loss 0", "--target-loss"),
        ("--target-loss nan", "--target-loss"),
        ("--phase-rounds -1", "--phase-rounds"),
        ("--seed -1", "--seed"),
        ("--nodes 4000", "training examples"),
        ("--topology ring --algorithms d2", "set --gaps"),
        ("--topology ring --gaps 0.5 --quick", "--gaps 0.5 is out of reach"),
        ("--quick --rounds 0", "--rounds"),
        ("--algorithms sgd", "invalid choice"),
    ],
)
def test_bench_refusals_in_process(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(flags.split())
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:")
    assert message in err
    assert "topology=" not in err and "spectral_gap=" not in err


def test_bench_out_must_be_a_directory(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--out", str(tmp_path / "file")])
    assert "--out" in capsys.readouterr().err


def test_quick_changes_only_the_flags_not_given(tmp_path):
    out = str(tmp_path)
    quick = bench.parse_args(["--quick", "--out", out])
    assert quick.homogeneity == [0, 100] and quick.gaps == [1.0, 0.05]
    assert quick.rounds == 150 and quick.lrs == [0.4]
    mixed = bench.parse_args(
        ["--quick", "--gaps", "0.5", "--homogeneity", "30", "--lrs", "0.2", "0.3", "--out", out]
    )
    assert mixed.gaps == [0.5] and mixed.homogeneity == [30] and mixed.lrs == [0.2, 0.3]
    assert mixed.rounds == 150  # not given: the quick grid's
    full = bench.parse_args(["--rounds", "7", "--out", out])
    assert full.rounds == 7 and full.homogeneity == [0, 25, 50, 100]
    assert full.gaps == [1.0, 0.1, 0.05, 0.01] and len(full.lrs) == 5
    # a sparse topology without --gaps: its own gap (no default gap out of its reach)
    assert bench.parse_args(["--topology", "ring", "--algorithms", "dpsgd", "--out", out]).gaps == [
        None
    ]


def test_diverged_losses_in_the_table():
    row = {
        "nodes": 8,
        "homogeneity": 0.0,
        "spectral_gap": 1.0,
        "dpsgd_rounds": None,
        "dpsgd_final_loss": math.inf,
        "d2_rounds": 3,
        "d2_final_loss": 0.25,
    }
    md = bench.markdown_table([row], ["dpsgd", "d2"], 10, 0.5)
    assert "| >10 (diverged) | 3 (0.250) |" in md and "(inf)" not in md
    assert "(diverged)" in bench.format_row(row, ["dpsgd", "d2"], 10)


def test_bench_quick_run_honours_given_flags(tmp_path):
    """The bench's ``main(argv)`` in process (its command line as a process: the test
    above); ``main`` sets torch to one thread, restored after."""
    out = tmp_path / "bench"
    threads = torch.get_num_threads()
    try:
        bench.main(
            [
                *("--quick", "--rounds", "2", "--homogeneity", "50", "--gaps", "0.5"),
                *("--algorithms", "dpsgd", "--lrs", "1000", "--out", str(out)),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    args = json.loads((out / "results.json").read_text())["args"]
    assert args["homogeneity"] == [50] and args["gaps"] == [0.5] and args["rounds"] == 2
    md = (out / "table.md").read_text()
    assert "| 8 | 50 | 0.5 | >2 (diverged) |" in md  # lr 1000 blows the loss up


# ------------------------------------------------------------------------------------
# python -m sky_flower.compare / python -m sky_flower.plan_sweep


SWEEP_CLIS = {
    "sky_flower.compare": (compare, "summary.csv", "results.json"),
    "sky_flower.plan_sweep": (plan_sweep, "plan_sweep.csv", "plan_row.json"),
}


def _no_jobs(sweep_dir, expected):
    return (
        f"error: no sweep jobs found in {sweep_dir} "
        f"(expected Hydra multirun job folders with {expected})"
    )


@pytest.mark.processes
def test_sweep_summary_cli_refuses_a_missing_dir_as_a_process(tmp_path):
    """``python -m sky_flower.compare`` as a real process (no torch: about a second):
    exit status 1, the one line on stderr, nothing on stdout. Both summaries' ``main``
    in process: the test below."""
    missing = tmp_path / "no_such_dir"
    proc = _run("sky_flower.compare", missing)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == _no_jobs(missing, SWEEP_CLIS["sky_flower.compare"][2])
    assert proc.stdout == "" and not missing.exists()


@pytest.mark.parametrize("module", list(SWEEP_CLIS))
def test_sweep_summaries_refuse_a_missing_dir(tmp_path, module, capsys):
    cli, _, expected = SWEEP_CLIS[module]
    missing = tmp_path / "no_such_dir"
    assert cli.main([str(missing)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.strip() == _no_jobs(missing, expected)
    assert captured.out == "" and not missing.exists()


@pytest.mark.parametrize("module", list(SWEEP_CLIS))
def test_sweep_summaries_refuse_a_dir_without_jobs(tmp_path, module, capsys):
    cli, written, expected = SWEEP_CLIS[module]
    (tmp_path / "0").mkdir()  # a job folder without its file is no job
    (tmp_path / "notes.txt").write_text("")
    assert cli.main([str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == _no_jobs(tmp_path, expected) and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "notes.txt"]  # nothing written
    assert cli.main([str(tmp_path / "notes.txt")]) == 1  # a file is no sweep either
    assert cli.main([]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"usage: python -m {module} " + (
        "<multirun sweep directory>"
    )


def test_compare_cli_on_a_sweep(tmp_path, capsys):
    job = tmp_path / "0"
    job.mkdir()
    (job / "results.json").write_text(
        json.dumps({"allocation": "even", "fleet": "edge4", "final_test_accuracy": 0.9})
    )
    assert compare.main([str(tmp_path)]) == 0
    assert "even" in capsys.readouterr().out and (tmp_path / "summary.csv").exists()


def test_plan_sweep_cli_on_a_sweep(tmp_path, capsys):
    job = tmp_path / "0"
    job.mkdir()
    (job / "plan_row.json").write_text(
        json.dumps({"status": "refused", "error": "even: more nodes than layers", "nodes": 8})
    )
    assert plan_sweep.main([str(tmp_path)]) == 0
    assert "1 jobs (1 refused)" in capsys.readouterr().out
    assert (tmp_path / "plan_sweep.csv").exists()


def test_training_job_names_a_non_numeric_setting(tmp_path, capsys):
    """``num_rounds=abc``: the error names the key and the type, not Python's int().
    The entry point's ``main()`` in process (``python -m sky_flower.run`` as a process:
    the misspelt key's test below)."""
    from sky_flower import run

    status = hydra_main(run.main, ["num_rounds=abc", f"hydra.run.dir={tmp_path}"])
    shown = capsys.readouterr()
    assert status == 1
    assert "num_rounds='abc' must be an integer" in shown.err + shown.out, shown.err[-2000:]
    assert "invalid literal" not in shown.err + shown.out


def test_deploy_workdir_that_is_a_file_is_refused_before_anything_starts(tmp_path):
    from sky_flower.deploy import run_local

    afile = tmp_path / "afile"
    afile.write_text("")
    app = Path(__file__).resolve().parents[1] / "examples" / "sky-app"
    with pytest.raises(ValueError, match="is a file: pass a directory"):
        run_local(app, "edge3", workdir=afile, echo=False)


def test_deploy_summary_of_an_app_without_results_path_says_what_happened(
    tmp_path, monkeypatch, capsys
):
    """An app that declares no ``results-path`` (Flower's quickstart-pytorch) writes no
    results.json: the launcher printed ``{"test_accuracy": {}, "rounds": null}`` as if the
    run had trained nothing. It says the app wrote none and how to add the key, and keeps
    the exit status of a run that finished (0)."""
    from sky_flower.deploy import __main__ as launcher

    app = Path(__file__).resolve().parents[1] / "examples" / "quickstart-pytorch"
    calls = []

    def finished(*args, **kwargs):  # flwr run finished; the app wrote no results.json
        calls.append(args)
        return "flwr run's log", [11, 12, 13], None

    monkeypatch.setattr(launcher, "run_local", finished)
    assert launcher.main([str(app), "--simulation"]) == 0
    assert calls, "run_local not called"
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "test_accuracy" not in summary and summary["results"] is None, summary
    assert summary["processes_started_and_stopped"] == 3
    assert "wrote no results.json" in summary["note"], summary
    assert "results-path" in summary["note"] and "pyproject.toml" in summary["note"], summary


# ------------------------------------------------------------------------------------
# python -m sky_flower.run with a misspelt key added by "+"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+trian.lr=0.1", "top-level key 'trian', which nothing reads: did you mean train?"),
        (
            "++schedule.microbatchs=2",
            "schedule.microbatchs, which is not a setting: did you mean schedule.microbatches?",
        ),
    ],
)
def test_a_misspelt_key_added_with_plus_is_refused(override, message):
    from sky_flower.jobs.added_keys import check_added_keys
    from sky_flower.jobs.common import conf_dir

    with pytest.raises(ValueError, match=message.replace("?", r"\?")):
        check_added_keys(["fleet=edge3", override], conf_dir())


def test_keys_the_user_owns_may_be_added():
    from sky_flower.jobs.added_keys import check_added_keys
    from sky_flower.jobs.common import conf_dir

    fine = [
        "+model._target_=a.b",
        "+model.width=8",
        "+train.lr=0.1",
        "+strategy.x=1",
        "+objective.loss=m:f",
        "seed=3",
    ]
    check_added_keys(fine, conf_dir())  # nothing raised


# python -m sky_flower.run with a misspelt key set without "+": one answer, before Hydra
# (Hydra alone would say "use +key", and the "+" key would then be refused in the job)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["trian.lr=0.1"], "'trian.lr=0.1' sets the top-level key 'trian', which nothing "),
        (["fleet=edge3", "alocation=even"], "did you mean allocation?"),
        (["train.lrr=0.1"], "train.lrr, which is not a setting: did you mean train.lr?"),
        (["-m", "benchmark.repeat=1,2"], "did you mean benchmark.repeats?"),
        (["schedule.microbatchs=4"], "did you mean schedule.microbatches?"),
        # a node count on a fleet that lists its nodes: other nodes under its name
        (["fleet.nodes=3"], "on fleet edge4, which lists its 4 nodes"),
        (["-m", "fleet=skycomputing,edge3", "fleet.nodes=3,4"], "fleet edge3, which lists"),
        # a Hydra path renamed in issue 43: its new name
        (["schedule.stream_timeout_s=5"], "which was renamed to stream.timeout_s"),
        (["message_timeout_s=5"], "which was renamed to failure.message_timeout_s"),
    ],
)
def test_a_misspelt_key_on_the_command_line_is_refused_naming_the_close_key(argv, message, capsys):
    from sky_flower.jobs.added_keys import exit_on_unknown_keys
    from sky_flower.jobs.common import conf_dir

    with pytest.raises(SystemExit) as exc:
        exit_on_unknown_keys(conf_dir(), argv)
    assert exc.value.code == 1  # as Hydra's own config errors and every other refusal
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_the_keys_of_the_documented_commands_pass_the_command_line_check():
    """Every key a documented command sets (groups and their own keys, sections from
    a transport option, sweeps, ``hydra.*``, ``+``/``~`` overrides, a config of one's
    own) passes."""
    from sky_flower.jobs.added_keys import check_overridden_keys
    from sky_flower.jobs.common import conf_dir

    for argv in (
        ["allocation=optimal", "fleet=edge3", "num_rounds=5", "seed=1"],
        ["-m", "schedule.kind=sequential,gpipe", "schedule.microbatches=1,4,8"],
        ["transport=direct", "direct.timeout_s=10", "schedule.chunks=2"],
        ["strategy=ssp", "strategy.staleness=1", "fleet.nodes=16"],
        ["-m", "fleet=skycomputing", "fleet.nodes=4,8"],
        ["fleet=uniform3", "fleet.nodes=[{name: owner, holds_data: true}]"],
        ["task=regression", "dataset.float_labels=true", "model.num_classes=1"],
        ["objective.loss=mypkg.losses:sum_ce", "replan.mode=on", "train.lr=0.003"],
        ["benchmark.repeats=7", "benchmark.state_probe_mb=64", "hydra.run.dir=/tmp/x"],
        ["~model", "+model._target_=a.b", "+trian.x=1"],  # "+": check_added_keys's
        ["--config-dir", "my_conf", "anything=1"],  # its own config: Hydra checks
        ["hydra/launcher=basic", "--cfg", "job"],
    ):
        check_overridden_keys(argv, conf_dir())  # nothing raised


@pytest.mark.processes
def test_the_run_entry_point_refuses_a_misspelt_plus_key_before_flower_starts(tmp_path):
    proc = _run("sky_flower.run", "+trian.lr=0.1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1
    assert "did you mean train?" in proc.stderr + proc.stdout
    assert "did you mean train?" in (tmp_path / "results.json").read_text()


# ------------------------------------------------------------------------------------
# each run's own output folder


@pytest.mark.parametrize("primary", ["config", "plan"])
def test_runs_started_in_the_same_second_get_their_own_folders(primary, monkeypatch):
    """Two jobs started in the same second (``make run ... & make run ... &``) wrote into
    one ``outputs/<date>/<time>`` folder and clobbered each other's files: each
    primary config's run and sweep folders must tell them apart."""
    import datetime as dt

    import hydra.core.utils
    from hydra import compose, initialize_config_dir

    from sky_flower.jobs.common import conf_dir

    starts = iter([dt.datetime(2026, 12, 6, 22, 35, 30, us) for us in (1000, 2000)])
    clock = type("Clock", (), {"now": staticmethod(lambda: started)})
    monkeypatch.setattr(hydra.core.utils, "datetime", clock)  # Hydra's ${now:...}

    def dirs() -> tuple[str, str]:
        nonlocal started
        started = next(starts)  # one run's start: Hydra resolves ${now:...} once per run
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            cfg = compose(primary, return_hydra_config=True)
        return str(cfg.hydra.run.dir), str(cfg.hydra.sweep.dir)

    started = None
    first, second = dirs(), dirs()
    assert first[0] != second[0], f"one run folder for both runs: {first[0]}"
    assert first[1] != second[1], f"one sweep folder for both sweeps: {first[1]}"
    assert first[0].startswith("outputs/2026-12-06/22-35-30"), first
