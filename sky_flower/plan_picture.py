"""Draw a plan's pipelines as text: which node runs which layers, per data owner.

``python -m sky_flower.plan_picture <plan.json>`` prints the picture of a ``plan.json``
written by ``python -m sky_flower.plan`` or ``python -m sky_flower.run`` (its
``pipelines``, or its ``stages`` when it has one pipeline). The README's picture is
``python -m sky_flower.plan model=mlp fleet=edge4 hydra.run.dir=outputs/plan_edge4``
followed by ``python -m sky_flower.plan_picture outputs/plan_edge4/plan.json``; the
planner times the layers on the host, so another machine may cut elsewhere.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CELL = 6  # characters per layer


def _bar(stages: Sequence[Sequence[Any]], cell: int = CELL) -> str:
    """One pipeline as ``|node ----|node ---|``: each stage as wide as its layers.

    Parameters
    ----------
    stages : sequence of (node, first_layer, last_layer)
        The pipeline's stages in order, layers inclusive.
    cell : int
        Characters per layer.
    """
    out = ""
    for node, first, last in stages:
        width = (int(last) - int(first) + 1) * cell - 1
        label = f"{node} {first}-{last}" if last != first else f"{node} {first}"
        label = label if len(label) <= width else str(node)[:width]
        out += "|" + label.ljust(width, "-")
    return out + "|"


def _stage(stage: Any) -> tuple[str, int, int]:  # noqa: ANN401 - a list or a dict
    """``(node, first_layer, last_layer)`` of a stage as ``plan.json`` writes it: a
    ``[node, first, last]`` list (``sky_flower.plan``) or a dict (the training job)."""
    if isinstance(stage, dict):
        return str(stage["node"]), int(stage["first_layer"]), int(stage["last_layer"])
    node, first, last = stage
    return str(node), int(first), int(last)


def picture(plan: dict[str, Any]) -> str:
    """The text picture of one ``plan.json`` (a dict).

    Raises
    ------
    ValueError
        If the plan has neither ``pipelines`` nor ``stages``.
    """
    pipes = plan.get("pipelines")
    if not pipes:
        stages = plan.get("stages")
        if not stages:
            raise ValueError("plan.json has neither 'pipelines' nor 'stages': not a plan")
        pipes = [
            {
                "owner": stages[0]["node"],
                "stages": [[s["node"], s["first_layer"], s["last_layer"]] for s in stages],
                "predicted_step_time_s": plan.get("predicted_step_time_s"),
            }
        ]
    pipes = [{**p, "stages": [_stage(s) for s in p["stages"]]} for p in pipes]
    layers = max(int(s[2]) for p in pipes for s in p["stages"]) + 1
    name_w = max(len(f"{p['owner']}'s data") for p in pipes) + 2
    head = "".join(f"{i:<{CELL}}" for i in range(layers)).rstrip()
    lines = [f"{'layer':<{name_w}} {head}"]
    used: set[str] = set()
    for p in pipes:
        step = p.get("predicted_step_time_s")
        note = f"  step {step:.3f} s" if isinstance(step, int | float) else ""
        if p.get("after"):
            note += f", after {', '.join(pipes[i]['owner'] + chr(39) + 's' for i in p['after'])}"
        lines.append(f"{p['owner'] + chr(39) + 's data':<{name_w}}{_bar(p['stages'])}{note}")
        used.update(str(s[0]) for s in p["stages"])
    idle = [n for n in plan.get("idle_nodes", []) if n not in used]
    if idle:
        lines.append(f"idle: {', '.join(idle)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the picture of the ``plan.json`` named on the command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: python -m sky_flower.plan_picture <plan.json or its directory>\n")
        return 2
    path = Path(args[0])
    if path.is_dir():  # a run's output directory: its plan.json
        path = path / "plan.json"
    if not path.is_file():
        sys.stderr.write(f"{path}: no such file (python -m sky_flower.plan writes plan.json)\n")
        return 1
    try:
        sys.stdout.write(picture(json.loads(path.read_text())) + "\n")
    except ValueError as err:
        sys.stderr.write(f"{path}: {err}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
