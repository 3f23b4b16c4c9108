"""``dtensor-patches list``: every patch, its gate, whether it applies, its ops."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from dtensor_patches import _text

if TYPE_CHECKING:
    pass

from dtensor_patches.cli._output import details, load_torch, out, torch_version

__all__ = ["cmd_list"]


def _patch_rows() -> list[dict[str, object]]:
    from dtensor_patches import registry

    rows = []
    for patch in registry.all_patches():
        rows.append(
            {
                "name": patch.name,
                "summary": patch.summary,
                "ops": list(patch.ops),
                "gate": _text.format_gate(patch.gate),
                "applies_to_this_torch": patch.applies_to(),
                "replicates": patch.replicates,
                "upstream_issue": patch.upstream_issue,
                "upstream_fix": patch.upstream_fix,
            }
        )
    return rows


def _fallback_alone_rows(args: argparse.Namespace, rows: list[dict[str, object]]) -> None:
    """Add ``fallback_alone`` (``fixed``/``still wrong``/``not needed``) and ``after_fallback``
    to each row: every reproducer that fails on stock torch, rerun with only the fallback on."""
    from dtensor_patches.tripwire import run_tripwires, start_pool

    pool = start_pool(args.world_size)
    try:
        results = run_tripwires([str(r["name"]) for r in rows], pool=pool, fallback_alone=True)
    finally:
        pool.close()
    for row, result in zip(rows, results, strict=True):
        row["fallback_alone"] = result.fallback_alone.value
        row["after_fallback"] = result.after_fallback


def cmd_list(args: argparse.Namespace) -> int:
    load_torch(args)
    rows = _patch_rows()
    if args.fallback_alone:
        _fallback_alone_rows(args, rows)
    if args.json:
        print(json.dumps({"torch_version": torch_version(), "patches": rows}, indent=2))
        return 0
    applies = sum(bool(r["applies_to_this_torch"]) for r in rows)
    out(f"torch {torch_version()}: {len(rows)} patches, {applies} apply to this release")
    cells = [
        [
            r["name"],
            r["gate"],
            "applies" if r["applies_to_this_torch"] else "gated out",
            ", ".join(_text.short_op(op) for op in r["ops"]),  # type: ignore[attr-defined]
        ]
        for r in rows
    ]
    headers = ["patch", "gate", "this torch", "ops"]
    if args.fallback_alone:
        # Whether the fallback alone gives the single-device result on this torch: where it
        # does, the patch adds only speed (benchmarks/fallback_costs.py measures how much).
        headers.insert(3, "fallback alone")
        for r, cell in zip(rows, cells, strict=True):
            cell.insert(3, str(r["fallback_alone"]))
    flexible = len(headers) - 1
    head, widths = _text.table(headers, cells, flexible=flexible)
    for line in head:
        out(line)
    for r, cell in zip(rows, cells, strict=True):
        ops = _text.short_ops(r["ops"], widths[flexible])  # type: ignore[arg-type]
        out(_text.row_line([*cell[:flexible], ops], widths))
        if args.verbose and r.get("after_fallback"):
            details("with the fallback alone", r["after_fallback"])
        if args.verbose:
            details("what", r["summary"])
            details("ops", ", ".join(r["ops"]))  # type: ignore[arg-type]
            if r["upstream_issue"]:
                details("upstream issue", r["upstream_issue"])
            if r["upstream_fix"]:
                details("upstream fix", r["upstream_fix"])
    if not args.verbose:
        out("(-v: every op, upstream issue and fix; --json: all of it)")
    return 0
