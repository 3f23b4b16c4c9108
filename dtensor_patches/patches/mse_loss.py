"""``aten.mse_loss`` (and its backward): no sharding strategy on torch 2.9 and 2.10, silently
wrong results from 2.11 on.

On 2.11+ torch derives a strategy from the op's decomposition, which averages the per-rank
means of unevenly sharded inputs (wrong forward for ``reduction="mean"``) and computes the
``mean`` backward on shards with the local element count instead of the global one, measured
on 2.11.0 to 2.15.0. This patch therefore replaces torch's handling on those releases
(``overrides_existing``).

Trigger: ``F.mse_loss(v, returns)`` on DTensors: the value loss of a PPO critic, regression
heads.

Fix (:func:`dtensor_patches.handlers.elementwise_loss`, shared with ``elementwise_losses``):
``input`` keeps its shards and ``target`` follows, no communication; ``none`` is sharded like
the input, ``sum`` is ``Partial(sum)`` of the local sums, ``mean`` is ``Partial(sum)`` of the
local sums divided by the global element count, even or uneven shards; the ``mean`` backward
divides by the global count too. ``Partial`` inputs are reduced first (the loss is not linear).
"""

from __future__ import annotations

import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, loss_and_grad, randn, run_cases
from dtensor_patches.handlers import elementwise_loss
from dtensor_patches.patch import Handler, Patch


def _registrations() -> list[Handler]:
    return [
        Handler("aten.mse_loss.default", elementwise_loss),
        Handler("aten.mse_loss_backward.default", elementwise_loss),
    ]


CASES = [
    Case(
        "mse_loss(mean) uneven",
        lambda x, y: F.mse_loss(x, y),
        lambda: [randn(5, 6), randn(5, 6, seed=1)],
        ["S0", "S0"],
    ),
    Case(
        "mse_loss(mean)",
        lambda x, y: F.mse_loss(x, y),
        lambda: [randn(4, 6), randn(4, 6, seed=1)],
        ["S0", "S0"],
    ),
    Case(
        "mse_loss(sum) + grad",
        loss_and_grad(lambda x, y: F.mse_loss(x, y, reduction="sum")),
        lambda: [randn(5, 6), randn(5, 6, seed=1)],
        ["S1", "S1"],
    ),
    Case(
        "mse_loss(none) + grad",
        loss_and_grad(lambda x, y: F.mse_loss(x, y, reduction="none")),
        lambda: [randn(5, 6), randn(5, 6, seed=1)],
        ["S0", "R"],
    ),
    Case(
        "mse_loss(mean) + grad",
        loss_and_grad(lambda x, y: F.mse_loss(x, y, reduction="mean")),
        lambda: [randn(5, 6), randn(5, 6, seed=1)],
        ["S1", "S1"],
    ),
]


def reproduce(mesh: object) -> str | None:
    """Each reduction, even and uneven shards, forward and backward, vs single-device."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="mse_loss",
    summary="mse_loss forward/backward: missing on 2.9-2.10, wrong mean on uneven shards and wrong mean gradient from 2.11",
    ops=("aten.mse_loss.default", "aten.mse_loss_backward.default"),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
)
