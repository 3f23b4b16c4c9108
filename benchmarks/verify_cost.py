"""Slowdown of ``dtensor_patches.verify()`` on the critic's train step.

The PPO value worker (tiny Qwen2 from a config, FSDP2 + TP=2 + SP on a 2-rank CPU gloo mesh,
``apply_all()``) runs one ``train`` step plain and one under ``verify()``, interleaved, for
``--repeats`` rounds after a warm-up round; the ratio of the medians is reported (seconds are
wall time of rank 0, each step ended by a barrier).

    python benchmarks/verify_cost.py --repeats 5 --output out/verify_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def bench_rank(repeats: int, batch: int, seq: int) -> dict[str, Any]:
    """On every rank: interleaved plain / verified train steps; per-step seconds of each."""
    import torch
    import torch.distributed as dist

    import dtensor_patches as dp
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

    def plain() -> None:
        worker.train(data, micro_batch_size=batch)

    def verified() -> None:
        with dp.verify(raise_on_mismatch=False) as report:
            worker.train(data, micro_batch_size=batch)
        if not report.clean:
            raise AssertionError(str(report))

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    plain(), verified()  # warm-up (propagation caches, lazy imports)
    times: dict[str, list[float]] = {"plain": [], "verify": []}
    for _ in range(repeats):
        times["plain"].append(timed(plain))
        times["verify"].append(timed(verified))
    return times


def main(argv: list[str] | None = None) -> int:
    from dtensor_patches.testing import run_on_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    times = run_on_ranks(
        bench_rank, 2, args.repeats, args.batch, args.seq, env={"OMP_NUM_THREADS": "1"}
    )[0]
    result = {
        "plain_s_median": statistics.median(times["plain"]),
        "verify_s_median": statistics.median(times["verify"]),
        "repeats": args.repeats,
        "batch": args.batch,
        "seq": args.seq,
    }
    result["slowdown"] = result["verify_s_median"] / result["plain_s_median"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
