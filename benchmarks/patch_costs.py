"""What the patches cost: communication per patched op, dispatch overhead, apply_all() time.

Run with the torch release to measure (patched ops only exist where a patch applies)::

    python benchmarks/patch_costs.py --json out/patch_costs-<torch>.json

1. Communication: each case runs once under ``CommDebugMode`` on a 2-rank CPU gloo mesh with
   ``apply_all()``; the table gives the collectives issued and the lower bound (0 for an op
   along unsharded dims, one gather of the sharded dim otherwise). Run it on a release where
   torch has its own strategy to get the native column.
2. Dispatch overhead: the mean time of the second-and-later calls of a patched op and of a
   comparable native op on the same DTensor (same shape, placement, dim), side by side in one
   run, and their ratio.
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

# (label, input placement, op on x, lower bound on collectives, comparable native op)
CASES: list[tuple[str, str, Callable[[Any], Any], int, Callable[[Any], Any]]] = [
    ("argmax(x, 1)", "S0", lambda x: x.argmax(1), 0, lambda x: x.amax(1)),
    ("argmax(x, 1)", "S1", lambda x: x.argmax(1), 1, lambda x: x.amax(1)),
    ("logsumexp(x, 1)", "S0", lambda x: torch.logsumexp(x, 1), 0, lambda x: x.sum(1)),
    ("cumprod(x, 1)", "S0", lambda x: torch.cumprod(x, 1), 0, lambda x: torch.cumsum(x, 1)),
    ("cumprod(x, 1)", "S1", lambda x: torch.cumprod(x, 1), 1, lambda x: torch.cumsum(x, 1)),
    ("flip(x, [1])", "S0", lambda x: torch.flip(x, [1]), 0, lambda x: x.neg()),
    ("unfold(x, 1, 2, 1)", "S0", lambda x: x.unfold(1, 2, 1), 0, lambda x: x.neg()),
    ("var_mean(x, 1)", "S0", lambda x: torch.var_mean(x, 1), 0, lambda x: x.var(1)),
    ("kthvalue(x, 2, 1)", "S0", lambda x: torch.kthvalue(x, 2, 1), 0, lambda x: x.amax(1)),
    (
        "mse_loss(x, y)",
        "S0",
        lambda x: torch.nn.functional.mse_loss(x, x * 0.5),
        0,
        lambda x: ((x - x * 0.5) ** 2).mean(),
    ),
    ("nonzero(x > 0)", "S0", lambda x: torch.nonzero(x > 0), 1, lambda x: (x > 0).sum()),
]


def _rank(repeats: int) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import dtensor_patches

    report = dtensor_patches.apply_all()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    rows = []
    for label, placement, op, lower_bound, native in CASES:
        p = Shard(int(placement[1])) if placement.startswith("S") else Replicate()
        x = distribute_tensor(full, mesh, [p])
        row: dict[str, Any] = {"op": label, "placement": placement, "lower_bound": lower_bound}
        try:
            with CommDebugMode() as comm:
                op(x)
            row["collectives"] = comm.get_total_counts()
            row["by_kind"] = {str(k): v for k, v in comm.get_comm_counts().items()}
            timings = {}
            for name, fn in (("patched", op), ("native", native)):
                fn(x)  # first call fills the propagation cache
                dist.barrier()
                start = time.perf_counter()
                for _ in range(repeats):
                    fn(x)
                timings[name] = (time.perf_counter() - start) / repeats * 1e6
            row["patched_us"] = round(timings["patched"], 1)
            row["native_us"] = round(timings["native"], 1)
            row["ratio"] = round(timings["patched"] / timings["native"], 2)
        except Exception as exc:  # noqa: BLE001 - an unsupported op is a row of the table
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        rows.append(row)
    applied = report.applied
    for row in rows:
        row["patches_applied"] = len(applied)
    return rows


def _fresh(code: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return float(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
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
    header = f"{'op':<20} {'in':<3} {'collectives':>11} {'lower bound':>11} {'patched us':>10} {'native us':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['op']:<20} {r['placement']:<3} {r['error']}")
            continue
        print(
            f"{r['op']:<20} {r['placement']:<3} {r['collectives']:>11} {r['lower_bound']:>11} "
            f"{r['patched_us']:>10} {r['native_us']:>9} {r['ratio']:>6}"
        )
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
