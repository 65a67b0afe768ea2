"""Bad input refused up front (issue 30), before Flower or Ray starts, naming what is
wrong: labels beyond the model's output over the whole training set, non-finite
features, an invalid fleet file (one line: file, line, column); and ``completed`` is
false in ``results.json`` when no round trained. Every check runs in process, except one
command line (the one-line refusal is what the user sees)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf, open_dict
from simhelpers import make_cfg

from sky_flower.emulation.devices import compose_fleet
from sky_flower.jobs.common import SkyRecorder, conf_dir
from sky_flower.jobs.config_files import ConfigFileError, check_command_line, selected_files
from sky_flower.pipeline.data import Split, load_digits
from sky_flower.pipeline.inputs import label_range, probe_rows
from sky_flower.sky.rounds.hooks import RunEnd, RunRecords, RunStart
from sky_flower.sky.rounds.records import RoundRecord
from sky_flower.sky.settings import SkySettings

BAD_FLEET = "name: bad\nnodes:\n  - {name: node0, holds_data: true\n  - {name: node1}\n"


def _checked(overrides: list[str], dataset: dict | None = None) -> dict:
    from sky_flower.jobs.sky import _checked_inputs

    cfg = make_cfg(["fleet=uniform3", *overrides])
    if dataset is not None:
        with open_dict(cfg):
            cfg.dataset = OmegaConf.create(dataset)
    return _checked_inputs(cfg, SkySettings.from_hydra(cfg))


def digits_with_nan(test_fraction: float = 0.2, seed: int = 0, row: int = 100) -> tuple:
    """digits with one NaN feature in training sample ``row`` (not among the first two,
    which the objective probe always tries)."""
    train, test = load_digits(test_fraction, seed)
    x = train.x.copy()
    x[row, 7] = np.nan
    return Split(x, train.y), test


def test_labels_beyond_the_head_are_refused_over_the_whole_training_set():
    """A 6-class head on digits (labels 0-9) with seed 1, whose first two training
    labels (3 and 1) are in range: the two-sample probe passed and the run failed after
    Ray and planning with ``Target 6 is out of bounds``. Now refused before Flower,
    naming the data set, the label range, the model's width and the key to change."""
    train, _ = load_digits(0.2, 1)
    assert train.y[:2].tolist() == [3, 1] and label_range(train.y) == (0, 9)
    rows = probe_rows(train)
    assert train.y[rows].max() == 9 and train.y[rows].min() == 0
    with pytest.raises(ValueError) as err:
        _checked(["seed=1", "model.num_classes=6"])
    text = str(err.value)
    assert "dataset 'digits' has labels in [0, 9]" in text
    assert "model 'mlp' outputs 6 values" in text and "model.num_classes=10" in text
    _checked(["seed=1", "model.num_classes=10", "model.hidden_width=32"])  # in range: runs


def test_nonfinite_features_are_refused_naming_the_data_set():
    """One NaN feature in sample 100 of the training split: refused before Flower (it
    used to pass the two-sample probe, then blame "stage 0 on <node>" mid-run)."""
    loader = {"_target_": "test_bad_input.digits_with_nan", "name": "nandigits", "row": 100}
    with pytest.raises(ValueError) as err:
        _checked(["model.hidden_width=32"], loader)
    text = str(err.value)
    assert "dataset 'nandigits' has non-finite features (NaN or inf)" in text
    assert "in 1 of 1437 training samples (the first: sample 100)" in text


def test_invalid_fleet_file_is_one_line_naming_file_line_and_column(tmp_path):
    """In process: the file a ``fleet=`` override selects from a ``--config-dir``, and
    the packaged-fleet path (``compose_fleet``, what ``flwr run`` uses)."""
    (tmp_path / "fleet").mkdir()
    bad = tmp_path / "fleet" / "bad.yaml"
    bad.write_text(BAD_FLEET)
    argv = ["--config-dir", str(tmp_path), "fleet=bad", "train.lr=0.1"]
    assert selected_files(argv, conf_dir()) == [bad]
    with pytest.raises(ConfigFileError) as err:
        check_command_line(argv, conf_dir())
    text = str(err.value)
    assert text == (
        f"config file {bad}, line 4, column 5: invalid YAML: while parsing a flow mapping "
        "expected ',' or '}', but got '{'"
    )
    check_command_line(["fleet=edge3", "allocation=even"], conf_dir())  # packaged: fine
    with pytest.raises(ValueError, match=r"^fleet 'bad' \(fleet/bad\.yaml\), line 4, column 5"):
        compose_fleet("bad", lambda n: BAD_FLEET)


@pytest.mark.processes
def test_invalid_fleet_file_on_the_command_line_prints_one_line(tmp_path):
    """``python -m sky_flower.run --config-dir D fleet=bad``: exit status 1, one line on
    stderr, no traceback (it was a 95-line Hydra traceback), no output directory."""
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "bad.yaml").write_text(BAD_FLEET)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sky_flower.run",
            "--config-dir",
            str(tmp_path),
            "fleet=bad",
            f"hydra.run.dir={out}",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "bad.yaml, line 4, column 5: invalid YAML" in lines[0]
    assert not out.exists()


def test_completed_is_false_when_no_round_trained(tmp_path):
    """A run that went through all its rounds, every one failed (``max_failed_rounds``
    above the rounds): ``start`` returned, but nothing trained, so ``results.json`` says
    ``completed: false`` beside the error (it said ``true``)."""
    rounds = [RoundRecord(r, 0.1, error=f"round {r} failed: boom") for r in (1, 2)]
    recorder = SkyRecorder(tmp_path / "results.json", "even", "uniform3")
    recorder.on_start(RunStart(2, "even", "relay"))  # the hooks a run calls: started, ended
    recorder.on_end(RunEnd(RunRecords(tuple(rounds)), None))  # without an error
    saved = json.loads(Path(tmp_path / "results.json").read_text())
    assert saved["completed"] is False
    assert saved["error"].startswith("no round trained (2 failed)")
    rounds[1] = RoundRecord(2, 0.1, train_loss=1.0)  # one round trained: completed
    recorder.records = RunRecords(tuple(rounds))
    recorder.write()
    saved = json.loads(Path(tmp_path / "results.json").read_text())
    assert saved["completed"] is True and saved["error"] is None
