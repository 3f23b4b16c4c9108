"""What ``apply_all()`` adds to one cached DTensor call: the hot path, op by op.

On 2 CPU gloo ranks, common ops whose sharding decision is cached (``mul`` and ``add`` of
``Shard(0)`` tensors, ``add`` of a ``Replicate()`` and a ``Shard(0)`` tensor, a slice, a
``sum`` over the sharded dim, an in-place ``add_``, and ops a patch serves with a custom
handler on some releases: ``squeeze``, advanced indexing, ``mse_loss``) are timed in blocks of 2000 calls, stock
and after ``apply_all()``, the two configurations interleaved in a random (seeded) order for
``--rounds`` rounds with 50 untimed calls after each switch. Reported per op: rank 0's median
process CPU time per call in each configuration, and the median of the per-round ratios with
a bootstrap 95% interval. A step's overhead is bounded by these (a step is such calls plus
kernels); ``step_overhead.py`` measures whole steps.

    python benchmarks/call_overhead.py --rounds 21 --json docs/benchmarks/call_overhead-2.13.0.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _ops(mesh: Any) -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    x = distribute_tensor(torch.randn(8, 16, generator=g), mesh, [Shard(0)])
    y = distribute_tensor(torch.randn(8, 16, generator=g), mesh, [Shard(0)])
    r = distribute_tensor(torch.randn(8, 16, generator=g), mesh, [Replicate()])
    z = distribute_tensor(torch.zeros(8, 16), mesh, [Shard(0)])
    u = distribute_tensor(torch.randn(1, 8, 16, generator=g), mesh, [Shard(1)])
    rows = distribute_tensor(torch.tensor([0, 3, 5]), mesh, [Replicate()])
    return {
        "mul(S0, S0)": lambda: torch.mul(x, y),
        "add(S0, S0)": lambda: torch.add(x, y),
        "add(R, S0)": lambda: torch.add(r, x),
        "x[:, 2:10]": lambda: x[:, 2:10],
        "sum(S0, dim=0)": lambda: x.sum(0),
        "add_(S0)": lambda: z.add_(y),
        "squeeze(0)": lambda: u.squeeze(0),
        "r[rows] (index)": lambda: r[rows],
        "mse_loss(S0, S0)": lambda: torch.nn.functional.mse_loss(x, y),
    }


def bench_rank(rounds: int, calls: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dtensor_patches

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ops = _ops(mesh)
    dtensor_patches.revert_all()
    refused = []
    for name, op in list(ops.items()):
        try:
            op()
        except Exception:  # noqa: BLE001 - stock torch refuses it here: nothing to compare
            refused.append(name)
            del ops[name]
    configs = ("stock", "apply_all")
    times: dict[str, dict[str, list[float]]] = {op: {c: [] for c in configs} for op in ops}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(configs)
        rng.shuffle(order)
        for config in order:
            dtensor_patches.revert_all()
            if config == "apply_all":
                dtensor_patches.apply_all()
            for name, op in ops.items():
                for _ in range(50):
                    op()
                dist.barrier()
                start = time.process_time()
                for _ in range(calls):
                    op()
                times[name][config].append((time.process_time() - start) / calls * 1e6)
    dtensor_patches.revert_all()
    return {"times": times, "refused": refused}


def _interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    rng = random.Random(1)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def main(argv: list[str] | None = None) -> int:
    from dtensor_patches.testing import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    measured = run_on_ranks(bench_rank, 2, args.rounds, args.calls, env={"OMP_NUM_THREADS": "1"})[0]
    times = measured["times"]
    rows: list[dict[str, Any]] = [{"op": name, "stock": "raises"} for name in measured["refused"]]
    print(f"torch {torch.__version__}, {args.rounds} rounds of {args.calls} calls")
    print(f"{'op':<16} {'stock us':>9} {'apply_all us':>12} {'ratio':>7}  interval")
    for name, by_config in times.items():
        ratios = [a / s for a, s in zip(by_config["apply_all"], by_config["stock"], strict=True)]
        low, high = _interval(ratios)
        row = {
            "op": name,
            "stock_us": statistics.median(by_config["stock"]),
            "apply_all_us": statistics.median(by_config["apply_all"]),
            "ratio": statistics.median(ratios),
            "interval": [low, high],
        }
        rows.append(row)
        print(
            f"{name:<16} {row['stock_us']:>9.2f} {row['apply_all_us']:>12.2f} "
            f"{row['ratio']:>7.3f}  {low:.3f}-{high:.3f}"
        )
    for name in measured["refused"]:
        print(f"{name:<16} stock torch raises: not compared")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"torch": torch.__version__, "rounds": args.rounds, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
