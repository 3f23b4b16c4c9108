"""Throughput and peak memory of the PPO value worker on a long-tailed rollout length mix.

One global batch whose sequence lengths follow a long-tailed mix like real rollouts (``16 +
(max - 16) * u**3``, ``u`` uniform: most sequences short, a few near ``--seq``; right-padded to
``--seq``), run through four batching modes:

- ``padded``: ``micro_batch_size`` sequences per forward, padded to the longest;
- ``packed``: the same micro-batches, sequences packed into rows (:mod:`ppo_value.packing`);
- ``packed+budget``: packed, grouped into micro-batches of at most ``--max-tokens`` tokens
  (default ``micro_batch_size * seq``, the most a padded micro-batch holds: the same memory
  bound, filled with real tokens, so fewer forward/backward passes);
- ``packed+budget+ac``: the same with activation checkpointing per decoder layer;

at two layouts of equal world size: ``dp4`` (FSDP2 over 4 ranks) and ``dp2xtp2`` (dp=2 x
tp=2 with sequence parallelism).

Throughput counts *valid* tokens (``attention_mask == 1``) of the global batch per second of a
``train`` step and of ``get_values``, timed on rank 0. In each layout one process group builds
one worker per mode and times them interleaved (mode A, B, C, D, A, B, ...) for ``--repeats``
rounds after ``--warmup`` untimed ones; the table gives medians, and ratios to ``padded`` from
the same rounds. The padded mode already cuts trailing columns that no sequence of a
micro-batch uses, so it pads each micro-batch to its own longest sequence, not to ``--seq``.

Peak memory per rank: on GPU ``torch.cuda.max_memory_allocated`` over the timed steps of the
mode (reset before it). On CPU the allocator keeps freed memory, so a process measures one mode
only: each (layout, mode) gets a fresh process group that builds the worker, runs one ``train``
step and reports ``ru_maxrss`` (peak RSS, MiB) and its growth over the RSS just before the step
(activations, gradients, optimiser state).

Runs on CPU with gloo, or with nccl when CUDA is available (a layout needing more GPUs than
present is skipped).

    python benchmarks/ppo_throughput.py --output out/ppo_throughput.json
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ppo_throughput")

LAYOUTS: list[tuple[str, int, int]] = [("dp4", 4, 1), ("dp2xtp2", 2, 2), ("single", 1, 1)]
DEFAULT_LAYOUTS = "dp4,dp2xtp2"  # equal world size; ``--layouts single`` for one GPU
MODES: list[str] = ["padded", "packed", "packed+budget", "packed+budget+ac"]


def long_tailed_batch(batch: int, seq: int, vocab: int, *, seed: int = 0) -> dict[str, Any]:
    """A right-padded ``[batch, seq]`` batch with lengths ``16 + (seq - 16) * u**3``."""
    g = torch.Generator().manual_seed(seed)
    lo = min(16, seq)
    lengths = (lo + (seq - lo) * torch.rand(batch, generator=g) ** 3).round().long()
    lengths[0] = seq  # the long tail is always there
    lengths = lengths[torch.randperm(batch, generator=g)]
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    loss_mask = mask.clone()
    loss_mask[:, :8] = 0  # a short prompt
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": loss_mask,
        "old_values": torch.zeros(batch, seq),
        "returns": torch.rand(batch, seq, generator=g) * mask,
    }


def mode_config(base: dict[str, Any], mode: str, max_tokens: int) -> dict[str, Any]:
    """``base`` (a ``ValueConfig`` dict) with the batching options of ``mode``."""
    cfg = dict(base)
    cfg["sequence_packing"] = mode != "padded"
    cfg["max_tokens_per_micro_batch"] = max_tokens if "budget" in mode else None
    cfg["activation_checkpointing"] = mode.endswith("+ac")
    return cfg


def _local_shard(full: dict[str, Any], dp: int, tp: int) -> dict[str, Any]:
    import torch.distributed as dist

    per = next(iter(full.values())).shape[0] // dp
    d = dist.get_rank() // tp
    return {k: v[d * per : (d + 1) * per] for k, v in full.items()}


def _rss_mib(key: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]


def bench_rank(cfgs: dict[str, dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    """Every rank: one worker per mode, timed interleaved; medians and per-round times."""
    import torch.distributed as dist

    from ppo_value.config import ValueConfig
    from ppo_value.worker import ValueWorker

    torch.set_num_threads(args["threads"])
    workers = {m: ValueWorker(ValueConfig.from_dict(c)) for m, c in cfgs.items()}
    first = next(iter(workers.values()))
    cuda = first.device.type == "cuda"
    cfg0 = first.config
    local = _local_shard(args["batch"], cfg0.dp, cfg0.tp)

    def timed(fn: Any) -> float:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    times: dict[str, dict[str, list[float]]] = {m: {"train": [], "values": []} for m in workers}
    peak: dict[str, float] = {m: 0.0 for m in workers}
    for rnd in range(args["warmup"] + args["repeats"]):
        for mode, w in workers.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t_train = timed(lambda w=w: w.train(local))
            t_values = timed(lambda w=w: w.get_values(local))
            if cuda:
                peak[mode] = max(peak[mode], torch.cuda.max_memory_allocated() / 2**20)
            if rnd >= args["warmup"]:
                times[mode]["train"].append(t_train)
                times[mode]["values"].append(t_values)
    return {"times": times, "gpu_peak_mib": peak if cuda else None}


def memory_rank(cfg: dict[str, Any], args: dict[str, Any]) -> dict[str, float]:
    """Every rank of a fresh process group: one worker, one ``train`` step; peak RSS."""
    from ppo_value.config import ValueConfig
    from ppo_value.worker import ValueWorker

    torch.set_num_threads(args["threads"])
    worker = ValueWorker(ValueConfig.from_dict(cfg))
    local = _local_shard(args["batch"], worker.config.dp, worker.config.tp)
    before = _rss_mib("VmRSS")
    worker.train(local)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mib": peak, "step_growth_mib": peak - before}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see ``--help``)."""
    p = argparse.ArgumentParser(description="PPO value worker: padded vs packed, by layout")
    p.add_argument("--family", default="qwen2", choices=["qwen2", "llama"])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=512, help="longest sequence (padded length)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="token budget per micro-batch (default micro-batch-size x seq: the padded worst case)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed interleaved rounds")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (flash_attention_2 on GPU)")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="of dp4, dp2xtp2, single")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--no-memory", action="store_true", help="skip the CPU memory processes")
    p.add_argument("--output", type=Path, default=Path("out/ppo_throughput.json"))
    return p.parse_args(argv)


def _table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'layout':<8} {'mode':<17} {'train valid tok/s':>17} {'x padded':>8} "
        f"{'get_values valid tok/s':>22} {'x padded':>8}  peak MiB per rank (step growth)"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if "skipped" in r:
            lines.append(f"{r['layout']:<8} skipped: {r['skipped']}")
            continue
        mem = r.get("memory")
        if not mem:
            mem_s = "-"
        elif mem["growth"] is None:  # GPU: allocated peak of rank 0
            mem_s = f"{mem['peak'][0]:.0f} (allocated, rank 0)"
        else:
            pairs = zip(mem["peak"], mem["growth"], strict=True)
            mem_s = ", ".join(f"{p:.0f} ({g:+.0f})" for p, g in pairs)
        lines.append(
            f"{r['layout']:<8} {r['mode']:<17} {r['train_tokens_per_s']:>17,.0f} "
            f"{r['train_speedup']:>7.2f}x {r['values_tokens_per_s']:>22,.0f} "
            f"{r['values_speedup']:>7.2f}x  {mem_s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every layout and mode, print a table, write JSON. Returns the exit status."""
    from dtensor_patches.testing import RankPool
    from ppo_value.config import ValueConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = args.micro_batch_size * args.seq
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
    batch = long_tailed_batch(args.batch, args.seq, args.vocab)
    valid = int(batch["attention_mask"].sum())
    padded_tokens = args.batch * args.seq
    run_args = {
        "batch": batch,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "threads": args.threads,
    }
    modes = [m for m in MODES if m in set(args.modes.split(","))]
    env = {"OMP_NUM_THREADS": str(args.threads)}
    results: list[dict[str, Any]] = []
    for name, dp, tp in LAYOUTS:
        if name not in set(args.layouts.split(",")):
            continue
        world = dp * tp
        if cuda and world > n_gpus:
            results.append({"layout": name, "skipped": f"needs {world} GPUs, {n_gpus} present"})
            log.warning("%s skipped: %s", name, results[-1]["skipped"])
            continue
        base = ValueConfig(
            model_family=args.family,
            model_config=model_config,
            dp=dp,
            tp=tp,
            micro_batch_size=args.micro_batch_size,
            backend=backend,
            attn_implementation=args.attn,
            optimizer="sgd",
            lr=1e-6,
        ).to_dict()
        cfgs = {m: mode_config(base, m, args.max_tokens) for m in modes}
        log.info("timing %s (dp=%d, tp=%d, %s): %s", name, dp, tp, backend, ", ".join(modes))
        with RankPool(world_size=world, backend=backend, env=env, timeout=3600) as pool:
            timing = pool.run(bench_rank, cfgs, run_args)[0]
        memory: dict[str, dict[str, list[float]]] = {}
        if not cuda and not args.no_memory:
            for m in modes:
                log.info("memory %s %s", name, m)
                with RankPool(world_size=world, backend=backend, env=env, timeout=3600) as pool:
                    per_rank = pool.run(memory_rank, cfgs[m], run_args)
                memory[m] = {
                    "peak": [r["peak_mib"] for r in per_rank],
                    "growth": [r["step_growth_mib"] for r in per_rank],
                }
        padded_times = timing["times"].get("padded")
        for m in modes:
            t = timing["times"][m]
            row: dict[str, Any] = {
                "layout": name,
                "mode": m,
                "dp": dp,
                "tp": tp,
                "train_s_median": statistics.median(t["train"]),
                "values_s_median": statistics.median(t["values"]),
                "train_s": t["train"],
                "values_s": t["values"],
            }
            row["train_tokens_per_s"] = valid / row["train_s_median"]
            row["values_tokens_per_s"] = valid / row["values_s_median"]
            for key, kind in (("train_speedup", "train"), ("values_speedup", "values")):
                if padded_times is None:
                    row[key] = float("nan")
                else:  # ratio per interleaved round, then the median
                    row[key] = statistics.median(
                        p / x for p, x in zip(padded_times[kind], t[kind], strict=True)
                    )
            if timing["gpu_peak_mib"] is not None:
                row["memory"] = {"peak": [timing["gpu_peak_mib"][m]], "growth": None}
            elif m in memory:
                row["memory"] = memory[m]
            results.append(row)
    table = _table(results)
    print(
        f"{args.batch} sequences, lengths 16..{args.seq} (long-tailed), {valid} valid of "
        f"{padded_tokens} padded tokens ({valid / padded_tokens:.0%}); {backend}, "
        f"{args.threads} thread(s) per rank, medians of {args.repeats} interleaved rounds"
    )
    print(table)
    report = {
        "torch": torch.__version__,
        "backend": backend,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model_config": model_config,
        "valid_tokens": valid,
        "padded_tokens": padded_tokens,
        "lengths": batch["attention_mask"].sum(1).tolist(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
