"""What each patch saves over the fallback: bytes moved and time, on the same input, one run.

For every patch that applies to the running torch, its reproducer's first case runs on a 2-rank
CPU gloo mesh two ways, interleaved (strategy, fallback, strategy, …), repeated to a median:

- **patch**: the patch applied alone, the fallback off;
- **fallback**: the patch not applied, and every call of the patch's ops sent through the
  fallback (gather inputs, compute on full tensors), as it would run if no patch existed and
  torch refused the call.

Bytes are what the collectives issued in the call move into one rank (all_gather: the other
ranks' shards; all_reduce / reduce_scatter: the tensor; all_to_all: the input), counted by a
dispatch mode over ``_c10d_functional`` ops. ``fallback alone`` says whether stock torch with
only the fallback on (the patch not applied, nothing forced) gives the single-device result on
the patch's whole reproducer: where it does, the patch adds only speed.

``--combine A.json B.json`` prints the README's table from saved runs.

    python benchmarks/fallback_costs.py --json docs/benchmarks/fallback_costs-<torch>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # a benchmark, outside the package


class _Bytes(TorchDispatchMode):
    """Sums the bytes the functional collectives of a call bring into this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor dispatch with this mode still active, so the collectives it issues
            # on local tensors come through here (as CommDebugMode does).
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        namespace = getattr(func, "namespace", "")
        if namespace in ("_c10d_functional", "c10d_functional") and args:
            t = args[0]
            name = func.__name__
            if isinstance(t, torch.Tensor) and "wait" not in name:
                size = t.numel() * t.element_size()
                if "all_gather" in name:
                    n = int(args[1]) if len(args) > 1 and isinstance(args[1], int) else 2
                    self.bytes += size * (n - 1)
                else:
                    self.bytes += size
        return out


def _forced_fallback(ops: set[Any]) -> Any:
    from dtensor_patches.dispatch import fallback

    def rule(schema: Any, native: Any) -> Any:
        if schema.op not in ops:
            return None

        def run(op_call: Any, args: Any, kwargs: Any) -> Any:
            return fallback.run_fallback(op_call, args, kwargs, RuntimeError("forced"))

        return run

    return rule


def _gathered(op_call: Any, args: Any, kwargs: Any) -> Any:
    from dtensor_patches.dispatch import gather

    return gather.run_gathered(op_call, tuple(args), dict(kwargs), "forced")


def _time(fn: Any) -> tuple[float, int]:
    mode = _Bytes()
    start = time.perf_counter()
    with mode:
        fn()
    return time.perf_counter() - start, mode.bytes


def _on_rank(repeats: int, skip_alone: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    from dtensor_patches import registry
    from dtensor_patches._torch.schemas import resolve_op
    from dtensor_patches._torch.tables import has_native_handler
    from dtensor_patches.dispatch import fallback, registration
    from dtensor_patches.dispatch.handler import Handler
    from dtensor_patches.dispatch.miss_rules import ANY_OP, MissRule
    from dtensor_patches.reproducers import to_dtensor
    from dtensor_patches.testing import world_mesh
    from dtensor_patches.tripwire import with_required

    mesh = world_mesh()
    rows = []
    owner = object()
    for patch in registry.all_patches():
        if not patch.applies_to() or not patch.cases:
            continue
        case = patch.cases[0]
        inputs = [
            to_dtensor(x, mesh, p) if p is not None else x
            for x, p in zip(case.inputs(), case.placements, strict=True)
        ]

        def call(case: Any = case, inputs: Any = inputs) -> None:
            args = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
            case.fn(*args)

        # The whole reproducer (every case), the patch not applied, only the fallback on.
        alone: str | None = None
        measured = patch.name not in skip_alone
        if measured:
            fallback.install("warn")
            try:
                with with_required(patch):
                    alone = patch.reproduce_on(mesh)
            finally:
                fallback.uninstall()
        ops = {resolve_op(name) for name in patch.ops}
        samples: dict[str, list[float]] = {"patch": [], "fallback": []}
        moved: dict[str, int] = {}
        errors: dict[str, str] = {}
        for _ in range(repeats):
            for way in ("patch", "fallback"):
                if way == "patch":
                    patch.apply()
                else:
                    fallback.install("warn")
                    # Ops torch sends to a custom handler never reach propagation: replace
                    # the handler with the fallback's computation for the duration.
                    forced = [
                        MissRule(ANY_OP, _forced_fallback(ops)),
                        *(Handler(str(op), _gathered) for op in ops if has_native_handler(op)),
                    ]
                    registration.install(owner, forced)
                try:
                    call()  # warm: propagation caches, first-call logging
                    seconds, n = _time(call)
                    samples[way].append(seconds)
                    moved[way] = n
                except Exception as exc:  # noqa: BLE001 - reported per row, the run goes on
                    errors[way] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                finally:
                    if way == "patch":
                        patch.revert()
                    else:
                        registration.remove(owner)
                        fallback.uninstall()
        rows.append(
            {
                "patch": patch.name,
                "case": case.label,
                "patch_s": statistics.median(samples["patch"]) if samples["patch"] else None,
                "fallback_s": (
                    statistics.median(samples["fallback"]) if samples["fallback"] else None
                ),
                "patch_bytes": moved.get("patch"),
                "fallback_bytes": moved.get("fallback"),
                "fallback_alone": alone,
                "alone_measured": measured,
                "errors": errors,
            }
        )
    return rows


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.2f}" if unit == "ms" else f"{int(value)}"


def combine(paths: list[Path]) -> str:
    """The README table from saved ``--json`` runs: per patch and release, whether the fallback
    alone is correct (then the patch adds only speed) and both ways' time and bytes."""
    runs = [json.loads(p.read_text()) for p in paths]
    lines = [
        "| patch | torch | fallback alone | patch ms | fallback ms | patch bytes | fallback bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    names: list[str] = []
    for run in runs:
        names += [r["patch"] for r in run["rows"] if r["patch"] not in names]
    for name in names:
        for run in runs:
            row = next((r for r in run["rows"] if r["patch"] == name), None)
            if row is None:
                continue
            if not row.get("alone_measured", True):
                alone = "not measured"
            elif row["fallback_alone"] is None:
                alone = "correct: **adds only speed**"
            else:
                alone = "wrong or raises"
            lines.append(
                f"| `{name}` | {run['torch'].split('+')[0]} | {alone} | "
                f"{_cell(row['patch_s'], 'ms')} | {_cell(row['fallback_s'], 'ms')} | "
                f"{_cell(row['patch_bytes'], 'B')} | {_cell(row['fallback_bytes'], 'B')} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--combine", nargs="+", type=Path, help="print the table of saved runs")
    parser.add_argument(
        "--skip-alone",
        nargs="*",
        default=[],
        metavar="PATCH",
        help="do not run these patches' reproducers with the fallback alone (too slow)",
    )
    args = parser.parse_args()
    if args.combine:
        print(combine(args.combine))
        return 0
    from dtensor_patches.testing import RankPool

    with RankPool(2, timeout=1200) as pool:
        rows = pool.run(_on_rank, args.repeats, tuple(args.skip_alone))[0]
    print(f"torch {torch.__version__}: patch vs fallback, 2 ranks, median of {args.repeats}")
    print(
        f"{'patch':22} {'case':40} {'patch ms':>9} {'fb ms':>9} {'patch B':>8} {'fb B':>8}  alone"
    )
    for r in rows:
        ms = [
            f"{v * 1e3:9.2f}" if v is not None else f"{'-':>9}"
            for v in (r["patch_s"], r["fallback_s"])
        ]
        by = [
            f"{v:8d}" if v is not None else f"{'-':>8}"
            for v in (r["patch_bytes"], r["fallback_bytes"])
        ]
        alone = (
            "not measured"
            if not r["alone_measured"]
            else ("correct" if r["fallback_alone"] is None else "not enough")
        )
        print(f"{r['patch']:22} {r['case'][:40]:40} {ms[0]} {ms[1]} {by[0]} {by[1]}  {alone}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"torch": torch.__version__, "repeats": args.repeats, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
