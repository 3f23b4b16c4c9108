"""Slowdown of ``dtensor_patches.verify()`` on the critic's train step: the full mode, and the
sampling mode (``verify(sample=True)``) once its signatures are known.

The PPO value worker (tiny Qwen2 from a config, FSDP2 + TP=2 + SP on a 2-rank CPU gloo mesh,
``apply_all()``) runs its ``train`` step plain, under ``verify()`` and under
``verify(sample=True)``, in a randomly interleaved order (seeded), for ``--repeats`` rounds
after a warm-up round (which also lets the sampling mode see every signature once: the cost
measured for it is that of the second and later steps). Reported per mode: the median of rank
0's wall time and process CPU time per step (each step ended by a barrier), their ratios to
plain, and each mode's min-max range.

    python benchmarks/verify_cost.py --repeats 11 --output docs/verify-cost-2.13.0.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

MODES = ("plain", "verify", "verify_sample")


def bench_rank(repeats: int, batch: int, seq: int) -> dict[str, Any]:
    """On every rank: interleaved plain / verified / sampled train steps; per-step seconds
    (wall, CPU) of each."""
    import torch
    import torch.distributed as dist

    import dtensor_patches as dp
    from dtensor_patches.verify import Signatures
    from ppo_value.config import ValueConfig, tiny_model_config
    from ppo_value.worker import ValueWorker

    torch.set_num_threads(1)
    worker = ValueWorker(ValueConfig(dp=1, tp=2, lr=1e-4, model_config=tiny_model_config("qwen2")))
    g = torch.Generator().manual_seed(0)
    data = {
        "input_ids": torch.randint(1, 64, (batch, seq), generator=g),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "loss_mask": torch.ones(batch, seq, dtype=torch.long),
        "old_values": 0.1 * torch.randn(batch, seq, generator=g),
        "returns": torch.rand(batch, seq, generator=g),
    }
    signatures = Signatures()
    checked: list[int] = []

    def plain() -> None:
        worker.train(data, micro_batch_size=batch)

    def verified() -> None:
        with dp.verify(raise_on_mismatch=False) as report:
            worker.train(data, micro_batch_size=batch)
        if not report.clean:
            raise AssertionError(str(report))

    def sampled() -> None:
        with dp.verify(sample=True, raise_on_mismatch=False, signatures=signatures) as report:
            worker.train(data, micro_batch_size=batch)
        if not report.clean:
            raise AssertionError(str(report))
        checked.append(report.signatures)

    steps = {"plain": plain, "verify": verified, "verify_sample": sampled}

    def timed(fn: Any) -> tuple[float, float]:
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        dist.barrier()
        return time.perf_counter() - wall, time.process_time() - cpu

    for fn in steps.values():  # warm-up: propagation caches, lazy imports, the signatures
        fn()
    first_checked = checked[0]
    order = list(MODES) * repeats
    random.Random(0).shuffle(order)
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for mode in order:
        times[mode].append(timed(steps[mode]))
    return {"times": times, "first_step_signatures": first_checked, "later": checked[1:]}


def main(argv: list[str] | None = None) -> int:
    from dtensor_patches.testing import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    measured = run_on_ranks(
        bench_rank, 2, args.repeats, args.batch, args.seq, env={"OMP_NUM_THREADS": "1"}
    )[0]
    times = measured["times"]
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "repeats": args.repeats,
        "batch": args.batch,
        "seq": args.seq,
        "first_step_signatures": measured["first_step_signatures"],
        "later_steps_signatures": max(measured["later"], default=0),
    }
    for mode in MODES:
        walls = [t[0] for t in times[mode]]
        cpus = [t[1] for t in times[mode]]
        result[mode] = {
            "wall_s_median": statistics.median(walls),
            "cpu_s_median": statistics.median(cpus),
            "wall_s_range": [min(walls), max(walls)],
        }
    for mode in ("verify", "verify_sample"):
        result[f"{mode}_slowdown_wall"] = (
            result[mode]["wall_s_median"] / result["plain"]["wall_s_median"]
        )
        result[f"{mode}_slowdown_cpu"] = (
            result[mode]["cpu_s_median"] / result["plain"]["cpu_s_median"]
        )
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
