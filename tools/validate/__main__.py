"""``python -m tools.validate``: see :mod:`tools.validate`."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from tools.sweep.runner import list_ops
from tools.validate.layouts import PATTERNS, PATTERNS_2D
from tools.validate.runner import Options, validate_ops

log = logging.getLogger("tools.validate")


def _done(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out[record["opinfo"]] = record
    return out


def run(keys: list[str], options: Options, out: Path, world_size: int, op_timeout: float) -> None:
    """Validate ``keys`` on a pool of long-lived ranks, appending one JSON line per OpInfo to
    ``out`` (an OpInfo already there is not run again: a run resumes where it stopped). A
    timeout or a dead rank is recorded for its OpInfo and the ranks are restarted."""
    from dtensor_patches.testing import RankPool

    done = _done(out)
    todo = [k for k in keys if k not in done]
    log.info("%d OpInfos to validate (%d already in %s)", len(todo), len(done), out)
    pool: RankPool | None = None
    try:
        for n, key in enumerate(todo, 1):
            if pool is None:
                pool = RankPool(world_size, timeout=op_timeout)
            t0 = time.perf_counter()
            try:
                record = pool.run(validate_ops, [key], options)[0][0]
            except Exception as exc:  # noqa: BLE001 - a hang or a dead rank is this op's result
                kind = "timeout" if isinstance(exc, TimeoutError) else "crash"
                log.warning("%s: %s; restarting the ranks", key, kind)
                pool.close()
                pool = None
                record = {"opinfo": key, "outcomes": {kind: 1}, "cells": [], "unattributed": []}
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            log.info(
                "[%d/%d] %s: %d wrong cell(s) (%.1f s)",
                n,
                len(todo),
                key,
                len(record["cells"]),
                time.perf_counter() - t0,
            )
    finally:
        if pool is not None:
            pool.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.validate", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended (resumes)")
    parser.add_argument("--ops", help="comma-separated OpInfo names or name.variant keys")
    parser.add_argument("--match", help="only OpInfos whose key contains this substring")
    parser.add_argument("--world-size", type=int, default=2, help="ranks of a 1-D mesh")
    parser.add_argument(
        "--mesh",
        help="a 2-D mesh shape, e.g. 2x2 (4 ranks; default patterns: PATTERNS_2D); default: a "
        "1-D mesh of --world-size ranks",
    )
    parser.add_argument("--max-samples", type=int, default=3)
    parser.add_argument(
        "--patterns", help=f"comma-separated, e.g. {','.join(PATTERNS[:4])} (2-D: S0/S1,...)"
    )
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--apply-patches", action="store_true", help="apply_all() on each rank")
    parser.add_argument(
        "--without-routing",
        action="store_true",
        help="with --apply-patches: leave the wrong_cells_* patches out (which cells do the "
        "hand-written patches leave wrong?)",
    )
    parser.add_argument(
        "--ops-from",
        type=Path,
        help="only the OpInfos where this earlier run found a wrong cell or an unattributed "
        "wrong result, or whose ranks crashed or hung",
    )
    parser.add_argument("--op-timeout", type=float, default=300.0)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    mesh_shape = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else ()
    world_size = math.prod(mesh_shape) if mesh_shape else args.world_size
    default = PATTERNS_2D if len(mesh_shape) == 2 else PATTERNS
    options = Options(
        patterns=tuple(args.patterns.split(",")) if args.patterns else default,
        backward=not args.no_backward,
        max_samples=args.max_samples,
        apply_patches=args.apply_patches,
        without_routing=args.without_routing,
        mesh_shape=mesh_shape,
    )
    selected = list_ops(args.ops.split(",") if args.ops else None, args.match, foreach=True)
    keys = [key for key, _, reason in selected if not reason]
    if args.ops_from is not None:
        found = {
            k
            for k, r in _done(args.ops_from).items()
            if r["cells"] or r["unattributed"] or {"crash", "timeout"} & set(r["outcomes"])
        }
        keys = [k for k in keys if k in found]
    run(keys, options, args.out, world_size, args.op_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
