"""Module-level functions run on every rank of a :class:`dtensor_patches.testing.RankPool`.

Each builds a :class:`ppo_value.worker.ValueWorker` on the pool's gloo process group and
compares it with the same computation on a plain single-process model with identical weights
(built from the same seed). Return values are plain Python / CPU tensors (picklable).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ppo_value.config import ValueConfig
from ppo_value.model import build_value_model
from ppo_value.worker import ValueWorker
from tests.ppo_value.reference import reference_train_step, reference_values


def dp_slice(
    batch: dict[str, torch.Tensor], dp: int, tp: int, cp: int = 1
) -> dict[str, torch.Tensor]:
    """This rank's share of ``batch`` (rank r has dp index r // (cp * tp)); when dp does not
    divide the batch, the first ``B % dp`` dp ranks get one sequence more."""
    dp_idx = dist.get_rank() // (cp * tp)
    n = next(iter(batch.values())).shape[0]
    sizes = [n // dp + (1 if i < n % dp else 0) for i in range(dp)]
    start = sum(sizes[:dp_idx])
    return {k: v[start : start + sizes[dp_idx]] for k, v in batch.items()}


def values_vs_reference(cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]) -> float:
    """Max |worker values - single-process values| over valid tokens of the global batch."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    local = dp_slice(batch, cfg.dp, cfg.tp, cfg.cp)
    got = worker.get_values(local)
    ref_full = reference_values(build_value_model(cfg.replace(cp=1)), batch)
    ref = dp_slice({"v": ref_full}, cfg.dp, cfg.tp, cfg.cp)["v"]
    mask = local["attention_mask"].bool()
    return float((got - ref).abs()[mask].max())


def train_vs_reference(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], micro_batch_size: int
) -> dict[str, float]:
    """One worker ``train`` step vs one single-process step on the whole batch.

    Returns the max abs weight difference after the step, the max abs update size, and
    the metric differences (loss, grad norm, explained variance).
    """
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    before = worker.full_state_dict()
    metrics = worker.train(
        dp_slice(batch, cfg.dp, cfg.tp, cfg.cp), micro_batch_size=micro_batch_size
    )
    after = worker.full_state_dict()
    ref_model = build_value_model(cfg.replace(cp=1))
    ref_metrics = reference_train_step(ref_model, cfg, batch)
    ref_sd = ref_model.state_dict()
    weight_diff = max(float((after[k] - ref_sd[k]).abs().max()) for k in ref_sd)
    update = max(float((after[k] - before[k]).abs().max()) for k in ref_sd)
    return {
        "weight_diff": weight_diff,
        "update": update,
        "loss_diff": abs(metrics["critic/loss"] - ref_metrics["loss"]),
        "grad_norm_diff": abs(metrics["critic/grad_norm"] - ref_metrics["grad_norm"]),
        "ev_diff": abs(metrics["critic/explained_var"] - ref_metrics["explained_var"]),
        "clip_fraction_diff": abs(metrics["critic/clip_fraction"] - ref_metrics["clip_fraction"]),
        "stats_diff": max(
            abs(metrics[f"critic/{k}"] - ref_metrics[k])
            for k in ("values_mean", "values_min", "values_max", "returns_mean")
        ),
        "lr": metrics["critic/lr"],
        "param_mesh_ndims": sorted({p.device_mesh.ndim for p in worker.model.parameters()}),
        "loss": metrics["critic/loss"],
    }


def _full_optim_state(worker: ValueWorker) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    osd = get_optimizer_state_dict(
        worker.model, worker.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    flat: dict[str, torch.Tensor] = {}
    for fqn, st in osd["state"].items():
        for name, t in st.items():
            flat[f"{fqn}.{name}"] = torch.as_tensor(t).detach().cpu().clone()
    return flat


def train_and_save(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], path: str
) -> dict[str, Any]:
    """Train one step, save; return values on the whole batch, optimizer state, step, lr."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    worker.train(dp_slice(batch, cfg.dp, cfg.tp))
    worker.save_checkpoint(path)
    return {
        "values": worker.get_values(batch),
        "optim": _full_optim_state(worker),
        "weights": worker.full_state_dict(),
        "step": worker.step,
        "lr": worker.scheduler.get_last_lr()[0],
    }


def load_fresh(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], path: str
) -> dict[str, Any]:
    """Build a worker (possibly another seed / mesh), load ``path``; same outputs as above."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    before = worker.get_values(batch)
    worker.load_checkpoint(path)
    return {
        "values_before_load": before,
        "values": worker.get_values(batch),
        "optim": _full_optim_state(worker),
        "weights": worker.full_state_dict(),
        "step": worker.step,
        "lr": worker.scheduler.get_last_lr()[0],
    }


class _InjectedCrash(OSError):
    pass


def interrupted_save(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], path: str
) -> dict[str, Any]:
    """Save a good checkpoint, train on, then crash inside the next save after writing a
    partial shard; also simulate a crash between the commit renames. Load each time."""
    import os
    import types
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    import ppo_value.checkpoint as ck

    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    worker.train(local)
    worker.save_checkpoint(path)
    good = worker.get_values(batch)
    worker.train(local)
    worker.train(local)
    moved = worker.get_values(batch)

    def crashing_save(state: Any, checkpoint_id: str) -> None:
        os.makedirs(checkpoint_id, exist_ok=True)
        with open(os.path.join(checkpoint_id, f"__{dist.get_rank()}_0.distcp"), "wb") as f:
            f.write(b"partial")
        raise _InjectedCrash("injected crash during save")

    ck.dcp = types.SimpleNamespace(save=crashing_save, load=dcp.load)  # type: ignore[assignment]
    crashed = False
    try:
        worker.save_checkpoint(path)
    except ck.CheckpointError as exc:  # raised on every rank, naming the injected error
        crashed = "_InjectedCrash: injected crash during save" in str(exc)
    finally:
        ck.dcp = dcp
    dist.barrier()
    tmp_left = Path(path + ".tmp").exists()
    fresh = ValueWorker(cfg.replace(seed=cfg.seed + 99))
    meta = fresh.load_checkpoint(path)
    after_crash = fresh.get_values(batch)
    # crash between "path -> path.old" and "path.tmp -> path": only path.old is complete
    dist.barrier()
    if dist.get_rank() == 0:
        Path(path).rename(path + ".old")
    dist.barrier()
    fresh2 = ValueWorker(cfg.replace(seed=cfg.seed + 7))
    fresh2.load_checkpoint(path)
    after_rename_crash = fresh2.get_values(batch)
    # and the next save succeeds and cleans up
    fresh2.save_checkpoint(path)
    dist.barrier()
    return {
        "crashed": crashed,
        "tmp_left": tmp_left,
        "step": meta["step"],
        "moved": float((moved - good).abs().max()),
        "diff_after_crash": float((after_crash - good).abs().max()),
        "diff_after_rename_crash": float((after_rename_crash - good).abs().max()),
        "clean": sorted(p.name for p in Path(path).parent.iterdir()),
    }


def seeded_values(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], global_seed: int
) -> torch.Tensor:
    """Values on the whole batch after disturbing the global RNG like a new launch would."""
    torch.set_num_threads(1)
    torch.manual_seed(global_seed)
    worker = ValueWorker(ValueConfig.from_dict(cfg_dict))
    return worker.get_values(batch)


def export_and_reload(cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], path: str) -> float:
    """Train a step, export HF safetensors, reload with transformers on every rank and
    return the max difference to the worker's values on valid tokens."""
    from transformers import AutoModelForTokenClassification

    from tests.ppo_value.reference import shift

    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    worker.train(dp_slice(batch, cfg.dp, cfg.tp))
    worker.export_hf(path)
    got = worker.get_values(batch)
    hf = AutoModelForTokenClassification.from_pretrained(path).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref = shift(logits[..., 0])
    mask = batch["attention_mask"].bool()
    return float((got - ref).abs()[mask].max())


def nonfinite_step(cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Finite returns so large that the squared error and its gradient overflow float32:
    the step must be skipped, weights unchanged. (A NaN/inf return at a valid position is a
    ValueError before any work, see test_failures.py.)"""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    before = worker.full_state_dict()
    bad = dict(batch)
    bad["returns"] = batch["returns"].clone()
    bad["returns"][batch["loss_mask"].bool()] = 3e38
    metrics = worker.train(dp_slice(bad, cfg.dp, cfg.tp))
    after = worker.full_state_dict()
    ok_metrics = worker.train(dp_slice(batch, cfg.dp, cfg.tp))
    return {
        "skipped": metrics["critic/skipped_step"],
        "grad_norm": metrics["critic/grad_norm"],
        "changed": max(float((after[k] - before[k]).abs().max()) for k in before),
        "step_after_bad": metrics["critic/step"],
        "step_after_good": ok_metrics["critic/step"],
    }


def uneven_dp_batch(cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]) -> list[int]:
    """dp rank 0 gets one sequence more than the others; returns the values' shape."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    n = 3 if dist.get_rank() // cfg.tp == 0 else 2
    values = worker.get_values({k: v[:n] for k, v in batch.items()}, micro_batch_size=1)
    return list(values.shape)


def mixed_precision_run(cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """bf16 backbone / fp32 head: values near the fp32 reference, finite training."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    got = worker.get_values(batch)
    ref = reference_values(build_value_model(cfg), batch)
    mask = batch["attention_mask"].bool()
    metrics = worker.train(dp_slice(batch, cfg.dp, cfg.tp))
    head_dtypes = {str(p.dtype) for p in worker.model.score.parameters()}
    return {
        "diff": float((got - ref).abs()[mask].max()),
        "dtype": str(got.dtype),
        "loss": metrics["critic/loss"],
        "grad_norm": metrics["critic/grad_norm"],
        "head_dtypes": sorted(head_dtypes),
    }
