"""Throughput and peak memory of the PPO value worker at three parallel layouts.

For the same model and global batch, measures tokens/s of ``get_values`` and ``train`` and the
peak memory of each rank for:

- ``single``: 1 process (dp=1, tp=1),
- ``dp2``: 2 processes, FSDP2 over dp=2,
- ``dp2xtp2``: 4 processes, dp=2 x tp=2 with sequence parallelism.

Each layout runs in a fresh :class:`dtensor_patches.testing.RankPool` (gloo on CPU, nccl
when CUDA is available; a layout needing more GPUs than present is skipped). Peak memory is
``ru_maxrss`` of the rank process on CPU (MiB, includes the Python/torch runtime) and
``torch.cuda.max_memory_allocated`` on GPU; the size of each rank's parameter shard is
reported beside it. Tokens/s counts every position of the global
``[B, S]`` batch, timed on rank 0 after ``--warmup`` untimed iterations.

    python benchmarks/ppo_throughput.py --output out/ppo_throughput.json
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ppo_throughput")

LAYOUTS: list[tuple[str, int, int]] = [("single", 1, 1), ("dp2", 2, 1), ("dp2xtp2", 2, 2)]


def _batch(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    loss_mask = mask.clone()
    loss_mask[:, : seq // 4] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "old_values": torch.zeros(batch, seq),
        "returns": torch.rand(batch, seq, generator=g),
    }


def bench_rank(cfg_dict: dict[str, Any], args: dict[str, Any]) -> dict[str, float]:
    """Runs on every rank: build the worker, time get_values and train on its dp shard."""
    import torch.distributed as dist

    from ppo_value.config import ValueConfig
    from ppo_value.worker import ValueWorker

    torch.set_num_threads(args["threads"])
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    cuda = worker.device.type == "cuda"
    full = _batch(args["batch"], args["seq"], cfg.model_config["vocab_size"])
    per = args["batch"] // cfg.dp
    dp_idx = dist.get_rank() // cfg.tp
    local = {k: v[dp_idx * per : (dp_idx + 1) * per] for k, v in full.items()}

    def timed(fn: Any) -> float:
        for _ in range(args["warmup"]):
            fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args["iters"]):
            fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return (time.perf_counter() - t0) / args["iters"]

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_values = timed(lambda: worker.get_values(local))
    t_train = timed(lambda: worker.train(local))
    tokens = args["batch"] * args["seq"]
    if cuda:
        peak_mib = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    from torch.distributed.tensor import DTensor

    local_params = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in worker.model.parameters()
    )
    return {
        "param_mib": local_params / 2**20,
        "get_values_tokens_per_s": tokens / t_values,
        "train_tokens_per_s": tokens / t_train,
        "get_values_s": t_values,
        "train_s": t_train,
        "peak_mem_mib": peak_mib,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see ``--help``)."""
    p = argparse.ArgumentParser(description="PPO value worker throughput by parallel layout")
    p.add_argument("--family", default="qwen2", choices=["qwen2", "llama"])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--mixed-precision", action="store_true")
    p.add_argument("--layouts", default="single,dp2,dp2xtp2")
    p.add_argument("--output", type=Path, default=Path("out/ppo_throughput.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every layout, print a table, write JSON. Returns the exit status."""
    from dtensor_patches.testing import RankPool
    from ppo_value.config import ValueConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    n_gpus = torch.cuda.device_count() if cuda else 0
    model_config = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(args.seq, 64),
        "tie_word_embeddings": False,
    }
    run_args = {
        "batch": args.batch,
        "seq": args.seq,
        "iters": args.iters,
        "warmup": args.warmup,
        "threads": args.threads,
    }
    wanted = set(args.layouts.split(","))
    results: list[dict[str, Any]] = []
    for name, dp, tp in LAYOUTS:
        if name not in wanted:
            continue
        world = dp * tp
        row: dict[str, Any] = {"layout": name, "dp": dp, "tp": tp, "world_size": world}
        if cuda and world > n_gpus:
            row["skipped"] = f"needs {world} GPUs, {n_gpus} present"
            log.warning("%s skipped: %s", name, row["skipped"])
            results.append(row)
            continue
        cfg = ValueConfig(
            model_family=args.family,
            model_config=model_config,
            dp=dp,
            tp=tp,
            micro_batch_size=args.micro_batch_size,
            mixed_precision=args.mixed_precision,
            backend=backend,
        )
        log.info("running %s (dp=%d, tp=%d, %s)", name, dp, tp, backend)
        with RankPool(
            world_size=world, backend=backend, env={"OMP_NUM_THREADS": str(args.threads)}
        ) as pool:
            per_rank = pool.run(bench_rank, cfg.to_dict(), run_args)
        row.update(
            {
                "get_values_tokens_per_s": per_rank[0]["get_values_tokens_per_s"],
                "train_tokens_per_s": per_rank[0]["train_tokens_per_s"],
                "peak_mem_mib_per_rank": [r["peak_mem_mib"] for r in per_rank],
                "param_mib_per_rank": [r["param_mib"] for r in per_rank],
            }
        )
        results.append(row)
    header = (
        f"{'layout':<10} {'ranks':>5} {'get_values tok/s':>17} {'train tok/s':>12}  "
        "peak MiB per rank (param shard MiB)"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if "skipped" in r:
            print(f"{r['layout']:<10} {r['world_size']:>5}  skipped: {r['skipped']}")
            continue
        mem = ", ".join(
            f"{m:.0f} ({pm:.2f})"
            for m, pm in zip(r["peak_mem_mib_per_rank"], r["param_mib_per_rank"], strict=True)
        )
        print(
            f"{r['layout']:<10} {r['world_size']:>5} {r['get_values_tokens_per_s']:>17.0f} "
            f"{r['train_tokens_per_s']:>12.0f}  {mem}"
        )
    report = {
        "torch": torch.__version__,
        "backend": backend,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model_config": model_config,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
