"""``python -m tools.sweep``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from tools.sweep.catalog import PLACEMENTS
from tools.sweep.report import _print_summary, render_markdown, write_json
from tools.sweep.runner import Options, run_sweep


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m tools.sweep [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.sweep",
        description="Run torch's op database through DTensor and report the ops that fail.",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ops", help="comma-separated OpInfo names or name.variant keys")
    parser.add_argument("--match", help="only OpInfos whose key contains this substring")
    parser.add_argument("--max-samples", type=int, default=3, help="samples per op and placement")
    parser.add_argument("--partial", action="store_true", help="also sweep Partial() inputs")
    parser.add_argument("--inplace", action="store_true", help="also sweep in-place variants")
    parser.add_argument(
        "--apply-patches",
        action="store_true",
        help="call dtensor_patches.apply_all() on each rank first",
    )
    parser.add_argument(
        "--fallback",
        choices=("off", "warn", "error"),
        default="off",
        help="with --apply-patches: the fallback mode (default off: the patches alone)",
    )
    parser.add_argument(
        "--op-timeout",
        type=float,
        default=120.0,
        help="seconds one op may take before it is recorded as timeout",
    )
    parser.add_argument(
        "--placements",
        help="comma-separated subset of Shard(0),Shard(-1),Replicate(),Partial() "
        "(default: the first three, plus Partial() with --partial)",
    )
    parser.add_argument(
        "--baseline",
        metavar="JSON",
        help="an earlier --json report: the markdown lists the rows whose outcome changed",
    )
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="sweep nothing: load this earlier --json report and print/write it",
    )
    parser.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the report as markdown")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    placements = PLACEMENTS + (("Partial()",) if args.partial else ())
    if args.placements:
        placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
        unknown = set(placements) - {*PLACEMENTS, "Partial()"}
        if unknown:
            parser.error(f"unknown placements: {sorted(unknown)}")
    options = Options(
        placements=placements,
        max_samples=args.max_samples,
        apply_patches=args.apply_patches,
        inplace=args.inplace,
        fallback=args.fallback,
    )
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    if args.render:
        with open(args.render, encoding="utf-8") as fh:
            report = json.load(fh)
    else:
        report = run_sweep(
            world_size=args.world_size,
            ops=ops,
            match=args.match,
            options=options,
            op_timeout=args.op_timeout,
        )
    baseline = None
    if args.baseline:
        with open(args.baseline, encoding="utf-8") as fh:
            baseline = json.load(fh)
    _print_summary(report)
    if args.json:
        write_json(report, args.json)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(render_markdown(report, baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
