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


def dp_slice(batch: dict[str, torch.Tensor], dp: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's share of ``batch`` (rank r has dp index r // tp)."""
    rank = dist.get_rank()
    dp_idx = rank // tp
    n = next(iter(batch.values())).shape[0]
    per = n // dp
    return {k: v[dp_idx * per : (dp_idx + 1) * per] for k, v in batch.items()}


def values_vs_reference(cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]) -> float:
    """Max |worker values - single-process values| over valid tokens of the global batch."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    got = worker.get_values(local)
    ref_full = reference_values(build_value_model(cfg), batch)
    ref = dp_slice({"v": ref_full}, cfg.dp, cfg.tp)["v"]
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
    metrics = worker.train(dp_slice(batch, cfg.dp, cfg.tp), micro_batch_size=micro_batch_size)
    after = worker.full_state_dict()
    ref_model = build_value_model(cfg)
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
        "loss": metrics["critic/loss"],
    }
