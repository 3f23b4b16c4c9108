"""Critic statistics reduced globally from summed statistics.

Explained variance (design notes §4): ``EV = 1 - Var(R - V) / Var(R)`` over every valid token
of the batch on every data-parallel rank. Each rank accumulates sums (count, ``sum R``,
``sum R^2``, ``sum (R - V)``, ``sum (R - V)^2`` ...) in float64; the sums are all-reduced and the
ratio is taken once, so the result equals the single-process value instead of an average of
per-rank ratios. Variances are population variances, ``E[x^2] - E[x]^2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ppo_value._checks import as_bool_mask, check_same_shape, masked_sum

__all__ = ["ValueStats", "explained_variance"]


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the valid tokens of local ``[B, S]`` tensors.

    Returns ``nan`` if the returns have zero variance over the mask (EV undefined).

    Raises:
        ValueError: on shape mismatch or an empty mask.
    """
    stats = ValueStats()
    stats.update(values=values, returns=returns, mask=mask)
    if stats.count == 0:
        raise ValueError("mask is empty: explained variance is undefined")
    return stats.explained_variance()


@dataclass
class ValueStats:
    """Float64 sums over valid tokens, mergeable across micro-batches and ranks.

    ``update`` adds a micro-batch; ``add_loss`` adds loss terms; ``all_reduce`` sums (min/max
    for the extremes) across a process group; the properties compute the global metrics.
    """

    count: float = 0.0
    sum_v: float = 0.0
    sum_r: float = 0.0
    sum_r2: float = 0.0
    sum_res: float = 0.0
    sum_res2: float = 0.0
    min_v: float = math.inf
    max_v: float = -math.inf
    loss_sum: float = 0.0
    clipped_tokens: float = 0.0

    @torch.no_grad()
    def update(self, *, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> None:
        """Accumulate ``[B, S]`` values (``V(s_t)``), returns and mask (bool or 0/1); masked
        positions are ignored whatever they hold."""
        check_same_shape(values=values, returns=returns, mask=mask)
        valid = as_bool_mask(mask)
        v = values.detach().to(torch.float64)
        r = returns.detach().to(torch.float64)
        res = r - v
        n = float(valid.sum())
        self.count += n
        # torch.where, not a product with the mask: masked NaN/inf must not reach the sums.
        self.sum_v += float(masked_sum(v, valid))
        self.sum_r += float(masked_sum(r, valid))
        self.sum_r2 += float(masked_sum(r.square(), valid))
        self.sum_res += float(masked_sum(res, valid))
        self.sum_res2 += float(masked_sum(res.square(), valid))
        if n > 0:
            self.min_v = min(self.min_v, float(v[valid].min()))
            self.max_v = max(self.max_v, float(v[valid].max()))

    def add_loss(
        self, loss_sum: float | torch.Tensor, clipped_tokens: float | torch.Tensor
    ) -> None:
        """Add the un-normalised loss sum and clipped-token count of a micro-batch."""
        self.loss_sum += float(loss_sum)
        self.clipped_tokens += float(clipped_tokens)

    def all_reduce(self, group: dist.ProcessGroup | None = None) -> None:
        """Reduce in place across ``group``: sums are summed, extremes min/max-reduced."""
        if not dist.is_available() or not dist.is_initialized():
            return
        names = [f.name for f in fields(self) if f.name not in ("min_v", "max_v")]
        sums = torch.tensor([getattr(self, n) for n in names], dtype=torch.float64)
        ext = torch.tensor([-self.min_v, self.max_v], dtype=torch.float64)
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            sums, ext = sums.to(device), ext.to(device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
        for n, val in zip(names, sums.tolist(), strict=True):
            setattr(self, n, val)
        self.min_v, self.max_v = -float(ext[0]), float(ext[1])

    def explained_variance(self) -> float:
        """``1 - Var(R - V) / Var(R)``; ``nan`` if there are no tokens or ``Var(R) == 0``."""
        if self.count == 0:
            return math.nan
        var_r = self.sum_r2 / self.count - (self.sum_r / self.count) ** 2
        var_res = self.sum_res2 / self.count - (self.sum_res / self.count) ** 2
        if var_r <= 0:
            return math.nan
        return 1.0 - var_res / var_r

    def as_metrics(self, prefix: str = "critic/") -> dict[str, float]:
        """Loss, clip fraction, value mean/min/max, returns mean and EV as plain floats."""
        n = max(self.count, 1.0)
        return {
            f"{prefix}loss": self.loss_sum / n,
            f"{prefix}clip_fraction": self.clipped_tokens / n,
            f"{prefix}values_mean": self.sum_v / n,
            f"{prefix}values_min": self.min_v,
            f"{prefix}values_max": self.max_v,
            f"{prefix}returns_mean": self.sum_r / n,
            f"{prefix}explained_var": self.explained_variance(),
            f"{prefix}num_tokens": self.count,
        }
