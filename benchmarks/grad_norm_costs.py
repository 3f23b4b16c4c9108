"""What ``torch.nn.utils.clip_grad_norm_`` costs on DTensor gradients, stock and after
``apply_all()`` (which routes it to ``dtensor_patches.grad_norm``), side by side in one run.

On 2 CPU gloo ranks (``torchrun --nproc-per-node 2 benchmarks/grad_norm_costs.py``): 120
gradients like an FSDP2 model's (two of three ``Shard(0)`` ``[256, 64]``, one of three
``Replicate()`` ``[64]``), blocks of 10 calls after 3 warm-up calls, stock and patched in a
random interleaved order, 8 blocks each; the median per call of wall time and process CPU time
(which a busy machine's scheduler cannot inflate), and the values, which must agree.

    torchrun --nproc-per-node 2 benchmarks/grad_norm_costs.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist


def _grads(mesh: Any) -> list[torch.nn.Parameter]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    params = []
    for i in range(120):
        shape, placement = ((256, 64), Shard(0)) if i % 3 else ((64,), Replicate())
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [placement]))
        p.grad = distribute_tensor(torch.randn(shape, generator=gen), mesh, [placement])
        params.append(p)
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the medians here")
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    import dtensor_patches

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = _grads(mesh)

    def clip() -> float:
        norm = torch.nn.utils.clip_grad_norm_(params, 1e9)  # no scaling: the same grads
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    times: dict[str, list[tuple[float, float]]] = {"stock": [], "apply_all": []}
    values: dict[str, float] = {}
    order = ["stock", "apply_all"] * args.blocks
    random.Random(1).shuffle(order)
    for mode in order:
        dtensor_patches.apply_all() if mode == "apply_all" else dtensor_patches.revert_all()
        for _ in range(3):
            values[mode] = clip()
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(10):
            clip()
        times[mode].append(
            ((time.perf_counter() - wall) / 10 * 1e3, (time.process_time() - cpu) / 10 * 1e3)
        )
    dtensor_patches.revert_all()
    result = {
        mode: {
            "wall_ms": statistics.median(t[0] for t in runs),
            "cpu_ms": statistics.median(t[1] for t in runs),
            "norm": values[mode],
        }
        for mode, runs in times.items()
    }
    result["torch"] = torch.__version__  # type: ignore[assignment]
    if dist.get_rank() == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    # gloo can abort a rank (SIGABRT, "terminate called without an active exception") when
    # one rank tears its process group down while another is still finishing: wait for all.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
