"""Unreadable config files refused in one line, before Hydra composes them.

Hydra parses a group file (``conf/fleet/<name>.yaml``) only while composing the config,
and an invalid one ends the command with a traceback of about a hundred lines whose
useful part is the last four. :func:`check_command_line` reads every YAML file a
``python -m sky_flower.run`` / ``sky_flower.plan`` command line selects (its
``group=name`` overrides, in the packaged config directory and any ``--config-dir`` /
``-cd``, plus a ``--config-dir``'s primary config) and refuses the first that is not
valid YAML with one line naming the file, the line and the column.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import yaml


class ConfigFileError(ValueError):
    """A config file that cannot be read or is not valid YAML (the message is one line:
    file, line, column, what the parser expected)."""


def yaml_error(path: Path) -> str:
    """``""`` if ``path`` reads as YAML, else one line naming the file, line and column
    (1-based, as editors count) and the parser's complaint."""
    try:
        yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        return f"config file {path} cannot be read: {err.strerror or err}"
    except UnicodeDecodeError as err:
        return f"config file {path} is not UTF-8 text (byte {err.start})"
    except yaml.YAMLError as err:
        return describe_yaml_error(err, f"config file {path}")
    return ""


def describe_yaml_error(err: yaml.YAMLError, label: str) -> str:
    """One line for a YAML parse error of ``label`` (``"config file conf/fleet/x.yaml"``):
    ``"<label>, line L, column C: invalid YAML: <what the parser expected>"`` (1-based,
    as editors count)."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = " ".join(str(x) for x in (err.context, err.problem) if x)
        return f"{label}{where}: invalid YAML: {what or 'cannot be parsed'}"
    return f"{label}: invalid YAML: {' '.join(str(err).split())}"


def selected_files(argv: Sequence[str], conf_dir: str) -> list[Path]:
    """The YAML files ``argv`` (a Hydra command line, without the program) selects:
    ``<dir>/<group>/<name>.yaml`` for every ``group=name`` override (``+``/``++``
    prefixes allowed) that exists in ``conf_dir`` or a ``--config-dir`` / ``-cd``
    directory, and a ``--config-dir``'s ``config.yaml`` / ``plan.yaml``."""
    dirs, user = [Path(conf_dir)], []
    args = list(argv)
    for i, arg in enumerate(args):
        value = None
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--config-dir="):
            value = arg.split("=", 1)[1]
        if value:
            user.append(Path(value))
    dirs += user
    found: list[Path] = []
    for d in user:
        found += [d / f for f in ("config.yaml", "plan.yaml") if (d / f).is_file()]
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.lstrip("+~").split("=", 1)
        if not key or "." in key or not value or any(c in value for c in ",()[]{}*"):
            continue  # a value override (train.lr=...), a sweep: not a group file
        for d in dirs:
            path = d / key / f"{value}.yaml"
            if path.is_file():
                found.append(path)
    return list(dict.fromkeys(found))


def check_command_line(argv: Sequence[str], conf_dir: str) -> None:
    """Refuse the first unreadable file :func:`selected_files` finds.

    Raises
    ------
    ConfigFileError
        One line: the file, line and column, and what is wrong.
    """
    for path in selected_files(argv, conf_dir):
        text = yaml_error(path)
        if text:
            raise ConfigFileError(text)


def exit_on_bad_files(conf_dir: str, argv: Sequence[str] | None = None) -> None:
    """:func:`check_command_line` for this process's command line; on an error print it
    as one line on stderr and exit with status 1 before Hydra starts (as Hydra itself
    exits on a config error, and as every other refusal of bad input does)."""
    try:
        check_command_line(sys.argv[1:] if argv is None else argv, conf_dir)
    except ConfigFileError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
