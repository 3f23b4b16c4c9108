"""``python -m ppo_value.demo``: train the critic on a verifiable arithmetic task.

A Ray group of ``dp * cp * tp`` CPU workers (default dp=2 x tp=2 with sequence parallelism;
``--cp 2`` splits each sequence over 2 context-parallel ranks as well) trains
the value model on rollouts of :class:`ppo_value.task.ArithmeticTask` (reward 1 only for a
correct sum) from a random answer generator. Each step: sample rollouts, ``get_values``
(old values), GAE returns, ``--ppo-epochs`` ``train`` steps on that batch (the value clip
is active from the second). On a terminal it logs ``critic/loss``, explained variance and
grad norm per step under a tqdm bar; otherwise (a log file, CI) one line per held-out
evaluation and no bar. It measures explained variance on a fixed held-out set of rollouts,
saves ``critic_curve.png``, ``metrics.json``, a checkpoint and an ``hf/`` export, reloads the
checkpoint into a fresh group started from another seed and checks that the values match.

Exit status 1 if the reloaded values differ (> 1e-5), if a metric gate fails
(:mod:`ppo_value.gates`: critic loss in [0, 6), explained variance <= 1.0001, grad norm < 350 at
every step, rising held-out explained variance; ``--no-gates`` skips them) or, with
``--require-ev-gain X``, if the held-out explained variance did not rise by at least ``X``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

# The demo needs the ``ppo`` extra; say so instead of failing on the first missing import.
_PPO_EXTRA = ("tokenizers", "transformers", "safetensors", "ray", "tqdm", "matplotlib")
_MISSING = [name for name in _PPO_EXTRA if importlib.util.find_spec(name) is None]
if _MISSING:
    _HINT = (
        f"python -m ppo_value.demo needs the 'ppo' extra (missing: {', '.join(_MISSING)}): "
        "pip install 'dtensor-patches[ppo]' (from a clone: pip install -e '.[ppo]')"
    )
    if __name__ == "__main__":
        raise SystemExit(_HINT)
    raise ModuleNotFoundError(_HINT, name=_MISSING[0])

import torch  # noqa: E402

from ppo_value.config import ValueConfig  # noqa: E402
from ppo_value.gae import compute_gae  # noqa: E402
from ppo_value.gates import check_metric_gates, format_gates  # noqa: E402
from ppo_value.metrics import explained_variance  # noqa: E402
from ppo_value.task import ArithmeticTask, Rollouts, build_tokenizer  # noqa: E402

log = logging.getLogger("ppo_value.demo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ppo_value.demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    p.add_argument("--batch-size", type=int, default=32, help="rollouts per step")
    p.add_argument("--micro-batch-size", type=int, default=8, help="per dp rank")
    p.add_argument("--heldout", type=int, default=256, help="held-out rollouts for EV")
    p.add_argument("--eval-every", type=int, default=10, help="held-out EV every N steps")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: each sequence split over cp ranks (default 1)",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--ppo-epochs", type=int, default=2, help="train steps per rollout batch (value clip)"
    )
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=Path("out/ppo_value_demo"))
    p.add_argument("--ray-address", default=None, help="existing Ray cluster (default: local)")
    p.add_argument(
        "--require-ev-gain",
        type=float,
        default=None,
        help="fail unless held-out EV rises by at least this much",
    )
    p.add_argument(
        "--no-gates",
        action="store_true",
        help="do not fail on the metric gates (loss, explained variance, grad norm, EV rise)",
    )
    return p.parse_args(argv)


def _model_config(vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
    }


def _batch(r: Rollouts) -> dict[str, torch.Tensor]:
    return {"input_ids": r.input_ids, "attention_mask": r.attention_mask}


def _heldout_ev(group: Any, heldout: Rollouts, returns: torch.Tensor) -> float:
    values = group.get_values(_batch(heldout))
    return explained_variance(values, returns, heldout.loss_mask)


def save_plot(
    history: list[dict[str, float]],
    evals: list[tuple[int, float]],
    path: Path,
    title: str = "PPO critic",
) -> None:
    """Write a 2x2 PNG of loss, explained variance (train and held-out), grad norm, clip
    fraction against the training step, under ``title`` (what ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    axes[0, 0].plot(steps, [h["critic/loss"] for h in history])
    axes[0, 0].set_title("critic/loss")
    axes[0, 0].set_ylabel("clipped value loss")
    axes[0, 1].plot(
        steps, [h["critic/explained_var"] for h in history], label="train batch", alpha=0.6
    )
    axes[0, 1].plot([s for s, _ in evals], [e for _, e in evals], "o-", label="held-out")
    axes[0, 1].set_title("explained variance")
    axes[0, 1].set_ylabel("1 - Var(R - V) / Var(R)")
    axes[0, 1].legend()
    axes[1, 0].plot(steps, [h["critic/grad_norm"] for h in history])
    axes[1, 0].set_title("critic/grad_norm")
    axes[1, 0].set_ylabel("L2 norm before clipping")
    axes[1, 1].plot(steps, [h["critic/clip_fraction"] for h in history])
    axes[1, 1].set_title("critic/clip_fraction")
    axes[1, 1].set_ylabel("fraction of tokens clipped")
    for ax in axes.flat:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _readable(path: Path) -> None:
    """Give an export the permissions of an ordinary file the user wrote (umask applied):
    the safetensors writer leaves 0600 files, which other users of the model cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from ppo_value.ray_group import ValueWorkerGroup

    args = parse_args(argv)
    # INFO for this project's loggers only: other libraries' INFO lines (matplotlib's font
    # cache) are nothing a user can act on.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("ppo_value").setLevel(logging.INFO)
    if args.ray_address is None:
        # The demo's own local cluster: say explicitly that it runs without token
        # authentication (Ray's default), which also stops Ray warning about it at start-up.
        # RAY_AUTH_MODE=token in the environment turns authentication on.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # A bar and per-step lines only on a terminal; in a log file, one line per evaluation.
    interactive = sys.stdout.isatty() and sys.stderr.isatty()
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    task = ArithmeticTask(build_tokenizer())
    config = ValueConfig(
        model_family="qwen2",
        model_config=_model_config(task.vocab_size),
        dp=args.dp,
        tp=args.tp,
        cp=args.cp,
        micro_batch_size=args.micro_batch_size,
        lr=args.lr,
        warmup_steps=5,
        max_grad_norm=1.0,
        value_clip=0.2,
        seed=args.seed,
    )
    gen = torch.Generator().manual_seed(args.seed)
    heldout = task.sample(args.heldout, torch.Generator().manual_seed(args.seed + 10_000))
    _, heldout_returns = compute_gae(
        heldout.rewards, torch.zeros_like(heldout.rewards), heldout.loss_mask, gamma=1.0, lam=1.0
    )
    group_kw: dict[str, Any] = {
        "address": args.ray_address,
        "num_cpus_per_worker": 0.5,
        "num_threads": 1,
        "worker_log_level": "WARNING",
    }
    group = ValueWorkerGroup(config, **group_kw)
    history: list[dict[str, float]] = []
    evals: list[tuple[int, float]] = [(0, _heldout_ev(group, heldout, heldout_returns))]
    log.info("held-out explained variance before training: %.3f", evals[0][1])
    with contextlib.ExitStack() as stack:
        steps: Any = range(1, args.steps + 1)
        bar: Any = None
        if interactive:
            stack.enter_context(logging_redirect_tqdm())
            bar = steps = stack.enter_context(tqdm(steps, desc="critic", unit="step"))
        for step in steps:
            roll = task.sample(args.batch_size, gen)
            group.prepare_for_inference()
            old_values = group.get_values(_batch(roll))
            group.finish_inference()
            _, returns = compute_gae(
                roll.rewards, old_values, roll.loss_mask, gamma=args.gamma, lam=args.lam
            )
            group.prepare_for_training()
            for _ in range(args.ppo_epochs):
                metrics = group.train(
                    {
                        **_batch(roll),
                        "loss_mask": roll.loss_mask,
                        "old_values": old_values,
                        "returns": returns,
                    }
                )
            group.finish_training()
            metrics["step"] = step
            history.append(metrics)
            line = (
                f"step {step} critic/loss {metrics['critic/loss']:.4f} "
                f"explained_var {metrics['critic/explained_var']:.3f} "
                f"grad_norm {metrics['critic/grad_norm']:.3f}"
            )
            if interactive:
                log.info("%s", line)
            if step % args.eval_every == 0 or step == args.steps:
                evals.append((step, _heldout_ev(group, heldout, heldout_returns)))
                log.info(
                    "%s held-out explained variance %.3f (%.0f s)",
                    line,
                    evals[-1][1],
                    time.perf_counter() - t0,
                )
            if bar is not None:
                bar.set_postfix(loss=f"{metrics['critic/loss']:.4f}", ev=f"{evals[-1][1]:.3f}")
    train_s = time.perf_counter() - t0
    title = (
        f"PPO critic: Qwen2 ({config.model_config['num_hidden_layers']} layers, hidden "
        f"{config.model_config['hidden_size']}), dp={args.dp} x cp={args.cp} x tp={args.tp} + SP, "
        f"{args.steps} steps, seed {args.seed}"
    )
    save_plot(history, evals, out / "critic_curve.png", title)
    ckpt = group.save_checkpoint(out / "checkpoint")
    _readable(group.export_hf(out / "hf"))
    values = group.get_values(_batch(heldout))
    group.shutdown()
    fresh = ValueWorkerGroup(config.replace(seed=args.seed + 1), **group_kw)
    before = fresh.get_values(_batch(heldout))
    fresh.load_checkpoint(ckpt)
    after = fresh.get_values(_batch(heldout))
    fresh.shutdown()
    mask = heldout.attention_mask.bool()
    reload_diff = float((after - values).abs()[mask].max())
    fresh_diff = float((before - values).abs()[mask].max())
    total_s = time.perf_counter() - t0
    summary = {
        "steps": args.steps,
        "heldout_explained_variance": evals,
        "reload_max_abs_diff": reload_diff,
        "fresh_group_max_abs_diff_before_load": fresh_diff,
        "train_seconds": train_s,
        "total_seconds": total_s,
        "checkpoint": str(ckpt),
        "config": config.to_dict(),
    }
    gates = check_metric_gates(history, evals)
    summary["gates"] = [g.as_dict() for g in gates]
    (out / "metrics.json").write_text(
        json.dumps({"summary": summary, "history": history}, indent=1)
    )
    curve = ", ".join(f"{s}:{e:.3f}" for s, e in evals)
    print(f"held-out explained variance by step: {curve}")
    print(
        f"reload check: max |values after reload - values saved| = {reload_diff:.2e} "
        f"(fresh group before load differed by {fresh_diff:.2e})"
    )
    print(f"plot: {out / 'critic_curve.png'}; checkpoint: {ckpt}; {total_s:.0f} s total")
    status = 0
    if not reload_diff <= 1e-5:
        log.error("reloaded values differ from the saved ones by %.3g", reload_diff)
        status = 1
    gain = evals[-1][1] - evals[0][1]
    if args.require_ev_gain is not None and not (
        math.isfinite(gain) and gain >= args.require_ev_gain
    ):
        log.error("held-out EV gain %.3f < required %.3f", gain, args.require_ev_gain)
        status = 1
    print("metric gates:\n" + format_gates(gates))
    failed = [g for g in gates if not g.passed]
    for g in failed:
        log.error(
            "metric gate FAILED: %s = %.4g at step %s, required %s",
            g.name,
            g.worst,
            g.step,
            g.bound,
        )
    if failed and not args.no_gates:
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
