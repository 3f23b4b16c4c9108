"""``python -m tools.validate``: see :mod:`tools.validate`."""

from __future__ import annotations

import argparse
import dataclasses
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


def _merge(key: str, records: list[dict[str, Any]], failed: dict[str, str]) -> dict[str, Any]:
    """One OpInfo's record from its patterns' records; ``failed``: pattern -> ``timeout`` or
    ``crash`` for the patterns whose ranks hung or died (those stay in the outcomes, so the
    OpInfo is still listed as crashed, with what else was validated beside them)."""
    outcomes: dict[str, int] = {}
    for record in records:
        for outcome, count in record["outcomes"].items():
            outcomes[outcome] = outcomes.get(outcome, 0) + count
    for kind in failed.values():
        outcomes[kind] = outcomes.get(kind, 0) + 1
    return {
        "opinfo": key,
        "outcomes": outcomes,
        "cells": [c for r in records for c in r["cells"]],
        "unattributed": [u for r in records for u in r["unattributed"]],
        "failed_patterns": failed,
    }


def run(
    keys: list[str],
    options: Options,
    out: Path,
    world_size: int,
    op_timeout: float,
    pattern_timeout: float | None = None,
    hash_seeds: tuple[int, ...] | None = None,
) -> None:
    """Validate ``keys`` on a pool of long-lived ranks, appending one JSON line per OpInfo to
    ``out`` (an OpInfo already there is not run again: a run resumes where it stopped). When
    an OpInfo's ranks hang or die, the ranks are restarted and its placement patterns run one
    at a time: the record names the patterns that hang (``failed_patterns``) and keeps what
    the others found, instead of losing the whole OpInfo to one hanging pattern (each pattern
    gets ``pattern_timeout`` s, default a third of ``op_timeout`` and at least 30).
    ``hash_seeds``: each rank's ``PYTHONHASHSEED`` (default: inherited, each rank its own where
    unset), to find the decisions that follow set order and differ between ranks."""
    from dtensor_patches.testing import STARTUP_TIMEOUT, RankPool

    done = _done(out)
    todo = [k for k in keys if k not in done]
    log.info("%d OpInfos to validate (%d already in %s)", len(todo), len(done), out)
    pool: RankPool | None = None

    def attempt(key: str, opts: Options, timeout: float) -> dict[str, Any] | str:
        nonlocal pool
        if pool is None:
            # Start-up (every rank importing torch) is not the op's time: on a loaded machine
            # it can take longer than a short op timeout, which would then blame the op.
            pool = RankPool(
                world_size,
                timeout=timeout,
                startup_timeout=STARTUP_TIMEOUT,
                hash_seeds=hash_seeds,
            )
        pool.timeout = timeout
        try:
            return pool.run(validate_ops, [key], opts)[0][0]
        except Exception as exc:  # noqa: BLE001 - a hang or a dead rank is this op's result
            pool.close()
            pool = None
            return "timeout" if isinstance(exc, TimeoutError) else "crash"

    try:
        for n, key in enumerate(todo, 1):
            t0 = time.perf_counter()
            result = attempt(key, options, op_timeout)
            if isinstance(result, dict):
                record = result
            else:
                if len(options.patterns) > 1:
                    log.warning("%s: %s; one pattern at a time", key, result)
                    parts: list[dict[str, Any]] = []
                    failed: dict[str, str] = {}
                    for pattern in options.patterns:
                        one = dataclasses.replace(options, patterns=(pattern,))
                        part = attempt(key, one, pattern_timeout or max(30.0, op_timeout / 3))
                        if isinstance(part, dict):
                            parts.append(part)
                        else:
                            failed[pattern] = part
                            log.warning("%s %s: %s", key, pattern, part)
                    # Every pattern alone may pass: the whole run only outlasted op_timeout
                    # on a loaded host, and the OpInfo is validated in full.
                    record = _merge(key, parts, failed)
                    record["whole_run"] = result
                else:
                    log.warning("%s: %s", key, result)
                    record = _merge(key, [], {"*": result})
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
    parser.add_argument(
        "--hash-seeds",
        help="comma-separated PYTHONHASHSEED per rank, e.g. 0,7,7,0 (ranks seeded apart, as "
        "under torchrun; default: inherited)",
    )
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
    seeds = tuple(int(s) for s in args.hash_seeds.split(",")) if args.hash_seeds else None
    if seeds is not None and len(seeds) != world_size:
        parser.error(f"--hash-seeds: {len(seeds)} seeds for {world_size} ranks")
    run(keys, options, args.out, world_size, args.op_timeout, hash_seeds=seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
