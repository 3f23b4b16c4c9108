"""Critic throughput at a long sequence: context parallelism (cp=2) against data parallelism
(dp=2) at equal world size, in one run.

Both layouts live in one 2-rank process group (one worker each, built from the same seed) and
are timed interleaved in a random order per round (after ``--warmup`` untimed rounds): a
``train`` step and a ``get_values`` call on the same global batch of ``--batch`` sequences of
``--seq`` tokens (all valid, packing off by default), with the same tokens per rank per
forward in both layouts (``--micro`` sequences per micro-batch for dp2, ``cp`` times as many
half sequences for cp2: the same number of micro-batches, so of FSDP2 all-gathers). Throughput is valid tokens of the global
batch per second of wall time on rank 0; beside it each rank's process CPU time per step (the
time the scheduler takes away on a shared machine does not count), and the ratio cp2 / dp2 of
each round, as medians. Peak memory (``ru_maxrss``) is measured in a fresh process group per
layout, since the CPU allocator keeps what it freed, with ``--micro`` whole sequences per
micro-batch in both layouts (the long-context case: a cp2 rank holds half of each sequence).

What it shows on CPU: CP splits the sequence, so each rank's activations and attention work
are ``1 / cp`` of a sequence; dp splits the batch instead. On 2 CPU cores the attention work
is the same total either way, and CP adds a key/value all-gather per layer (and its
reduce in backward), so throughput is expected at or below dp's; CP's gain is the per-rank
memory of a long sequence (a sequence dp cannot fit at all). GPU paths (nccl) are not measured
here.

    python benchmarks/cp_throughput.py --output out/cp_throughput.json
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

LAYOUTS = {"dp2": {"dp": 2, "cp": 1}, "cp2": {"dp": 1, "cp": 2}}


def _batch(size: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(size, seq, dtype=torch.long)
    loss_mask = mask.clone()
    loss_mask[:, :16] = 0
    return {
        "input_ids": torch.randint(1, vocab, (size, seq), generator=g),
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "old_values": torch.zeros(size, seq),
        "returns": torch.rand(size, seq, generator=g),
    }


def _shard(batch: dict[str, torch.Tensor], dp: int, rank_dp: int) -> dict[str, torch.Tensor]:
    per = next(iter(batch.values())).shape[0] // dp
    return {k: v[rank_dp * per : (rank_dp + 1) * per] for k, v in batch.items()}


def _config(layout: dict[str, int], args: dict[str, Any], *, equal_tokens: bool = True) -> Any:
    from ppo_value.config import ValueConfig, tiny_model_config

    model = tiny_model_config(
        "qwen2",
        hidden_size=args["hidden"],
        intermediate_size=2 * args["hidden"],
        num_hidden_layers=args["layers"],
        vocab_size=args["vocab"],
        max_position_embeddings=args["seq"],
    )
    return ValueConfig(
        model_config=model,
        # the same tokens per rank per forward in both layouts: cp ranks hold 1 / cp of each
        # sequence, so cp times as many sequences per micro-batch
        micro_batch_size=args["micro"] * (layout["cp"] if equal_tokens else 1),
        sequence_packing=args["packing"],
        **layout,
    )


def bench_rank(args: dict[str, Any]) -> dict[str, Any]:
    """Every rank: both workers, timed interleaved in a random order per round."""
    import torch.distributed as dist

    from ppo_value.worker import ValueWorker

    torch.set_num_threads(args["threads"])
    workers = {name: ValueWorker(_config(layout, args)) for name, layout in LAYOUTS.items()}
    batch = _batch(args["batch"], args["seq"], args["vocab"])
    local = {n: _shard(batch, w.config.dp, w.dp_rank) for n, w in workers.items()}
    order = random.Random(1)
    out: dict[str, dict[str, list[float]]] = {
        n: {"train_wall": [], "train_cpu": [], "values_wall": [], "values_cpu": []} for n in workers
    }
    for rnd in range(args["warmup"] + args["repeats"]):
        names = list(workers)
        order.shuffle(names)
        for name in names:
            for what, call in (
                ("train", lambda n=name: workers[n].train(local[n])),
                ("values", lambda n=name: workers[n].get_values(local[n])),
            ):
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                call()
                cpu = time.process_time() - cpu
                dist.barrier()
                wall = time.perf_counter() - wall
                if rnd >= args["warmup"]:
                    out[name][f"{what}_wall"].append(wall)
                    out[name][f"{what}_cpu"].append(cpu)
    return out


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory_rank(layout: dict[str, int], args: dict[str, Any]) -> dict[str, float]:
    """Peak RSS (MiB) of one worker's ``train`` step in a fresh process and its growth over
    the RSS just before the step (activations, gradients, optimiser state), ``--micro`` whole
    sequences per micro-batch in both layouts (the long-context case: cp2 holds half of each)."""
    from ppo_value.worker import ValueWorker

    torch.set_num_threads(args["threads"])
    worker = ValueWorker(_config(layout, args, equal_tokens=False))
    batch = _batch(args["batch"], args["seq"], args["vocab"])
    local = _shard(batch, worker.config.dp, worker.dp_rank)
    before = _rss_mib()
    worker.train(local)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak, "step_growth_mib": peak - before}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="critic throughput: cp=2 vs dp=2 at a long sequence")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument(
        "--micro", type=int, default=1, help="sequences per micro-batch of dp2 (cp2: cp times)"
    )
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--packing", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--output", type=Path, default=Path("out/cp_throughput.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from dtensor_patches.testing import RankPool

    ns = parse_args(argv)
    args = {k: getattr(ns, k) for k in vars(ns) if k != "output"}
    env = {"OMP_NUM_THREADS": str(ns.threads)}
    with RankPool(world_size=2, env=env, timeout=3600) as pool:
        per_rank = pool.run(bench_rank, args)
    tokens = ns.batch * ns.seq
    rows: dict[str, Any] = {}
    for name in LAYOUTS:
        t = per_rank[0][name]
        rows[name] = {
            "train_tokens_per_s": tokens / statistics.median(t["train_wall"]),
            "values_tokens_per_s": tokens / statistics.median(t["values_wall"]),
            "train_cpu_s_median_per_rank": [
                statistics.median(r[name]["train_cpu"]) for r in per_rank
            ],
            "train_wall_s_median": statistics.median(t["train_wall"]),
        }
    for what in ("train", "values"):
        ratios = [
            c / d
            for c, d in zip(
                per_rank[0]["cp2"][f"{what}_wall"], per_rank[0]["dp2"][f"{what}_wall"], strict=True
            )
        ]
        rows[f"{what}_time_ratio_cp2_over_dp2"] = statistics.median(ratios)
    if not ns.no_memory:
        for name, layout in LAYOUTS.items():
            with RankPool(world_size=2, env=env, timeout=3600) as pool:
                rows[name]["memory_per_rank"] = pool.run(memory_rank, layout, args)
    result = {"args": args, "torch": torch.__version__, "results": rows}
    ns.output.parent.mkdir(parents=True, exist_ok=True)
    ns.output.write_text(json.dumps(result, indent=2))
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
