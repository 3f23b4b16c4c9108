"""Single-process reference computations, written independently of the worker.

The value model is the plain (unsharded, unpadded) :class:`ppo_value.model.ValueModel`; the
shift, loss, clipping and explained variance are spelled out here with plain tensor ops
rather than by calling the functions under test.
"""

from __future__ import annotations

import math

import torch

from ppo_value.config import ValueConfig
from ppo_value.model import ValueModel


def shift(raw: torch.Tensor) -> torch.Tensor:
    """``out[:, 0] = 0``, ``out[:, t] = raw[:, t - 1]``."""
    out = torch.zeros_like(raw)
    out[:, 1:] = raw[:, :-1]
    return out


@torch.no_grad()
def reference_values(model: ValueModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``V(s_t)`` ``[B, S]`` from one forward of the whole batch on one process."""
    return shift(model(batch["input_ids"], batch["attention_mask"]))


def reference_train_step(
    model: ValueModel, cfg: ValueConfig, batch: dict[str, torch.Tensor]
) -> dict[str, float]:
    """One optimiser step on the whole batch in one pass; returns loss, grad norm, EV."""
    if cfg.optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.lr,
            betas=cfg.adam_betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    lr_scale = 1.0 / (cfg.warmup_steps + 1)
    for group in opt.param_groups:
        group["lr"] = cfg.lr * lr_scale
    v = shift(model(batch["input_ids"], batch["attention_mask"]))
    m = batch["loss_mask"].float()
    r = batch["returns"].float()
    old = batch["old_values"].float()
    sq = (v - r) ** 2
    if cfg.value_clip is not None:
        vc = torch.minimum(torch.maximum(v, old - cfg.value_clip), old + cfg.value_clip)
        sq_c = (vc - r) ** 2
        per_tok = torch.maximum(sq, sq_c)
        clipped = float(((sq_c > sq).float() * m).sum() / m.sum())
    else:
        per_tok = sq
        clipped = 0.0
    loss = 0.5 * (per_tok * m).sum() / m.sum()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    if cfg.max_grad_norm is not None and grad_norm > cfg.max_grad_norm:
        for g in grads:
            g.mul_(cfg.max_grad_norm / (grad_norm + 1e-6))
    opt.step()
    sel = m.bool()
    res = (r - v.detach())[sel].double()
    rr = r[sel].double()
    ev = 1.0 - res.var(unbiased=False) / rr.var(unbiased=False)
    valid_v = v.detach()[sel].double()
    return {
        "values_mean": float(valid_v.mean()),
        "values_min": float(valid_v.min()),
        "values_max": float(valid_v.max()),
        "returns_mean": float(rr.mean()),
        "loss": float(loss.detach()),
        "grad_norm": grad_norm,
        "explained_var": float(ev) if math.isfinite(float(ev)) else math.nan,
        "clip_fraction": clipped,
    }
