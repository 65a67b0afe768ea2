"""The documentation stays true to the code (fast, no engine, no subprocess):
docs/configuration.md is what ``python -m sky_flower.docs_config`` prints now, every
setting appears in it, the README stays short, and every relative link in README.md,
CHANGELOG.md and docs/ points at a file that exists."""

import json
import re
from pathlib import Path

import pytest

from sky_flower.docs_config import render, setting_docs
from sky_flower.plan_picture import picture
from sky_flower.sky.settings import run_config_keys, settings_fields

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_configuration_page_is_generated_from_the_settings():
    """A setting added, renamed or given another default without ``make docs`` fails here."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render(), "docs/configuration.md is stale: run `make docs` and commit it"


def test_every_setting_is_on_the_configuration_page():
    """Every run-config key and Hydra path is named on the committed page."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    for key in run_config_keys():
        assert f"`{key}`" in page, key
    for s in settings_fields():
        if s.hydra:
            assert f"`{s.path}`" in page, s.path


def test_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into docs/"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page (lower case, punctuation dropped,
    spaces as hyphens), headings inside code fences skipped."""
    out, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"^#{1,6} ", line):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_relative_links_resolve():
    """Every ``[text](path#anchor)`` that is not a URL names an existing file and, on a
    Markdown page, an existing heading."""
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            name, _, anchor = target.partition("#")
            path = (page.parent / name).resolve() if name else page
            if not path.exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                missing.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
    assert not missing, missing


def test_plan_picture_draws_each_pipeline_to_scale():
    """Each stage is as wide as its layers (6 characters a layer, one a separator)."""
    plan = {
        "pipelines": [
            {"owner": "a", "stages": [["a", 0, 0], ["b", 1, 2]], "predicted_step_time_s": 1.5},
            {"owner": "c", "stages": [["c", 0, 2]]},
        ],
        "idle_nodes": ["d"],
    }
    lines = picture(plan).splitlines()
    assert lines[1].endswith("|a 0--|b 1-2------|  step 1.500 s")
    assert lines[2].endswith("|c 0-2------------|")
    assert lines[3] == "idle: d"


def test_plan_picture_takes_a_run_directory(tmp_path, capsys):
    """``python -m sky_flower.plan_picture outputs/<run>``: the directory's plan.json;
    a directory without one is named with the file it looked for."""
    from sky_flower.plan_picture import main

    plan = {"stages": [{"node": "a", "first_layer": 0, "last_layer": 1}], "idle_nodes": []}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert main([str(tmp_path)]) == 0
    assert "|a 0-1" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 1
    assert f"{empty / 'plan.json'}: no such file" in capsys.readouterr().err


def test_every_setting_has_its_description():
    """A setting's one description is its entry in its class's ``Attributes``, which the
    page shows (``conf/config.yaml`` no longer carries them, issue 43): one entry for
    every setting, none for a setting that is gone."""
    docs, paths = setting_docs(), {s.path for s in settings_fields()}
    assert set(docs) == paths, set(docs) ^ paths
    for path, text in docs.items():
        assert text.strip(), f"{path} has no description"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # typer, importing Flower's CLI
def test_the_docs_say_how_to_stop_a_flwr_run():
    """Ctrl-C on ``flwr run --stream`` stops only Flower's log stream; the run goes on.
    docs/failures.md and flower-app.md name the command that stops it, one the installed
    Flower CLI has (``flwr stop RUN_ID``, ``flwr ls`` for the ids)."""
    import inspect

    from flwr.cli.app import app

    commands = {c.name or c.callback.__name__: c.callback for c in app.registered_commands}
    assert "stop" in commands and "ls" in commands, sorted(commands)
    assert "run_id" in inspect.signature(commands["stop"]).parameters
    for page in ("failures.md", "flower-app.md"):
        text = (ROOT / "docs" / page).read_text()
        assert "`flwr stop <run-id>`" in text and "`flwr ls`" in text, page
        assert "Ctrl-C" in text and "log stream" in text, page
