"""Rank functions for the scale tests (packing, token budgets, activation checkpointing, the
grad-norm collective), run on every rank of a :class:`dtensor_patches.testing.RankPool`.

Comparisons are against the plain single-process, unpacked model of
:mod:`tests.ppo_value.reference`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ppo_value.config import ValueConfig
from ppo_value.model import build_value_model
from ppo_value.worker import ValueWorker
from tests.ppo_value.reference import reference_train_step, reference_values


def _shard(
    batch: dict[str, torch.Tensor], sizes: list[int], dp_idx: int
) -> dict[str, torch.Tensor]:
    start = sum(sizes[:dp_idx])
    return {k: v[start : start + sizes[dp_idx]] for k, v in batch.items()}


def uneven_shards_vs_reference(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], sizes: list[int]
) -> dict[str, Any]:
    """dp rank ``d`` gets ``sizes[d]`` sequences. Values and one train step vs the reference
    on the whole batch; also the micro-batch plan of this rank (empty ones included)."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    dp_idx = dist.get_rank() // cfg.tp
    local = _shard(batch, sizes, dp_idx)
    plan = worker._micro_batches(local, cfg.micro_batch_size)
    values = worker.get_values(local)
    ref_model = build_value_model(cfg)
    ref_values = _shard({"v": reference_values(ref_model, batch)}, sizes, dp_idx)["v"]
    mask = local["attention_mask"].bool()
    before = worker.full_state_dict()
    metrics = worker.train(local)
    after = worker.full_state_dict()
    ref = reference_train_step(ref_model, cfg, batch)
    ref_sd = ref_model.state_dict()
    return {
        "plan": plan,
        "values_diff": float((values - ref_values).abs()[mask].max()),
        "weight_diff": max(float((after[k] - ref_sd[k]).abs().max()) for k in ref_sd),
        "update": max(float((after[k] - before[k]).abs().max()) for k in ref_sd),
        "loss_diff": abs(metrics["critic/loss"] - ref["loss"]),
        "grad_norm_diff": abs(metrics["critic/grad_norm"] - ref["grad_norm"]),
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def grad_norm_collectives(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Two train steps with DTensor's redistribution log captured at DEBUG and every
    ``all_reduce`` of the gradient-norm call counted; the norm vs the reference."""
    import ppo_value.grad_norm as gn
    from tests.ppo_value._ranks import dp_slice

    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    handler = _Records()
    logger = logging.getLogger("torch.distributed.tensor")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    calls: list[str] = []
    real_all_reduce = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append("all_reduce")
        return real_all_reduce(*args, **kwargs)

    real_clip = gn.clip_grad_norm_flat

    def wrapped_clip(*args: Any, **kwargs: Any) -> float:
        dist.all_reduce = counting  # type: ignore[assignment]
        try:
            return real_clip(*args, **kwargs)
        finally:
            dist.all_reduce = real_all_reduce  # type: ignore[assignment]

    import ppo_value.worker as wk

    wk.clip_grad_norm_flat = wrapped_clip  # type: ignore[assignment]
    try:
        metrics = worker.train(local)
        worker.train(local)
    finally:
        wk.clip_grad_norm_flat = real_clip  # type: ignore[assignment]
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    ref = reference_train_step(build_value_model(cfg), cfg, batch)
    return {
        "sequential": [m for m in handler.messages if "sequential" in m],
        "all_reduce_per_step": len(calls) / 2,
        "grad_norm_diff": abs(metrics["critic/grad_norm"] - ref["grad_norm"]),
    }


def too_long_on_one_rank(cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]) -> str:
    """Only dp rank 0 has a sequence over the budget: every rank must raise (no hang), and
    the weights stay as they were."""
    from tests.ppo_value._ranks import dp_slice

    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    if dist.get_rank() // cfg.tp == 0:
        local = {k: v.clone() for k, v in local.items()}
        local["attention_mask"][0] = 1
    before = worker.full_state_dict()
    try:
        worker.train(local)
    except ValueError as exc:
        message = str(exc)
    else:
        message = "no error"
    after = worker.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return message
