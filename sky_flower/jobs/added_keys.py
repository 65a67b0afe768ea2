"""Refuse a misspelt setting added with Hydra's ``+`` (``+trian.lr=0.1``).

Hydra refuses ``trian.lr=0.1`` (the key is not in the config) and tells the user to
append it with ``+``; a ``+`` key is then taken silently and nothing reads it. Here an
added key is refused when it is a new top-level key, or a new key inside one of the
primary config's own sections (``train``, ``schedule``, ``benchmark``, ...): those hold
only the settings ``conf/config.yaml`` lists. Keys added under the groups that take
arbitrary arguments (``model``, ``dataset``, ``fleet``, ``strategy``, ...) are the
user's own and pass.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def known_keys(conf_dir: str | Path) -> tuple[set[str], dict[str, set[str]]]:
    """The top-level keys of the primary config, its groups and the group options in
    the global package (``transport`` sets ``schedule.*``), and, per own section (not a
    group), every key they list."""
    primary = OmegaConf.load(Path(conf_dir) / "config.yaml")
    assert isinstance(primary, DictConfig)
    groups: set[str] = set()
    for entry in primary.get("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            groups.add(entry.split("/")[0].split("@")[0])
        elif isinstance(entry, DictConfig | dict):
            groups.update(str(k).split("/")[0].split("@")[0] for k in entry)
    files = [primary]  # and the group options that write into the global package
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
        key = raw.lstrip("+").split("=", 1)[0].strip()
        head, _, rest = key.partition(".")
        if head not in top:
            close = difflib.get_close_matches(head, sorted(top), n=1)
            hint = f": did you mean {close[0]}?" if close else ""
            raise ValueError(
                f"{raw!r} adds the top-level key {head!r}, which nothing reads{hint} "
                f"(known: {', '.join(sorted(top))})"
            )
        if head in sections and rest:
            sub = rest.split(".")[0]
            if sub not in sections[head]:
                close = difflib.get_close_matches(sub, sorted(sections[head]), n=1)
                hint = f": did you mean {head}.{close[0]}?" if close else ""
                raise ValueError(
                    f"{raw!r} adds {head}.{sub}, which is not a setting{hint} "
                    f"({head} has: {', '.join(sorted(sections[head]))})"
                )
