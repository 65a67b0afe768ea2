"""What the benchmarks' command lines share: a parser with ``--out`` (and ``--quick``),
the grid defaults ``--quick`` picks for the flags not given, the output directory's
``results.json`` and ``table.md``, and the machine and commit a page names. Each
benchmark adds only its own flags."""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sky_flower.jobs.common import write_json


def parser(
    name: str, doc: str | None, quick: str | None = None, out: bool = True
) -> argparse.ArgumentParser:
    """``python -m sky_flower.bench.<name>``'s parser, described by the first paragraph
    of ``doc``, with ``--out`` (unless ``out`` is false; :func:`out_dir` picks its
    default) and, where ``quick`` (its help) is given, ``--quick``."""
    p = argparse.ArgumentParser(
        prog=f"python -m sky_flower.bench.{name}",
        description=(doc or "").split("\n\n")[0],
    )
    if out:
        p.add_argument("--out", type=Path, help=f"default: outputs/bench_{name}_<time>")
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    return p


def parse(
    p: argparse.ArgumentParser,
    argv: list[str] | None,
    full: Mapping[str, Any] | None = None,
    quick: Mapping[str, Any] | None = None,
) -> argparse.Namespace:
    """Parse ``argv``; every flag left at ``None`` that ``full`` (or, with ``--quick``,
    ``quick``) names takes its value there (:func:`defaults`).

    Exits with a usage error (status 2) when ``--out`` exists and is not a directory."""
    args = p.parse_args(argv)
    defaults(args, full, quick)
    out = getattr(args, "out", None)
    if out is not None and out.exists() and not out.is_dir():
        p.error(f"--out: {out} exists and is not a directory")
    return args


def out_dir(out: Path | None, name: str) -> Path:
    """``out`` (``--out``), else ``outputs/bench_<name>_<time>``; created."""
    out = out or Path("outputs") / f"bench_{name}_{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def defaults(
    args: argparse.Namespace,
    full: Mapping[str, Any] | None,
    quick: Mapping[str, Any] | None = None,
) -> None:
    """Set every flag of ``args`` still ``None`` that ``full`` (with ``--quick``: ``quick``)
    names to its value there (a list copied)."""
    for key, value in ((quick if getattr(args, "quick", False) else full) or {}).items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)


def write(out: Path, text: str, results: Any) -> None:  # noqa: ANN401 - a JSON-able payload
    """Write ``out/table.md`` (``text``) and ``out/results.json`` (``results``, strictly
    valid JSON: :func:`sky_flower.jobs.common.write_json`); ``out`` is created."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n")
    write_json(out / "results.json", results)


def commit() -> str:
    """This checkout's short commit (``"unknown"`` outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
            check=False,
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def machine() -> dict[str, Any]:
    """CPU model and logical cores, torch threads, Python, torch and transformers
    versions."""
    from sky_flower.pipeline.device import cpu_name

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - the hf extra is installed here
        tf_version = "not installed"
    return {
        "cpu": cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf_version,
    }


def machine_line(info: dict[str, Any]) -> str:
    """:func:`machine` as the line a benchmark prints first."""
    return (
        f"Machine: {info['cpu']}, torch on {info['torch_threads']} thread(s), Python "
        f"{info['python']}, torch {info['torch']}, transformers {info['transformers']}"
    )


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as JSON values (paths as text)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
