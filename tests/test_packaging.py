"""`pip install .` ships both packages and every Hydra config the entry point needs."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # pip builds the wheel in a subprocess

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_packages_and_configs(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("sky_flower-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "sky_flower/run.py",
        "sky_flower/strategies/sky.py",
        "sky_flower/conf/config.yaml",
    } <= names
    # every sub-package of the source tree ships, and nothing lands at the top level of a
    # user's environment but sky_flower itself
    for init in (ROOT / "sky_flower").rglob("__init__.py"):
        assert f"{init.relative_to(ROOT).as_posix()}" in names, init
    assert {n.split("/")[0] for n in names if not n.startswith("sky_flower-")} == {"sky_flower"}
    for conf in (ROOT / "conf").rglob("*.yaml"):
        assert f"sky_flower/conf/{conf.relative_to(ROOT / 'conf').as_posix()}" in names
