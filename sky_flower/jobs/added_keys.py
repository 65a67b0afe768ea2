"""Refuse a misspelt setting on the command line, naming the close key.

Hydra refuses ``trian.lr=0.1`` (the key is not in the config) and tells the user to
append it with ``+``; a ``+`` key is then taken silently and nothing reads it. Here a key
is refused when it is a new top-level key, or a new key inside one of the primary
config's own sections (``train``, ``schedule``, ``benchmark``, ...): those hold only the
settings ``conf/config.yaml`` composes (``SkySettings``' through ``sky_base``, and its
own). Keys under the groups that take arbitrary arguments (``model``, ``dataset``,
``fleet``, ``strategy``, ...) are the user's own and pass.

- :func:`check_overridden_keys`: each plain ``key=value`` of the command line, before
  Hydra starts, so a misspelling gets one answer with the close key instead of Hydra's
  advice to add it with ``+``.
  It also refuses a node count (``fleet.nodes=3``) on a fleet that lists its nodes.
- :func:`check_added_keys`: each ``+key=value`` / ``++key=value``, in the job (from
  Hydra's parsed overrides).
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from sky_flower.sky.settings import RENAMED_PATHS, hydra_defaults


def known_keys(conf_dir: str | Path) -> tuple[set[str], dict[str, set[str]]]:
    """The top-level keys of the primary config, the settings' defaults it composes
    (``sky_base``: :func:`sky_flower.sky.settings.hydra_defaults`), its groups and the
    group options in the global package (``transport`` sets ``schedule.*``), and, per
    own section (not a group), every key they list."""
    primary = OmegaConf.load(Path(conf_dir) / "config.yaml")
    assert isinstance(primary, DictConfig)
    groups: set[str] = set()
    for entry in primary.get("defaults", []):  # group: option (a plain name is a config)
        if isinstance(entry, DictConfig | dict):
            groups.update(str(k).split("/")[0].split("@")[0] for k in entry)
    # and the group options that write into the global package
    files = [primary, OmegaConf.create(hydra_defaults())]
    for path in sorted(Path(conf_dir).glob("*/*.yaml")):
        package = re.search(r"@package\s+(\S+)", path.read_text())
        if package and package.group(1) != "_global_":  # e.g. task -> objective
            groups.add(package.group(1).split(".")[0])
        elif package:
            loaded = OmegaConf.load(path)
            if isinstance(loaded, DictConfig):
                files.append(loaded)
    sections: dict[str, set[str]] = {}
    top = groups | {"hydra"}
    for conf in files:
        for k, v in conf.items():
            if k == "defaults":
                continue
            top.add(str(k))
            if isinstance(v, DictConfig) and k != "hydra" and str(k) not in groups:
                sections.setdefault(str(k), set()).update(str(x) for x in v)
    return top, sections


def unknown_key(key: str, top: set[str], sections: dict[str, set[str]]) -> str:
    """``""`` if the dotted ``key`` may be set, else what is wrong with it, with the close
    known key if there is one (``top``, ``sections``: :func:`known_keys`)."""
    head, _, rest = key.partition(".")
    if key in RENAMED_PATHS:
        return f"{key}, which was renamed to {RENAMED_PATHS[key]}: set that instead"
    if head not in top:
        close = difflib.get_close_matches(head, sorted(top), n=1)
        hint = f": did you mean {close[0]}?" if close else ""
        return (
            f"the top-level key {head!r}, which nothing reads{hint} "
            f"(known: {', '.join(sorted(top))})"
        )
    if head in sections and rest:
        sub = rest.split(".")[0]
        if sub not in sections[head]:
            close = difflib.get_close_matches(sub, sorted(sections[head]), n=1)
            hint = f": did you mean {head}.{close[0]}?" if close else ""
            return (
                f"{head}.{sub}, which is not a setting{hint} "
                f"({head} has: {', '.join(sorted(sections[head]))})"
            )
    return ""


def check_overridden_keys(argv: Sequence[str], conf_dir: str | Path) -> None:
    """Refuse the first plain ``key=value`` of a ``python -m sky_flower.run`` command line
    ``argv`` (without the program) that sets a key no part of the program reads (see the
    module docstring). Left to Hydra: flags (``-m``, ``--cfg job``), ``+`` / ``++`` / ``~``
    overrides (:func:`check_added_keys` checks the added ones in the job), ``hydra.*``
    keys, group paths (``hydra/launcher=...``, ``model@x=...``), and the whole command line
    when it names a config of its own (``--config-dir``, ``--config-name``,
    ``--config-path`` and their short forms), whose keys these are not.

    Raises
    ------
    ValueError
        Naming the override, the close known key if there is one, and the keys of its
        section.
    """
    own_config = ("--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp")
    if any(a.split("=", 1)[0] in own_config for a in argv):
        return
    top, sections = known_keys(conf_dir)
    for raw in argv:
        if raw.startswith(("-", "+", "~")) or "=" not in raw:
            continue
        key = raw.split("=", 1)[0].strip()
        if not key or "/" in key or "@" in key or key.split(".")[0] == "hydra":
            continue
        wrong = unknown_key(key, top, sections)
        if wrong:
            raise ValueError(f"{raw!r} sets {wrong}")
    _check_node_count(argv, conf_dir)


def _check_node_count(argv: Sequence[str], conf_dir: str | Path) -> None:
    """Refuse ``fleet.nodes=N`` (a count, or a sweep of counts) on a fleet whose file
    lists its nodes (edge4, federated6, ...): the count would replace them with N
    generated SkyComputing nodes (:func:`sky_flower.emulation.devices.expand_fleet`),
    another fleet under the same name. The fleet is the command line's ``fleet=`` (each
    of a sweep's), else the primary config's default; a ``strategy=`` without ``fleet=``
    is left alone (Hermes and its baselines choose their own fleet)."""
    values = {}
    for raw in argv:
        key, _, value = raw.lstrip("+").partition("=")
        if key.strip() in ("fleet", "fleet.nodes", "strategy"):
            values[key.strip()] = value.strip()
    count = values.get("fleet.nodes", "")
    if not count or not all(v.strip().isdigit() for v in count.split(",")):
        return
    if "fleet" in values:
        names = [n.strip() for n in values["fleet"].split(",")]
    elif "strategy" in values:
        return
    else:
        primary = OmegaConf.load(Path(conf_dir) / "config.yaml")
        names = [
            str(e["fleet"])
            for e in primary.get("defaults", [])
            if isinstance(e, DictConfig | dict) and "fleet" in e
        ]
    for name in names:
        path = Path(conf_dir) / "fleet" / f"{name}.yaml"
        if not path.is_file():
            continue  # an unknown fleet: Hydra names it
        listed = OmegaConf.load(path).get("nodes")
        if listed is not None and not isinstance(listed, int):
            raise ValueError(
                f"'fleet.nodes={count}' on fleet {name}, which lists its {len(listed)} "
                f"nodes (conf/fleet/{name}.yaml): a count would replace them with "
                "generated nodes (SkyComputing's slowdowns, node0 the only data owner). "
                f"A node count is for fleet=skycomputing (fleet=skycomputing "
                f"fleet.nodes={count}); for fewer or other nodes, write a fleet file "
                "(docs/configuration.md, Fleet files)"
            )


def exit_on_unknown_keys(conf_dir: str | Path, argv: Sequence[str] | None = None) -> None:
    """:func:`check_overridden_keys` for this process's command line (default
    ``sys.argv[1:]``); on an error print it as one line on stderr and exit with status 1
    before Hydra starts: Hydra exits 1 on a key it does not know (a config error, not a
    usage error: argparse's 2 is for a bad flag), and so does every other refusal of bad
    input (a bad value, a bad config file)."""
    try:
        check_overridden_keys(sys.argv[1:] if argv is None else argv, conf_dir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


def check_added_keys(overrides: Sequence[str], conf_dir: str | Path) -> None:
    """Refuse each ``+key=value`` / ``++key=value`` of ``overrides`` that no part of the
    program reads (see the module docstring).

    Raises
    ------
    ValueError
        Naming the key, the close known key if there is one, and the keys of its section.
    """
    top, sections = known_keys(conf_dir)
    for raw in overrides:
        if not raw.startswith("+") or "=" not in raw:
            continue
        wrong = unknown_key(raw.lstrip("+").split("=", 1)[0].strip(), top, sections)
        if wrong:
            raise ValueError(f"{raw!r} adds {wrong}")
