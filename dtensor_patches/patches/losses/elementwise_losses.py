"""Elementwise losses with their own ATen op: ``mse_loss``, ``smooth_l1_loss``, ``huber_loss``,
``soft_margin_loss``, ``binary_cross_entropy`` (forward and backward) and
``binary_cross_entropy_with_logits``.

Trigger: ``F.mse_loss(v, returns)`` (the value loss of a PPO critic, regression heads),
``F.binary_cross_entropy_with_logits`` (reward models), ``F.huber_loss`` on DTensors. Measured
on 2 ranks, input and target ``Shard(0)`` or ``Shard(1)`` of a 5x3 tensor:

- torch 2.9 and 2.10: no sharding strategy for any of them (2.11 too for
  ``binary_cross_entropy_with_logits``);
- from 2.11 (2.12 for ``binary_cross_entropy_with_logits``): torch derives a strategy from the
  op's decomposition that averages the per-rank means of uneven shards: ``reduction="mean"``
  is silently wrong, and so is its gradient (the ``*_backward`` kernels divide by the local
  element count). ``none`` and ``sum`` are right. Still so on 2.15.0.

Fix (one custom handler, :func:`._global_mean.elementwise_loss`): the input
keeps its shards and ``target``/``weight``/``pos_weight`` follow (replicated where they
broadcast), no communication; ``none`` stays sharded, ``sum`` is ``Partial(sum)``, ``mean`` is
``Partial(sum)`` of the local sums divided by the global element count; the ``mean`` backward
divides by the global count. Losses built from other ops (``l1_loss``, ``kl_div``,
``poisson_nll_loss``, ``gaussian_nll_loss``…) go through ``aten.mean`` and are right wherever
``mean`` is (see ``mean_uneven`` for 2.9).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import uneven_or_sharded
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.patches.losses._global_mean import elementwise_loss
from dtensor_patches.reproducers import Case, loss_and_grad, randn

OPS = (
    "aten.mse_loss.default",
    "aten.mse_loss_backward.default",
    "aten.smooth_l1_loss.default",
    "aten.smooth_l1_loss_backward.default",
    "aten.huber_loss.default",
    "aten.huber_loss_backward.default",
    "aten.soft_margin_loss.default",
    "aten.soft_margin_loss_backward.default",
    "aten.binary_cross_entropy.default",
    "aten.binary_cross_entropy_backward.default",
    # Its gradient is composed of pointwise ops and a mean in autograd: no backward op.
    "aten.binary_cross_entropy_with_logits.default",
)


def _registrations() -> list[Handler]:
    return [Handler(op, elementwise_loss) for op in OPS]


def _probabilities(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.sigmoid(randn(*shape, seed=seed))


def _signs(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.sign(randn(*shape, seed=seed))


# name -> (loss(x, target, reduction), input builder, target builder)
_LOSSES: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Any]] = {
    "mse_loss": (lambda x, y, r: F.mse_loss(x, y, reduction=r), randn, randn),
    "smooth_l1_loss": (
        lambda x, y, r: F.smooth_l1_loss(x, y, reduction=r, beta=0.5),
        randn,
        randn,
    ),
    "huber_loss": (lambda x, y, r: F.huber_loss(x, y, reduction=r, delta=0.5), randn, randn),
    "soft_margin_loss": (lambda x, y, r: F.soft_margin_loss(x, y, reduction=r), randn, _signs),
    "binary_cross_entropy": (
        lambda x, y, r: F.binary_cross_entropy(x, y, reduction=r),
        _probabilities,
        _probabilities,
    ),
    "binary_cross_entropy_with_logits": (
        lambda x, y, r: F.binary_cross_entropy_with_logits(x, y, reduction=r),
        randn,
        _probabilities,
    ),
}


def _case(name: str, reduction: str, shape: tuple[int, ...], placement: str) -> Case:
    loss, make_input, make_target = _LOSSES[name]
    return Case(
        f"{name}({reduction}) {'x'.join(map(str, shape))} {placement} + grad",
        loss_and_grad(lambda x, y: loss(x, y, reduction)),
        lambda: [make_input(*shape), make_target(*shape, seed=1)],
        [placement, placement],
    )


CASES = [
    # The bug: uneven mean, forward and gradient, on each sharded dim.
    *(_case(name, "mean", (5, 3), "S0") for name in _LOSSES),
    *(_case(name, "mean", (5, 3), "S1") for name in _LOSSES),
    # What torch 2.11+ gets right must stay right.
    *(_case(name, "sum", (5, 3), "S1") for name in _LOSSES),
    *(_case(name, "none", (5, 3), "S0") for name in _LOSSES),
    Case(
        "mse_loss(mean) even Shard(0)",
        lambda x, y: F.mse_loss(x, y),
        lambda: [randn(4, 6), randn(4, 6, seed=1)],
        ["S0", "S0"],
    ),
    Case(
        "mse_loss(none) target replicated + grad",
        loss_and_grad(lambda x, y: F.mse_loss(x, y, reduction="none")),
        lambda: [randn(5, 6), randn(5, 6, seed=1)],
        ["S0", "R"],
    ),
    Case(
        "binary_cross_entropy_with_logits(mean) weight, pos_weight broadcast, Shard(1)",
        loss_and_grad(
            lambda x, y, w, pw: F.binary_cross_entropy_with_logits(x, y, weight=w, pos_weight=pw)
        ),
        lambda: [randn(5, 3), _probabilities(5, 3, seed=1), randn(1, 3, seed=2), randn(3).abs()],
        ["S1", "S1", "R", "R"],
    ),
]


PATCH = Patch(
    name="elementwise_losses",
    summary="mse/smooth_l1/huber/soft_margin/BCE(+logits) losses: missing on 2.9-2.10, wrong "
    "uneven mean and mean gradient from 2.11",
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    concerns=uneven_or_sharded,
    overrides_existing=True,
    communication="none",
)
