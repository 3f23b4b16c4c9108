"""What ``apply_all()`` costs on a training step: stock, every patch, each patch alone, each
patch left out, on several steps, in CPU time and wall time.

Steps (``--steps-kind``, repeatable; 2 CPU gloo ranks):

- ``critic``: the PPO value worker's ``train`` (tiny Qwen2, dp=1 x tp=2 + SP): forward,
  backward, AdamW, gradient clipping;
- ``critic_packed``: the same with sequence packing;
- ``critic_fsdp2``: the worker on dp=2 x tp=1 (FSDP2 only);
- ``qwen2_tp_sp``: the Qwen2 TP + SP example's model (``examples/qwen2_tp_sp_logits.py``)
  trained on a squared-logits loss with AdamW and ``clip_grad_norm_``.

The configurations are switched between blocks of steps in one run: each round visits every
configuration once in a new random order (the same on every rank), with one untimed step
after each switch (the sharding decisions are propagated and cached again). Each block records
rank 0's wall time and its process CPU time (which time the scheduler gives to other jobs does
not inflate) per step. The figure per configuration is the median over rounds of its block
divided by the stock block of the same round (where stock torch refuses a step, stock plus only
the patches it needs, :data:`NEEDED`, named in the output), with a bootstrap 95% interval of that median
(2000 resamples of the rounds), so load drifting during the run cancels.

    python benchmarks/step_overhead.py --rounds 21 --json docs/benchmarks/step_overhead-2.13.0.json
    python benchmarks/step_overhead.py --steps-kind critic --per-patch --rounds 11

``stock_again`` is stock measured once more as if it were a configuration: its ratio is the
noise floor of the run (an A/A control), against which the others are read. ``--per-patch``
measures alone and left out only the patches whose code runs in a warm step (counted with
``cProfile`` and printed for every step as calls per step; ``(dispatch)`` is the path all
patches share) or that decides how an op of the step runs (its code runs in the first step
after ``apply_all()``, when every decision is propagated): any other patch is never consulted
by the step.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STEP_KINDS = ("critic", "critic_packed", "critic_fsdp2", "qwen2_tp_sp")

# Where stock torch cannot run a step, its baseline is stock plus only the patches it needs:
# the Qwen2 example's full-sequence slice is ``aten.alias`` on 2.9 (pytorch/pytorch#170427).
NEEDED = {"qwen2_tp_sp": ["alias"]}


def _batch(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    # Ragged lengths (right padding), so that packing has something to pack.
    for row in range(1, batch):
        mask[row, seq - 1 - (row * 7) % (seq // 2) :] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "loss_mask": mask.clone(),
        "old_values": torch.zeros(batch, seq),
        "returns": torch.rand(batch, seq, generator=g),
    }


def _configure(name: str, baseline: list[str] | None = None) -> None:
    import dtensor_patches

    dtensor_patches.revert_all()
    if name in ("stock", "stock_again") and baseline:
        dtensor_patches.apply_all(only=baseline)
    elif name == "all":
        dtensor_patches.apply_all()
    elif name.startswith("alone:"):
        dtensor_patches.apply_all(only=[name.split(":", 1)[1]])
    elif name.startswith("without:"):
        dtensor_patches.apply_all(exclude=[name.split(":", 1)[1]])


def _critic_step(kind: str, args: dict[str, Any]) -> Callable[[], None]:
    from ppo_value.config import ValueConfig
    from ppo_value.worker import ValueWorker

    cfg = ValueConfig(
        model_family="qwen2",
        model_config={
            "vocab_size": 256,
            "hidden_size": args["hidden"],
            "intermediate_size": 2 * args["hidden"],
            "num_hidden_layers": args["layers"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": max(args["seq"], 64),
            "tie_word_embeddings": False,
        },
        dp=2 if kind == "critic_fsdp2" else 1,
        tp=1 if kind == "critic_fsdp2" else 2,
        micro_batch_size=args["batch"],
        sequence_packing=kind == "critic_packed",
    )
    worker = ValueWorker(cfg)
    batch = _batch(args["batch"], args["seq"], 256)
    if kind == "critic_fsdp2":
        import torch.distributed as dist

        # Each data-parallel rank trains on its own half of the batch.
        rank = dist.get_rank()
        batch = {k: v[rank::2] for k, v in batch.items()}
    return lambda: worker.train(batch)


def _qwen2_step(args: dict[str, Any]) -> Callable[[], None]:
    import sys as _sys

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import Qwen2ForCausalLM

    _sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from qwen2_tp_sp_logits import tiny_qwen2_config, tp_sp_plan

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config())
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(model, mesh, tp_sp_plan())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (args["batch"], args["seq"]), generator=g)

    def step() -> None:
        logits = model(input_ids=ids).logits
        loss = logits.float().pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return step


def bench_rank(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank; rank 0's timings are returned by all (same schedule everywhere)."""
    import torch.distributed as dist

    import dtensor_patches

    torch.set_num_threads(args["threads"])
    step = _qwen2_step(args) if kind == "qwen2_tp_sp" else _critic_step(kind, args)
    dtensor_patches.revert_all()
    baseline: list[str] | None = None
    try:
        step()
    except Exception:
        baseline = NEEDED.get(kind)
        if baseline is None:
            raise
    dtensor_patches.revert_all()
    applied = [o.name for o in dtensor_patches.apply_all() if o.status.name == "APPLIED"]
    # The first step after apply_all() propagates every decision: a patch whose code runs
    # then decides how some op of the step runs (a cached strategy: it costs no Python later,
    # but its layout may cost communication or kernels on every step).
    deciding = patch_calls_per_step(step, applied, steps=1)
    calls = patch_calls_per_step(step, applied)
    # "stock_again" is stock measured as if it were a configuration: its ratio to stock is
    # what this machine's noise alone gives, the control every other ratio is read against.
    configs = ["stock", "stock_again", "all"]
    if args["per_patch"]:
        # Only a patch whose code runs in a warm step can cost anything per step (a strategy
        # torch cached, or an op the step never calls, costs nothing): those are measured
        # alone and left out; the rest are reported with their count of zero.
        running = [n for n in applied if calls.get(n, 0) or deciding.get(n, 0)]
        configs += [f"alone:{n}" for n in running] + [f"without:{n}" for n in running]
    rng = random.Random(0)  # the same order on every rank
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for _ in range(args["rounds"]):
        order = configs[:]
        rng.shuffle(order)
        for name in order:
            _configure(name, baseline)
            step()  # untimed: decisions propagated and cached again
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args["steps"]):
                step()
            dist.barrier()
            times[name].append(
                (
                    (time.perf_counter() - wall) / args["steps"],
                    (time.process_time() - cpu) / args["steps"],
                )
            )
    _configure("all")
    return {
        "configs": configs,
        "times": times,
        "baseline": baseline or [],
        "calls": calls,
        "deciding": sorted(n for n in deciding if n != "(dispatch)"),
    }


def patch_calls_per_step(
    step: Callable[[], None], applied: list[str], steps: int = 2
) -> dict[str, float]:
    """Calls per step (over ``steps`` steps) into each applied patch's own code (its module and the private
    helper modules it imports), counted with ``cProfile``; patches with no call are left out.
    The dispatch path every patch shares (the hook, the miss rules) is counted as
    ``"(dispatch)"``."""
    import cProfile
    import importlib
    import pstats

    import dtensor_patches

    owners: dict[str, set[str]] = {}
    for name in applied:
        module = importlib.import_module(dtensor_patches.get(name).registrations.__module__)
        files = {module.__file__}
        for value in vars(module).values():
            helper = getattr(value, "__module__", None) or getattr(value, "__name__", "")
            if isinstance(helper, str) and helper.rpartition(".")[2].startswith("_"):
                helper_module = sys.modules.get(helper)
                if helper_module is not None and "dtensor_patches.patches" in helper:
                    files.add(helper_module.__file__)
        for file in files:
            owners.setdefault(str(file), set()).add(name)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    counts: dict[str, float] = {}
    for (file, _, _), row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        names = owners.get(file)
        if names is None and (
            "dtensor_patches/dispatch/" in file or "dtensor_patches/_torch/dispatch_hook" in file
        ):
            names = {"(dispatch)"}
        for name in names or ():
            counts[name] = counts.get(name, 0.0) + row[1] / steps
    return counts


def _interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median of ``ratios`` (seeded)."""
    rng = random.Random(1)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def summarize(times: dict[str, list[tuple[float, float]]]) -> list[dict[str, Any]]:
    """Per configuration: the median per-round ratio to the stock block, CPU and wall, with
    bootstrap intervals, and the median step time."""
    stock = times["stock"]
    rows = []
    for name, values in times.items():
        row: dict[str, Any] = {"config": name}
        for i, clock in enumerate(("wall", "cpu")):
            ratios = [v[i] / s[i] for v, s in zip(values, stock, strict=True)]
            low, high = _interval(ratios)
            row[f"{clock}_ms"] = 1e3 * statistics.median(v[i] for v in values)
            row[f"{clock}_ratio"] = statistics.median(ratios)
            row[f"{clock}_interval"] = [low, high]
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps-kind", action="append", choices=STEP_KINDS, default=None)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--steps", type=int, default=3, help="timed steps per block")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--per-patch", action="store_true", help="each patch alone and left out")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from dtensor_patches.testing import RankPool

    args = parse_args(argv)
    kinds = args.steps_kind or list(STEP_KINDS)
    run_args = {
        k: getattr(args, k)
        for k in ("batch", "seq", "hidden", "layers", "rounds", "steps", "threads", "per_patch")
    }
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "kinds": {},
    }
    print(f"torch {torch.__version__}, {out['machine']}, gloo, {args.rounds} rounds")
    with RankPool(2, env={"OMP_NUM_THREADS": str(args.threads)}) as pool:
        for kind in kinds:
            result = pool.run(bench_rank, kind, run_args)[0]
            rows = summarize(result["times"])
            out["kinds"][kind] = rows
            out.setdefault("calls_per_step", {})[kind] = result["calls"]
            if result["baseline"]:
                out.setdefault("baselines", {})[kind] = result["baseline"]
                print(
                    f"\n{kind}: stock torch refuses this step; 'stock' is stock + {result['baseline']}"
                )
            print(
                f"\n{kind}: {'configuration':<32} {'cpu ms':>7} {'cpu ratio':>9}  interval        {'wall ratio':>10}  interval"
            )
            for row in sorted(
                rows, key=lambda r: (r["config"] != "stock", r["config"] != "all", -r["cpu_ratio"])
            ):
                print(
                    f"{'':>{len(kind) + 2}}{row['config']:<32} {row['cpu_ms']:>7.1f} {row['cpu_ratio']:>9.3f}  "
                    f"{row['cpu_interval'][0]:.3f}-{row['cpu_interval'][1]:.3f}  {row['wall_ratio']:>10.3f}  "
                    f"{row['wall_interval'][0]:.3f}-{row['wall_interval'][1]:.3f}"
                )
            running = ", ".join(f"{n} {c:.0f}" for n, c in sorted(result["calls"].items()))
            print(f"{'':>{len(kind) + 2}}calls per warm step into the package: {running or 'none'}")
            print(
                f"{'':>{len(kind) + 2}}patches consulted while the step is decided: "
                f"{', '.join(result['deciding']) or 'none'}"
            )
            out.setdefault("deciding", {})[kind] = result["deciding"]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
