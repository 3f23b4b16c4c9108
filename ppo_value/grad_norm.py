"""Gradient 2-norm and clipping of the critic, on :func:`dtensor_patches.grad_norm`.

The critic's gradients are FSDP2 + TP DTensors of one (dp, tp) mesh (``Shard`` on dp,
``Shard`` or ``Replicate`` on tp) and plain ones of parameters outside both (the same on every
rank). ``dtensor_patches.grad_norm`` (in float64) counts every element once (a gradient replicated over tp
weighted by ``1 / tp``) and sums them in one all-reduce over the flattened mesh, where
``torch.nn.utils.clip_grad_norm_`` would make one per mesh dim (torch 2.13 logs "2 sequential
all_reduce operations ... flatten mesh dimensions"). The norm is read on the host once, for
the log and the decision to skip a non-finite step; clipping uses torch's coefficient
``min(1, max_norm / (norm + 1e-6))``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

import dtensor_patches

__all__ = ["clip_grad_norm_flat", "global_grad_norm"]


@torch.no_grad()
def global_grad_norm(parameters: Iterable[torch.Tensor]) -> float:
    """The 2-norm of all gradients of ``parameters`` across every rank, in one all-reduce.

    Args:
        parameters: parameters (plain or DTensor) whose ``.grad`` to include; ``None`` grads
            are skipped. Every rank passes its parameters of the same model.

    Returns:
        The norm as a Python float (``inf``/``nan`` if a gradient is not finite); identical on
        every rank.
    """
    return float(dtensor_patches.grad_norm(list(parameters), dtype=torch.float64))


@torch.no_grad()
def clip_grad_norm_flat(parameters: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Clip gradients in place to a global 2-norm of ``max_norm``; return the norm before.

    Args:
        parameters: as :func:`global_grad_norm`.
        max_norm: the clip threshold; ``None`` only measures.

    Returns:
        The unclipped global norm. A non-finite norm leaves every gradient untouched (the
        caller skips the step).
    """
    params = list(parameters)
    norm = global_grad_norm(params)
    if max_norm is None or not math.isfinite(norm):
        return norm
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        local = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in params
            if p.grad is not None
        ]
        for t in local:
            t.mul_(coef)
    return norm
