"""What ``apply_all()`` costs on a training step: patches off / all on / each patch alone.

One PPO value worker (a tiny Qwen2, dp=1 x tp=2 + SP on 2 CPU gloo ranks; nccl on GPUs when
``--device cuda`` and two GPUs are present) runs full training steps: forward, backward,
AdamW, gradient clipping. The patch configuration is switched between blocks of steps in one
run, interleaved round-robin (``--rounds`` rounds, each visiting every configuration in a new
random order), with one untimed step after each switch (the decisions are propagated and
cached again). The figure per configuration is the median over rounds of its block time
divided by the stock block of the same round, so machine load drifting during the run cancels.

    python benchmarks/step_overhead.py --json out/step_overhead.json

Prints one line per configuration: the median ratio and its spread (min-max over rounds).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _batch(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": mask.clone(),
        "old_values": torch.zeros(batch, seq),
        "returns": torch.rand(batch, seq, generator=g),
    }


def _configure(name: str) -> None:
    import dtensor_patches

    dtensor_patches.revert_all()
    if name == "all":
        dtensor_patches.apply_all()
    elif name != "stock":
        dtensor_patches.apply_all(only=[name])


def bench_rank(cfg_dict: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank; rank 0's timings are returned by all (same schedule everywhere)."""
    import torch.distributed as dist

    import dtensor_patches
    from ppo_value.config import ValueConfig
    from ppo_value.worker import ValueWorker

    torch.set_num_threads(args["threads"])
    worker = ValueWorker(ValueConfig.from_dict(cfg_dict))
    batch = _batch(args["batch"], args["seq"], cfg_dict["model_config"]["vocab_size"])
    applied = [o.name for o in dtensor_patches.apply_all() if o.status.name == "ALREADY_APPLIED"]
    configs = ["stock", "all", *(applied if args["per_patch"] else [])]
    rng = random.Random(0)  # the same order on every rank
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args["rounds"]):
        order = configs[:]
        rng.shuffle(order)
        for name in order:
            _configure(name)
            worker.train(batch)  # untimed: decisions propagated and cached again
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args["steps"]):
                worker.train(batch)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args["steps"])
    _configure("all")
    return {"configs": configs, "times": times}


def summarize(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Per configuration: median and range of its per-round ratio to the stock block."""
    stock = times["stock"]
    rows = []
    for name, values in times.items():
        ratios = [v / s for v, s in zip(values, stock, strict=True)]
        rows.append(
            {
                "config": name,
                "step_ms": 1e3 * statistics.median(values),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="timed steps per block")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--no-per-patch", dest="per_patch", action="store_false", help="only stock vs all"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from dtensor_patches.testing import RankPool
    from ppo_value.config import ValueConfig

    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("step_overhead: --device cuda needs 2 GPUs", file=sys.stderr)
        return 2
    cfg = ValueConfig(
        model_family="qwen2",
        model_config={
            "vocab_size": 256,
            "hidden_size": args.hidden,
            "intermediate_size": 2 * args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": max(args.seq, 64),
            "tie_word_embeddings": False,
        },
        dp=1,
        tp=2,
        micro_batch_size=args.batch,
        backend=backend,
    )
    run_args = {
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "steps": args.steps,
        "threads": args.threads,
        "per_patch": args.per_patch,
    }
    with RankPool(2, backend=backend, env={"OMP_NUM_THREADS": str(args.threads)}) as pool:
        result = pool.run(bench_rank, cfg.to_dict(), run_args)[0]
    rows = summarize(result["times"])
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {backend}")
    print(f"{'configuration':<24} {'step ms':>8} {'ratio':>7}  range")
    for row in sorted(
        rows, key=lambda r: (r["config"] != "stock", r["config"] != "all", -r["ratio"])
    ):
        print(
            f"{row['config']:<24} {row['step_ms']:>8.1f} {row['ratio']:>7.3f}  "
            f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"torch": torch.__version__, "backend": backend, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
