"""``dtensor-patches`` / ``python -m dtensor_patches``: list, check, doctor.

Every line of the plain output fits 100 columns (verdict first, long op lists and messages
shortened); ``-v`` adds the details on indented lines, ``--json`` has all of them. torch is
imported only by the commands that need it, so ``--help`` answers at once; ``check`` and
``doctor`` start the tripwire ranks before importing it, so the two overlap.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dtensor_patches.cli._check import cmd_check, parse_gate_overrides
from dtensor_patches.cli._doctor import cmd_doctor
from dtensor_patches.cli._list import cmd_list
from dtensor_patches.cli._scan import add_scan_parser

__all__ = ["main", "parse_gate_overrides"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtensor-patches",
        description="Version-gated fixes for PyTorch DTensor gaps: list the patches, run their "
        "tripwires, diagnose this installation.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_list = sub.add_parser(
        "list", help="patches, gates, ops and whether each applies to this torch"
    )
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_list.add_argument(
        "-v", "--verbose", action="store_true", help="every op, upstream issue and fix"
    )
    p_list.add_argument(
        "--fallback-alone",
        action="store_true",
        help="run each patch's reproducer on stock torch with only the fallback on (spawns "
        "ranks): does the fallback alone give the single-device result?",
    )
    p_list.add_argument(
        "--world-size", type=int, default=2, help="ranks for --fallback-alone (default 2)"
    )
    p_list.set_defaults(func=cmd_list)
    for name, func, helptext in (
        (
            "check",
            cmd_check,
            "run the tripwires; exit 1 on a stale, too-narrow or ineffective patch",
        ),
        (
            "doctor",
            cmd_doctor,
            "torch build, backends, what apply_all() would do, the tripwires, a summary",
        ),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="full messages, torch's warnings during each run, seconds per patch",
        )
        p.add_argument(
            "--world-size", type=int, default=2, help="ranks in the CPU gloo mesh (default 2)"
        )
        p.add_argument(
            "--only", nargs="+", metavar="PATCH", help="run only these patches' tripwires"
        )
        p.add_argument(
            "--gate",
            action="append",
            metavar="NAME=SPEC",
            help="check a proposed gate instead of the registered one, e.g. 'alias=>=2.9,<2.11' "
            "(repeatable)",
        )
        p.add_argument(
            "--fallback-alone",
            action="store_true",
            help="also run each failing reproducer with only the fallback on (verdicts are "
            "still judged with it off)",
        )
        if name == "doctor":
            p.add_argument("--no-check", action="store_true", help="skip the tripwires")
        p.set_defaults(func=func)
    add_scan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 a tripwire or patch failed, 2 bad usage)."""
    args = _parser().parse_args(argv)
    if getattr(args, "world_size", 2) < 2:
        print(
            f"dtensor-patches: --world-size must be >= 2 (tripwires need a multi-rank mesh), "
            f"got {args.world_size}",
            file=sys.stderr,
        )
        return 2
    try:
        return int(args.func(args))
    except (KeyError, ValueError) as exc:
        print(f"dtensor-patches: {exc.args[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
