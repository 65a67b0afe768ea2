"""Tables from a header and rows: plain aligned text (logs, terminals) or markdown
(``docs/benchmarks/`` pages), with number cells formatted in one place (:func:`num`).

No Flower, Hydra or torch here: ``sky_flower.core`` uses it too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def num(value: float | None, spec: str = ".3f", unit: str = "", missing: str = "-") -> str:
    """``value`` as a cell: ``format(value, spec) + unit``, or ``missing`` for ``None``
    or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec) + unit


def markdown(headers: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: ``| h1 | h2 |``, ``|---|---|``, then one line per row (cells
    as ``str``; a row may be shorter than the header)."""
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def text(
    headers: Sequence[object],
    rows: Iterable[Sequence[object]],
    *,
    align: str = "",
    sep: str = " ",
    rule: bool = False,
    indent: str = "",
) -> str:
    """A plain-text table: each column as wide as its widest cell, columns joined by
    ``sep``, trailing spaces dropped (so a last, free-text column is not padded).

    ``align`` holds one letter per column, ``"l"`` (left) or ``"r"`` (right); columns
    past its end are right-aligned. ``rule`` puts a line of dashes under the header;
    ``indent`` starts every line."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(len(cells[0]))]
    align = align.ljust(len(widths), "r")

    def line(row: list[str]) -> str:
        return (
            indent
            + sep.join(
                c.ljust(w) if a == "l" else c.rjust(w)
                for c, w, a in zip(row, widths, align, strict=False)
            ).rstrip()
        )

    lines = [line(r) for r in cells]
    if rule:
        lines.insert(1, indent + "-" * max(len(x) - len(indent) for x in lines))
    return "\n".join(lines)
