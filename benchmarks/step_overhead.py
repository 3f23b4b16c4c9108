"""What ``apply_all()`` costs on a training step: stock, every patch, each patch alone, each
patch left out, on several steps, in CPU time and wall time.

Steps (``--steps-kind``, repeatable; 2 CPU gloo ranks):

- ``critic``: the PPO value worker's ``train`` (tiny Qwen2, dp=1 x tp=2 + SP): forward,
  backward, AdamW, gradient clipping;
- ``critic_packed``: the same with sequence packing;
- ``critic_fsdp2``: the worker on dp=2 x tp=1 (FSDP2 only);
- ``qwen2_tp_sp``: the Qwen2 TP + SP example's model (``examples/qwen2_tp_sp_logits.py``)
  trained on a squared-logits loss with AdamW and ``clip_grad_norm_``.

Each configuration runs in its own pool of ranks, kept warm (``stock``, ``stock_again``,
``all``: three pools), and the pools take turns: each round, one block of ``--steps`` steps
per configuration in a new random order, so the steps compared lie a step apart in time and
nothing is switched or re-propagated between them; which pool runs which configuration
rotates so that each runs in every process equally long (:func:`measure`). Each configuration
has its own model in every pool, built with that configuration applied (a parallel style binds
its boundary functions when it parallelizes a module, so a model built under ``apply_all()``
keeps them after ``revert_all()``: a "stock" step on such a model is not stock), and each pool
builds them in another order, so that each configuration runs equally long on models built
first, second, ... in their process (:func:`prepare_rank`). Every step is timed
alone on rank 0 in three clocks: wall time, the process's CPU time, and the main thread's CPU
time (where every call of this package runs; neither CPU clock counts time the scheduler gives
to other jobs). Per configuration and clock, two ratios to stock, each with a bootstrap 95%
interval over rounds (2000 / 500 resamples): the median over rounds of the per-round ratio
(``median``), and the ratio of the 20% quantiles of all step times (``q20``: interference on a
shared machine only adds time, so a low quantile measures the step's own cost; see
:func:`summarize`). Where stock torch refuses a step, its baseline is stock plus only the
patches it needs (:data:`NEEDED`, named in the output).

    python benchmarks/step_overhead.py --json docs/benchmarks/step_overhead-2.13.0.json
    python benchmarks/step_overhead.py --steps-kind critic --per-patch --rounds 31 --steps 3
    python benchmarks/step_overhead.py --steps-kind critic_packed --config without:from_local_uneven

``--config without:<patch>`` (or ``alone:<patch>``) adds a configuration in a pool of its own
beside the three, measured the same way: how to ask what one patch costs a step.

``stock_again`` is stock measured once more as if it were a configuration: its ratio is the
noise floor of the run (an A/A control), against which the others are read. ``--per-patch``
measures alone and left out only the patches whose code runs in a warm step (counted with
``cProfile`` and printed for every step as calls per step; ``(dispatch)`` is the path all
patches share) or that decides how an op of the step runs (its code runs in the first step
after ``apply_all()``, when every decision is propagated): any other patch is never consulted
by the step; it runs every configuration in one pool, switched before each block
(``revert_all()``/``apply_all()`` and an untimed step), which is noisier.
"""

from __future__ import annotations

import argparse
import gc
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


def _configure(
    name: str, baseline: list[str] | None = None, apply_all: Callable[..., Any] | None = None
) -> Any:
    """Revert everything, then apply what configuration ``name`` has (with ``apply_all``,
    default ``dtensor_patches.apply_all``); returns the report."""
    import dtensor_patches

    apply_all = apply_all or dtensor_patches.apply_all
    dtensor_patches.revert_all()
    if name in ("stock", "stock_again"):
        return apply_all(only=baseline or [])
    if name.startswith("alone:"):
        return apply_all(only=[name.split(":", 1)[1]])
    if name.startswith("without:"):
        return apply_all(exclude=[name.split(":", 1)[1]])
    return apply_all()


def _build(kind: str, args: dict[str, Any], config: str, baseline: list[str] | None) -> Any:
    """The step, built with ``config`` in effect: a parallel style binds its input and output
    functions when it parallelizes a module, so a model built under one configuration keeps
    that configuration's boundaries. The value worker calls ``apply_all()`` itself while it
    builds; here that call applies ``config`` instead."""
    import dtensor_patches

    apply_all = dtensor_patches.apply_all
    dtensor_patches.apply_all = lambda *a, **k: _configure(config, baseline, apply_all)  # type: ignore[assignment]
    try:
        _configure(config, baseline)
        return _qwen2_step(args) if kind == "qwen2_tp_sp" else _critic_step(kind, args)
    finally:
        dtensor_patches.apply_all = apply_all  # type: ignore[assignment]


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


# What a rank keeps between calls of the driver: its step and the baseline stock needs.
_RANK: dict[str, Any] = {}


def prepare_rank(
    kind: str,
    args: dict[str, Any],
    count: bool,
    configs: list[str] | None = None,
    position: int = 0,
) -> dict[str, Any]:
    """Runs on every rank of a pool: finds whether stock torch refuses the step (then its
    baseline is :data:`NEEDED`), builds a step for each of ``configs`` (``None``: for ``all``
    only, the others when first configured, :func:`configure_rank`), and with ``count`` counts
    the calls per step into each patch with every patch applied.

    The models are built in the order of ``configs`` rotated by ``position`` (the pool's
    index): in one process, a model built later can run a step 1-2% faster or slower than the
    first (where its memory landed; measured on this machine), so each configuration must run
    on models built at every position equally often. With the rotation of :func:`measure`,
    period ``p`` runs every configuration on the model its pool built ``p``-th."""
    import dtensor_patches

    torch.set_num_threads(args["threads"])
    baseline: list[str] | None = None
    try:
        _build(kind, args, "stock", None)()
    except Exception:
        baseline = NEEDED.get(kind)
        if baseline is None:
            raise
    gc.collect()  # the probe's model is gone before the measured ones are built
    _RANK.update(kind=kind, args=args, baseline=baseline, steps={})
    order = ["all"]
    if configs:
        shift = position % len(configs)
        order = configs[shift:] + configs[:shift]
    for config in order:
        _RANK["steps"][config] = _build(kind, args, config, baseline)
    step = _RANK["steps"]["all"]
    applied = [o.name for o in _configure("all") if o.status.name == "APPLIED"]
    deciding: dict[str, float] = {}
    calls: dict[str, float] = {}
    if count:
        # The first step after apply_all() propagates every decision: a patch whose code
        # runs then decides how some op of the step runs (a cached strategy: no Python later,
        # but its layout may cost communication or kernels on every step).
        deciding = patch_calls_per_step(step, applied, steps=1)
        calls = patch_calls_per_step(step, applied)
    dtensor_patches.revert_all()
    return {
        "applied": applied,
        "baseline": baseline or [],
        "calls": calls,
        "deciding": sorted(n for n in deciding if n != "(dispatch)"),
        "running": [n for n in applied if calls.get(n, 0) or deciding.get(n, 0)],
    }


def configure_rank(config: str) -> None:
    """Runs on every rank: switches this pool to ``config`` and to the step built under it
    (built now the first time), then one untimed step (the sharding decisions are propagated
    and cached again) and a full collection (one that would fall in a timed step by chance is
    paid here by every configuration)."""
    steps = _RANK["steps"]
    if config not in steps:
        steps[config] = _build(_RANK["kind"], _RANK["args"], config, _RANK["baseline"])
    _configure(config, _RANK["baseline"])
    _RANK["step"] = steps[config]
    _RANK["step"]()
    gc.collect()


def timed_rank(steps: int) -> list[tuple[float, float, float]]:
    """Runs on every rank: ``steps`` steps, each timed alone as (wall, process CPU, main-thread
    CPU) seconds."""
    import torch.distributed as dist

    step = _RANK["step"]
    dist.barrier()
    block = []
    for _ in range(steps):
        wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
        step()
        block.append(
            (time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - thread)
        )
    dist.barrier()
    return block


def measure(
    pools: list[Any], configs: list[str], rounds: int, steps: int, seed: int = 0
) -> dict[str, list[list[tuple[float, float, float]]]]:
    """Rank 0's step times per configuration and round.

    With one pool per configuration (the default design), every pool keeps its configuration
    warm and the pools take turns, one block each per round in a random order, so the
    configurations' steps lie a step apart in time and nothing is re-propagated between them.
    A process may be faster than another by itself (where its memory landed), so the
    assignment rotates: the rounds are split into as many periods as there are
    configurations and in each period every pool runs another one (a Latin square), so each
    configuration runs in every process for the same number of rounds. With one pool, every
    block switches the pool's configuration (``revert_all()``/``apply_all()`` and an untimed
    step): the only way for many configurations (``--per-patch``), and noisier.
    """
    rng = random.Random(seed)
    times: dict[str, list[list[tuple[float, float, float]]]] = {name: [] for name in configs}
    if len(pools) == 1:
        for _ in range(rounds):
            order = configs[:]
            rng.shuffle(order)
            for name in order:
                pools[0].run(configure_rank, name)
                times[name].append(pools[0].run(timed_rank, steps)[0])
        return times
    n = len(configs)
    per_period = -(-rounds // n)
    for period in range(n):
        assigned = {i: configs[(i + period) % n] for i in range(n)}
        for i, pool in enumerate(pools):
            pool.run(configure_rank, assigned[i])
        for _ in range(per_period):
            order = list(range(n))
            rng.shuffle(order)
            for i in order:
                times[assigned[i]].append(pools[i].run(timed_rank, steps)[0])
    return times


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


CLOCKS = ("wall", "cpu", "thread")
QUANTILE = 0.2  # of the per-step times: the estimator interference cannot move


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _bootstrap(
    statistic: Callable[[list[int]], float], rounds: int, resamples: int = 2000
) -> tuple[float, float]:
    """Bootstrap 95% interval of ``statistic(round indices)``, resampling whole rounds
    (seeded)."""
    rng = random.Random(1)
    values = sorted(statistic(rng.choices(range(rounds), k=rounds)) for _ in range(resamples))
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def summarize(times: dict[str, list[list[tuple[float, float, float]]]]) -> list[dict[str, Any]]:
    """Per configuration and clock (``wall``; ``cpu``: the process; ``thread``: the main
    thread, where every call of this package runs), two ratios to stock, each with a bootstrap
    95% interval over rounds:

    - ``<clock>_ratio``: the median over rounds of the block's mean step time divided by the
      stock block's of the same round (drift between rounds cancels);
    - ``<clock>_q_ratio``: the :data:`QUANTILE` quantile of all the configuration's step times
      divided by stock's. Interference on a shared machine only ever adds time to a step
      (other jobs take the core, its caches, its sibling hyperthread), so a low quantile
      measures the step's own cost where the mean and median also measure the neighbours
      (J. Chen, J. Revels, "Robust benchmarking in noisy environments", arXiv:1608.04295).
    """
    stock = times["stock"]
    rounds = len(stock)
    rows = []
    for name, blocks in times.items():
        row: dict[str, Any] = {"config": name}
        for i, clock in enumerate(CLOCKS):
            means = [statistics.fmean(step[i] for step in block) for block in blocks]
            base = [statistics.fmean(step[i] for step in block) for block in stock]
            ratios = [m / b for m, b in zip(means, base, strict=True)]

            def median_ratio(picked: list[int], ratios: list[float] = ratios) -> float:
                return statistics.median(ratios[r] for r in picked)

            def q_ratio(picked: list[int], i: int = i, blocks: list = blocks) -> float:
                mine = [step[i] for r in picked for step in blocks[r]]
                theirs = [step[i] for r in picked for step in stock[r]]
                return _quantile(mine, QUANTILE) / _quantile(theirs, QUANTILE)

            everything = list(range(rounds))
            row[f"{clock}_ms"] = 1e3 * statistics.median(means)
            row[f"{clock}_ratio"] = median_ratio(everything)
            row[f"{clock}_interval"] = list(_bootstrap(median_ratio, rounds))
            row[f"{clock}_q_ms"] = 1e3 * _quantile([s[i] for b in blocks for s in b], QUANTILE)
            row[f"{clock}_q_ratio"] = q_ratio(everything)
            row[f"{clock}_q_interval"] = list(_bootstrap(q_ratio, rounds, resamples=500))
        rows.append(row)
    return rows


def _table(kind: str, rows: list[dict[str, Any]]) -> str:
    """Per configuration and clock: the median ratio and the low-quantile ratio, each with its
    interval."""
    head = f"{'configuration':<34}" + "".join(
        f"{clock + ' median':>22}{clock + f' q{int(100 * QUANTILE)}':>22}" for clock in CLOCKS
    )
    lines = [
        f"\n{kind} (stock: "
        + ", ".join(f"{clock} {rows[0][clock + '_ms']:.1f} ms" for clock in CLOCKS)
        + " per step)",
        head,
    ]
    ordered = sorted(
        rows, key=lambda r: (r["config"] != "stock", r["config"] != "all", -r["thread_q_ratio"])
    )
    for row in ordered:
        cells = "".join(
            f"{row[k + '_ratio']:>7.3f} ({row[k + '_interval'][0]:.3f}-{row[k + '_interval'][1]:.3f})"
            f"{row[k + '_q_ratio']:>7.3f} ({row[k + '_q_interval'][0]:.3f}-{row[k + '_q_interval'][1]:.3f})"
            for k in CLOCKS
        )
        lines.append(f"{row['config']:<34}{cells}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps-kind", action="append", choices=STEP_KINDS, default=None)
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--steps", type=int, default=1, help="timed steps per block")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--per-patch", action="store_true", help="each patch alone and left out")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="alone:NAME|without:NAME",
        help="one more configuration, in a pool of its own beside the three (repeatable)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from dtensor_patches.patches import BUILTIN_PATCHES
    from dtensor_patches.testing import RankPool

    args = parse_args(argv)
    names = {patch.name for patch in BUILTIN_PATCHES}
    for config in args.config:
        kind, _, name = config.partition(":")
        if kind not in ("alone", "without") or name not in names:
            raise SystemExit(f"--config {config!r}: expected alone:<patch> or without:<patch>")
    kinds = args.steps_kind or list(STEP_KINDS)
    run_args = {k: getattr(args, k) for k in ("batch", "seq", "hidden", "layers", "threads")}
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "design": "one pool, switched" if args.per_patch else "a pool per configuration",
        "quantile": QUANTILE,
        "kinds": {},
    }
    print(
        f"torch {torch.__version__}, {out['machine']}, gloo, {args.rounds} rounds, {out['design']}"
    )
    env = {"OMP_NUM_THREADS": str(args.threads)}
    # "stock_again" is stock measured as if it were a configuration: its ratio to stock is
    # what this machine's noise alone gives, the control every other ratio is read against.
    base_configs = ["stock", "stock_again", "all", *args.config]
    pools = [
        RankPool(2, env=env, wait=False) for _ in range(1 if args.per_patch else len(base_configs))
    ]
    try:
        for kind in kinds:
            built = None if args.per_patch else base_configs
            infos = [
                pool.run(prepare_rank, kind, run_args, i == 0, built, i)[0]
                for i, pool in enumerate(pools)
            ]
            result = infos[0]
            configs = base_configs[:]
            if args.per_patch:
                # Only a patch whose code runs in a warm step can cost anything per step (a
                # strategy torch cached, or an op the step never calls, costs nothing): those
                # are measured alone and left out; the rest are reported with their count.
                configs += [f"alone:{n}" for n in result["running"]]
                configs += [f"without:{n}" for n in result["running"]]
            times = measure(pools, configs, args.rounds, args.steps)
            rows = summarize(times)
            out["kinds"][kind] = rows
            # Every step's (wall, process CPU, main-thread CPU) seconds, to the microsecond.
            out.setdefault("raw_seconds_per_step", {})[kind] = {
                name: [[[round(t, 6) for t in step] for step in block] for block in blocks]
                for name, blocks in times.items()
            }
            out.setdefault("calls_per_step", {})[kind] = result["calls"]
            out.setdefault("deciding", {})[kind] = result["deciding"]
            if result["baseline"]:
                out.setdefault("baselines", {})[kind] = result["baseline"]
                print(
                    f"\n{kind}: stock torch refuses this step; 'stock' is stock + {result['baseline']}"
                )
            print(_table(kind, rows))
            running = ", ".join(f"{n} {c:.0f}" for n, c in sorted(result["calls"].items()))
            print(f"calls per warm step into the package: {running or 'none'}")
            print(
                f"patches consulted while the step is decided: {', '.join(result['deciding']) or 'none'}"
            )
    finally:
        for pool in pools:
            pool.close()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        raw = out.pop("raw_seconds_per_step", {})
        text = json.dumps(out, indent=1)
        # The raw times on one line per step kind: the summary above them stays readable.
        lines = ",\n".join(
            f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in raw.items()
        )
        args.json.write_text(text[:-2] + ',\n "raw_seconds_per_step": {\n' + lines + "\n }\n}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
