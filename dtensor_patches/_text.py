"""Plain-text layout for the CLI: gates written lower bound first, short op lists, tables that
fit a terminal of :data:`WIDTH` columns. No torch import."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

__all__ = ["WIDTH", "clip", "format_gate", "row_line", "short_op", "short_ops", "table", "wrap"]

WIDTH = 100
"""Columns every line of ``list``, ``check`` and ``doctor`` fits in (details: ``-v``, ``--json``)."""

# Lower bounds first, then exact/compatible pins, then upper bounds and exclusions: the order
# a reader writes a range in (``>=2.9,<2.10``).
_ORDER = {">=": 0, ">": 0, "~=": 1, "==": 1, "===": 1, "<": 2, "<=": 2, "!=": 3}


def format_gate(gate: object) -> str:
    """A ``SpecifierSet`` (or its string) as ``">=2.9,<2.10"``: lower bound first.

    ``packaging`` prints specifiers sorted as strings (``"<2.10,>=2.9"``); this only reorders
    them, so the result parses back to the same set. ``""`` (every release) becomes ``"any"``.
    """
    parts = [p.strip() for p in str(gate).split(",") if p.strip()]
    if not parts:
        return "any"

    def key(part: str) -> tuple[int, str]:
        match = re.match(r"(===|~=|==|!=|<=|>=|<|>)", part)
        return (_ORDER.get(match.group(1), 4) if match else 4, part)

    return ",".join(sorted(parts, key=key))


def short_op(name: str) -> str:
    """``"aten.std.correction"`` -> ``"std.correction"``, ``"aten.alias.default"`` -> ``"alias"``."""
    if name.startswith("aten."):
        name = name[len("aten.") :]
    return name.removesuffix(".default")


def short_ops(ops: Sequence[str], width: int) -> str:
    """The ops, short names, comma-separated, cut at an op boundary to fit ``width``
    (``"add_.Tensor, sub_.Tensor, +37 more"``)."""
    names = [short_op(op) for op in ops]
    text = ", ".join(names)
    if len(text) <= width:
        return text
    for keep in range(len(names) - 1, 0, -1):
        text = ", ".join(names[:keep]) + f", +{len(names) - keep} more"
        if len(text) <= width:
            return text
    return clip(f"{names[0]}, +{len(names) - 1} more", width)


def clip(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with ``...`` when longer."""
    flat = " ".join(str(text).split())
    if len(flat) <= width:
        return flat
    return flat[: max(width - 3, 0)] + "..."


def wrap(text: str, indent: str = "    ", width: int = WIDTH) -> list[str]:
    """``text`` wrapped to ``width`` columns, every line indented by ``indent``."""
    return textwrap.wrap(
        " ".join(str(text).split()),
        width=width,
        initial_indent=indent,
        subsequent_indent=indent,
        break_long_words=True,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    flexible: int | None = None,
    width: int = WIDTH,
) -> tuple[list[str], list[int]]:
    """Header lines and column widths for ``rows`` within ``width`` columns.

    Every column is as wide as its longest cell, except ``flexible`` (an index), which gets
    what is left and whose cells :func:`row_line` clips. Returns ``(header lines, widths)``.
    """
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    if flexible is not None:
        fixed = sum(w for i, w in enumerate(widths) if i != flexible) + 2 * (len(widths) - 1)
        widths[flexible] = max(min(widths[flexible], width - fixed), len(headers[flexible]))
    head = row_line(headers, widths)
    rule = "  ".join("-" * w for w in widths)
    return [head, rule], widths


def row_line(cells: Sequence[object], widths: Sequence[int]) -> str:
    """One table row: each cell clipped to its column and padded."""
    return "  ".join(clip(str(c), w).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
