"""``dtensor-patches check``: the tripwires, one row per patch as it finishes."""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dtensor_patches import _text

if TYPE_CHECKING:
    from dtensor_patches.testing import RankPool
    from dtensor_patches.tripwire import TripwireResult

from dtensor_patches.cli._output import details, load_torch, out, torch_version

__all__ = [
    "cmd_check",
    "parse_gate_overrides",
    "print_failures",
    "print_quiet_warnings",
    "run_tripwires_table",
    "start_pool",
]


def parse_gate_overrides(pairs: Sequence[str] | None) -> dict[str, str]:
    """``["alias=>=2.9,<2.11"]`` -> ``{"alias": ">=2.9,<2.11"}``.

    Raises:
        ValueError: an item without ``=`` or with an invalid specifier.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    overrides: dict[str, str] = {}
    for pair in pairs or ():
        name, sep, spec = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--gate takes NAME=SPECIFIER, got {pair!r}")
        try:
            SpecifierSet(spec)
        except InvalidSpecifier as exc:
            raise ValueError(f"--gate {pair!r}: invalid version specifier {spec!r}") from exc
        overrides[name] = spec
    return overrides


class _TripwireTable:
    """Prints tripwire results as they arrive, in columns fixed up front."""

    HEADERS = ("verdict", "patch", "gate", "with patch", "stock torch")

    def __init__(self, names: Sequence[str], gates: Sequence[str], verbose: bool) -> None:
        from dtensor_patches.tripwire import Verdict, WithPatch

        sample = [
            [
                max((v.value for v in Verdict), key=len),
                n,
                g,
                max((w.value for w in WithPatch), key=len),
                "",
            ]
            for n, g in zip(names, gates, strict=True)
        ]
        self.head, self.widths = _text.table(self.HEADERS, sample, flexible=4)
        # The stock column takes every remaining column, so rows printed later fit too.
        self.widths[4] = _text.WIDTH - sum(self.widths[:4]) - 2 * 4
        self.head = [
            _text.row_line(self.HEADERS, self.widths),
            "  ".join("-" * w for w in self.widths),
        ]
        self.verbose = verbose

    def start(self) -> None:
        for line in self.head:
            out(line)

    def add(self, r: TripwireResult) -> None:
        # One rank's words are enough in the table; -v and --json say which rank.
        stock = "correct" if r.bug is None else "bug: " + re.sub(r"^\[rank \d+\] ", "", r.bug)
        out(
            _text.row_line(
                [r.verdict.value, r.patch, _text.format_gate(r.gate), r.with_patch.value, stock],
                self.widths,
            )
        )
        if self.verbose:
            if r.bug is not None:
                details("stock torch", r.bug)
            if r.after_patch is not None:
                details("with patch", r.after_patch)
            if r.fallback_alone.value != "not run":
                details("fallback alone", r.after_fallback or r.fallback_alone.value)
            for line in r.warnings:
                details("warning", line)
            out(f"    {r.seconds:.1f} s")


def start_pool(args: argparse.Namespace) -> RankPool:
    from dtensor_patches.tripwire import start_pool

    return start_pool(args.world_size)


def run_tripwires_table(
    args: argparse.Namespace, pool: RankPool, *, stream: bool
) -> list[TripwireResult]:
    """Validate the selection, then run it on ``pool``; with ``stream``, print each row as it
    comes. Raises ``KeyError``/``ValueError`` on unknown names or bad gates (exit 2)."""
    from dtensor_patches import registry
    from dtensor_patches.tripwire import run_tripwires

    overrides = parse_gate_overrides(args.gate)
    names = list(args.only) if args.only else [p.name for p in registry.all_patches()]
    gates = []
    for name in names:
        gate = overrides.get(name)
        gates.append(_text.format_gate(gate if gate is not None else registry.get(name).gate))
    for name in overrides:
        registry.get(name)
    table = _TripwireTable(names, gates, args.verbose) if stream else None
    if table is not None:
        out(
            f"torch {torch_version()}: {len(names)} tripwire(s) on a {args.world_size}-rank "
            "CPU gloo mesh"
        )
        table.start()
    return run_tripwires(
        names,
        gate_overrides=overrides,
        pool=pool,
        on_result=table.add if table is not None else None,
        fallback_alone=getattr(args, "fallback_alone", False),
    )


def print_failures(results: Sequence[TripwireResult]) -> None:
    for r in results:
        if not r.passed:
            for n, line in enumerate(_text.wrap(r.message, indent="  ")):
                out(("FAIL" + line[4:]) if n == 0 else line)


def print_quiet_warnings(args: argparse.Namespace, pool: RankPool | None) -> None:
    notes = list(getattr(args, "import_warnings", []))
    if pool is not None:
        notes += [n for n in pool.startup_warnings if n not in notes]
    if args.verbose and notes:
        out("warnings while importing torch (parent and ranks):")
        for note in notes:
            details("warning", note)


def cmd_check(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    pool = start_pool(args)
    try:
        load_torch(args)
        results = run_tripwires_table(args, pool, stream=not args.json)
    finally:
        pool.close()
    failed = sum(not r.passed for r in results)
    if args.json:
        print(
            json.dumps(
                {"torch_version": torch_version(), "tripwires": [r.to_dict() for r in results]},
                indent=2,
            )
        )
        return 1 if failed else 0
    print_failures(results)
    print_quiet_warnings(args, pool)
    if not args.verbose and any(r.warnings for r in results):
        out("(torch's warnings during the runs are hidden: -v shows them)")
    out(f"{len(results) - failed} passed, {failed} failed")
    out(f"({time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0
