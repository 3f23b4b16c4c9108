"""The built-in patches, in application order. Each module holds one patch: its strategy,
gate, reproducer and upstream references together."""

from __future__ import annotations

from dtensor_patches.patch import Patch
from dtensor_patches.patches import (
    alias,
    count_nonzero,
    data_dependent,
    elementwise_losses,
    fill_tensor,
    flip_roll,
    index_put,
    isin_searchsorted,
    masked_scatter,
    max_min_indices,
    mean_uneven,
    mse_loss,
    nll_loss,
    order_stats,
    pointwise_gaps,
    reductions_2_9,
    scans,
    sdpa_cpu,
    squeeze,
    unbind,
    unfold,
    var_mean,
)

BUILTIN_PATCHES: tuple[Patch, ...] = (
    alias.PATCH,
    reductions_2_9.PATCH,
    unbind.PATCH,
    count_nonzero.PATCH,
    mse_loss.PATCH,
    var_mean.PATCH,
    scans.PATCH,
    order_stats.PATCH,
    flip_roll.PATCH,
    sdpa_cpu.PATCH,
    unfold.PATCH,
    pointwise_gaps.PATCH,
    isin_searchsorted.PATCH,
    fill_tensor.PATCH,
    index_put.PATCH,
    masked_scatter.PATCH,
    data_dependent.PATCH,
    mean_uneven.PATCH,
    max_min_indices.PATCH,
    squeeze.PATCH,
    elementwise_losses.PATCH,
    nll_loss.PATCH,
)

__all__ = ["BUILTIN_PATCHES"]
