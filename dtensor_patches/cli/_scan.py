"""``dtensor-patches scan``: run a step, record its DTensor ops, predict each release."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

__all__ = ["add_scan_parser", "cmd_scan"]


def cmd_scan(args: argparse.Namespace) -> int:
    # torch is imported lazily, inside the scan module.
    from dtensor_patches.scan import scan_function

    found = scan_function(args.target, world_size=args.world_size, apply_patches=args.apply_all)
    report = found.report(args.release or None)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.table())
    if found.error:
        return 1
    verdicts = {v.release: v for v in report.verdicts}
    for release in args.require or ():
        if release not in verdicts:
            raise ValueError(f"--require {release}: not among the releases reported")
        if verdicts[release].patched() != "runs":
            return 1
    return 0


def add_scan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "scan",
        help="run a step function, record its DTensor ops, predict each torch release",
        description="Run MODULE:FUNCTION (or FILE.py:FUNCTION, called without arguments) "
        "on CPU gloo ranks, record every distinct (op, input placements) it calls on "
        "DTensors, and say for each torch release 2.9-2.15 which have no strategy, which "
        "patch covers each, which are known wrong, and which would fall back.",
    )
    p.add_argument("target", help="MODULE:FUNCTION or FILE.py:FUNCTION")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument(
        "--apply-all",
        action="store_true",
        help="apply_all() before the step, so it runs past this release's gaps",
    )
    p.add_argument("--release", nargs="+", metavar="X.Y.Z", help="only these releases")
    p.add_argument(
        "--require",
        nargs="+",
        metavar="X.Y.Z",
        help="exit 1 unless the step is predicted to run with apply_all() on these releases",
    )
    p.set_defaults(func=cmd_scan)
