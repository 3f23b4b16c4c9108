"""What the patches cost: communication per patched op, dispatch overhead, apply_all() time.

Run with the torch release to measure (patched ops only exist where a patch applies)::

    python benchmarks/patch_costs.py --json out/patch_costs-<torch>.json

1. Communication: each case runs once under ``CommDebugMode`` on a 2-rank CPU gloo mesh with
   ``apply_all()`` and once on stock torch (patches reverted); the table gives the collectives
   issued and the lower bound (0 for an op along unsharded dims, one gather of the sharded dim
   otherwise). ``--combine A.json B.json ...`` (runs on several releases) adds the native
   column: the stock count on the first release where the patch is gated out and the op runs.
2. Dispatch overhead: the mean time of the second-and-later calls of a patched op and of a
   comparable native op on the same DTensor (same shape, placement, dim), side by side in one
   run, and their ratio. For ops that the ``inplace_writes`` handler sits on top of, the
   comparison is the same call on stock torch (the handler reverted), in the same run.
3. ``apply_all()``: import time of ``dtensor_patches`` with torch already imported, and the
   time of the first ``apply_all()`` call, each in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# (label, patch, input placement, op on x, lower bound on collectives, comparable native op;
# None: the same op on stock torch)
CASES: list[tuple[str, str, str, Callable[[Any], Any], int, Callable[[Any], Any] | None]] = [
    ("argmax(x, 1)", "dim_reductions", "S0", lambda x: x.argmax(1), 0, lambda x: x.amax(1)),
    ("argmax(x, 1)", "dim_reductions", "S1", lambda x: x.argmax(1), 1, lambda x: x.amax(1)),
    (
        "logsumexp(x, 1)",
        "dim_reductions",
        "S0",
        lambda x: torch.logsumexp(x, 1),
        0,
        lambda x: x.sum(1),
    ),
    (
        "cumprod(x, 1)",
        "scans",
        "S0",
        lambda x: torch.cumprod(x, 1),
        0,
        lambda x: torch.cumsum(x, 1),
    ),
    (
        "cumprod(x, 1)",
        "scans",
        "S1",
        lambda x: torch.cumprod(x, 1),
        1,
        lambda x: torch.cumsum(x, 1),
    ),
    ("flip(x, [1])", "flip_roll", "S0", lambda x: torch.flip(x, [1]), 0, lambda x: x.neg()),
    ("unfold(x, 1, 2, 1)", "unfold", "S0", lambda x: x.unfold(1, 2, 1), 0, lambda x: x.neg()),
    ("var_mean(x, 1)", "var_mean", "S0", lambda x: torch.var_mean(x, 1), 0, lambda x: x.var(1)),
    (
        "kthvalue(x, 2, 1)",
        "order_stats",
        "S0",
        lambda x: torch.kthvalue(x, 2, 1),
        0,
        lambda x: x.amax(1),
    ),
    (
        "mse_loss(x, y)",
        "elementwise_losses",
        "S0",
        lambda x: torch.nn.functional.mse_loss(x, x * 0.5),
        0,
        lambda x: ((x - x * 0.5) ** 2).mean(),
    ),
    (
        "nonzero(x > 0)",
        "data_dependent",
        "S0",
        lambda x: torch.nonzero(x > 0),
        1,
        lambda x: (x > 0).sum(),
    ),
    # inplace_writes: the handler's cost on calls it passes straight to torch
    ("x.add_(1.0)", "inplace_writes", "S0", lambda x: x.add_(1.0), 0, None),
    ("x.copy_(x)", "inplace_writes", "S0", lambda x: x.copy_(x), 0, None),
    ("x[:, :8]", "inplace_writes", "S0", lambda x: x[:, :8], 0, None),
    # inplace_writes: the problem cases (a Partial target; a write through a detached slice)
    (
        "x.sum(0).add_(1.0)",
        "inplace_writes",
        "S0",
        lambda x: x.sum(0).add_(1.0),
        1,
        lambda x: x.sum(0) + 1.0,
    ),
    ("x[:8].zero_()", "inplace_writes", "S0", lambda x: x[:8].zero_(), 2, lambda x: x[:8] * 0),
]


def _collectives(fn: Callable[[Any], Any], x: Any) -> tuple[int, dict[str, int]]:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn(x)
    return comm.get_total_counts(), {str(k): v for k, v in comm.get_comm_counts().items()}


def _mean_us(fn: Callable[[Any], Any], x: Any, repeats: int) -> float:
    import torch.distributed as dist

    fn(x)  # the first call fills the propagation cache
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(x)
    return (time.perf_counter() - start) / repeats * 1e6


def _rank(repeats: int) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dtensor_patches

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))

    def fresh(placement: str) -> Any:
        p = Shard(int(placement[1])) if placement.startswith("S") else Replicate()
        return distribute_tensor(full, mesh, [p])

    rows: list[dict[str, Any]] = []
    # Stock torch first: collectives where torch runs the op itself (or the error it raises).
    for label, patch, placement, op, _, _ in CASES:
        row: dict[str, Any] = {"op": label, "patch": patch, "placement": placement}
        try:
            row["stock_collectives"] = _collectives(op, fresh(placement))[0]
        except Exception as exc:  # noqa: BLE001 - an op torch cannot run is a row of the table
            row["stock_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        rows.append(row)
    stock_us = {}
    for label, _, placement, op, _, native in CASES:
        if native is None and "stock_error" not in rows[len(stock_us)]:
            stock_us[(label, placement)] = _mean_us(op, fresh(placement), repeats)
        else:
            stock_us[(label, placement)] = None

    report = dtensor_patches.apply_all()
    for row, (label, _, placement, op, lower_bound, native) in zip(rows, CASES, strict=True):
        row["lower_bound"] = lower_bound
        try:
            row["collectives"], row["by_kind"] = _collectives(op, fresh(placement))
            x = fresh(placement)
            patched_us = _mean_us(op, x, repeats)
            native_us = stock_us[(label, placement)] if native is None else None
            if native_us is None and native is not None:
                native_us = _mean_us(native, x, repeats)
            row["patched_us"] = round(patched_us, 1)
            if native_us is not None:
                row["native_us"] = round(native_us, 1)
                row["ratio"] = round(patched_us / native_us, 2)
                row["native_is"] = "same op, stock" if native is None else "comparable op"
        except Exception as exc:  # noqa: BLE001 - an unsupported op is a row of the table
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    dtensor_patches.revert_all()
    for row in rows:
        row["patches_applied"] = len(report.applied)
    return rows


def _fresh(code: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return float(out.strip().splitlines()[-1])


def _print_rows(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'op':<20} {'in':<3} {'collectives':>11} {'stock':>6} {'lower bound':>11} "
        f"{'patched us':>10} {'native us':>9} {'ratio':>6}  native is"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        stock = r.get("stock_collectives", "raises")
        if "error" in r:
            print(f"{r['op']:<20} {r['placement']:<3} {r['error']}")
            continue
        print(
            f"{r['op']:<20} {r['placement']:<3} {r['collectives']:>11} {stock:>6} "
            f"{r['lower_bound']:>11} {r['patched_us']:>10} {r.get('native_us', '-'):>9} "
            f"{r.get('ratio', '-'):>6}  {r.get('native_is', '')}"
        )


def combine(paths: list[Path]) -> list[dict[str, Any]]:
    """Per (op, placement): our collectives on the first release (in version order) inside
    the patch's gate, torch's own on the first release outside it where stock torch runs the
    op, and the lower bound."""
    from packaging.version import Version

    from dtensor_patches import get

    runs = sorted(
        (json.loads(p.read_text()) for p in paths),
        key=lambda run: Version(Version(run["torch"]).base_version),
    )
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        release = Version(run["torch"]).base_version
        for r in run["ops"]:
            entry = table.setdefault(
                (r["op"], r["placement"]),
                {"op": r["op"], "placement": r["placement"], "lower_bound": r.get("lower_bound")},
            )
            in_gate = get(r["patch"]).applies_to(release)
            if in_gate and "collectives" in r and "ours" not in entry:
                entry["ours"], entry["ours_on"] = r["collectives"], release
            if not in_gate and "stock_collectives" in r and "native" not in entry:
                entry["native"], entry["native_on"] = r["stock_collectives"], release
    return list(table.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        help="print ours-vs-native collectives from JSON files of runs on several releases",
    )
    args = parser.parse_args()
    if args.combine:
        header = f"{'op':<20} {'in':<3} {'ours':>5} {'on':>7} {'native':>7} {'on':>7} {'lower bound':>11}"
        print(header)
        print("-" * len(header))
        for e in combine(args.combine):
            print(
                f"{e['op']:<20} {e['placement']:<3} {e.get('ours', '-'):>5} "
                f"{e.get('ours_on', '-'):>7} {e.get('native', '-'):>7} {e.get('native_on', '-'):>7} "
                f"{e['lower_bound']:>11}"
            )
        return 0
    from dtensor_patches.testing import RankPool

    with RankPool(2) as pool:
        rows = pool.run(_rank, args.repeats)[0]
    import_ms = _fresh(
        "import time, torch; t=time.perf_counter(); import dtensor_patches; "
        "print((time.perf_counter()-t)*1e3)"
    )
    apply_ms = _fresh(
        "import time, torch, dtensor_patches; t=time.perf_counter(); dtensor_patches.apply_all(); "
        "print((time.perf_counter()-t)*1e3)"
    )
    machine = f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores"
    print(f"torch {torch.__version__}; 2-rank CPU gloo mesh; {machine}")
    print(f"import dtensor_patches (torch already imported): {import_ms:.1f} ms")
    print(f"first apply_all(): {apply_ms:.1f} ms")
    print()
    _print_rows(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "machine": machine,
                    "import_ms": import_ms,
                    "apply_all_ms": apply_ms,
                    "ops": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
