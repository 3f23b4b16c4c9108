"""The text table of a scan report (:meth:`dtensor_patches.scan.ScanReport.table`), at most
``width`` columns: a verdict per release, an op-by-release grid of the ops that need
anything, and per release the ops without strategy, their patches, known wrong results and
fallbacks."""

from __future__ import annotations

import textwrap
from typing import Any

# The report's types (``dtensor_patches.scan.ScanReport``, ``Finding``) are not imported: scan
# imports this module to render its report, and the layers must not import each other.
ScanReport = Any
Finding = Any

# Worst first: the cell of an op shows its worst finding on that release.
_SEVERITY = ("fallbk", "FAILS", "WRONG", "fails?", "wrong?", "decomp", "absent", "patch", "ok")

LEGEND = (
    "patch: no strategy in stock torch, a patch covers it; fallbk: no strategy and no patch "
    "(the call fallback would take it); WRONG/FAILS: a patch's reproducer measured stock torch "
    "wrong/raising on this case (fixed by that patch); wrong?/fails?: the same, but the "
    "placements cannot tell whether the call is that case; decomp: no strategy, DTensor "
    "decomposes it (stock torch may still refuse a part; with apply_all() the fallback takes "
    "it); absent: no such op in that release. On the release the scan ran on, what each call "
    "did decides where it can"
)


def _cell(finding: Finding) -> str:
    if finding.kind == "missing":
        return "patch" if finding.patches else "fallbk"
    if finding.kind in ("wrong", "fails"):
        word = finding.kind.upper() if finding.certain else finding.kind + "?"
        return word
    return {"decomposes": "decomp", "absent": "absent"}[finding.kind]


def _short(op: str) -> str:
    return op[len("aten.") :] if op.startswith("aten.") else op


def _inputs(inputs: tuple[str, ...]) -> str:
    return "(" + ", ".join(inputs) + ")"


def _describe(finding: Finding) -> str:
    call = finding.call
    what = f"{call.op} {_inputs(call.inputs)}"
    fix = f"patch {', '.join(finding.patches)}" if finding.patches else "no patch"
    if finding.kind == "missing":
        return f"{what}: no strategy; " + (fix if finding.patches else "no patch: falls back")
    if finding.kind in ("wrong", "fails"):
        maybe = "" if finding.certain else "may be the measured case: "
        return f"{what}: {maybe}{finding.detail} ({fix})"
    if finding.kind == "decomposes":
        return f"{what}: no strategy; DTensor decomposes it (its parts not predicted)"
    return f"{what}: not in this release"


def render(report: ScanReport, width: int = 100) -> str:
    """The report as text no wider than ``width`` (>= 60) columns."""
    found = report.scan
    lines = [
        f"scan: {len(found.ops)} ops, {len(found.calls)} distinct (op, input placements) "
        f"on DTensors, recorded on torch {found.torch}"
    ]
    if found.error:
        lines += textwrap.wrap(f"the step raised (recorded up to there): {found.error}", width)
    lines += ["", f"{'torch':<10}{'stock':<8}{'apply_all()':<13}patches needed"]
    for v in report.verdicts:
        needed = ", ".join(v.patches_needed) or "-"
        head = f"{v.release:<10}{v.stock():<8}{v.patched():<13}"
        lines += textwrap.wrap(needed, width, initial_indent=head, subsequent_indent=" " * 31)
    cells: dict[str, dict[str, str]] = {}
    for v in report.verdicts:
        for f in v.findings:
            row = cells.setdefault(f.call.op, {})
            cell = _cell(f)
            old = row.get(v.release, "ok")
            row[v.release] = min(old, cell, key=_SEVERITY.index)
    releases = [v.release for v in report.verdicts]
    col = max(7, *(len(r) + 1 for r in releases))
    name_width = max(20, width - col * len(releases))
    lines += ["", f"{'op':<{name_width}}" + "".join(f"{r:<{col}}" for r in releases)]
    for op in found.ops:
        if op not in cells:
            continue
        name = _short(op)
        grid = "".join(f"{cells[op].get(r, 'ok'):<{col}}" for r in releases)
        if len(name) >= name_width:
            lines += [name, " " * name_width + grid]
        else:
            lines.append(f"{name:<{name_width}}{grid}".rstrip())
    quiet = len(found.ops) - len(cells)
    lines.append(f"({quiet} other ops: a strategy on every release, no measured bug)")
    lines += ["", *textwrap.wrap(LEGEND, width)]
    for v in report.verdicts:
        if not v.findings:
            continue
        lines += ["", f"torch {v.release} ({v.torch}):"]
        groups = (
            ("no strategy", v.missing),
            ("would fall back", v.fallback),
            ("wrong results", v.of_kind("wrong")),
            ("fails", v.of_kind("fails")),
            ("decomposed", v.of_kind("decomposes")),
            ("absent", v.of_kind("absent")),
        )
        for title, findings in groups:
            if not findings:
                continue
            lines.append(f"  {title}: {len(findings)}")
            for f in findings:
                lines += textwrap.wrap(
                    _describe(f), width, initial_indent="    ", subsequent_indent="      "
                )
    return "\n".join(line.rstrip() for line in lines)
