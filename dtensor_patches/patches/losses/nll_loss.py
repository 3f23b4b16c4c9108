"""``nll_loss`` / ``cross_entropy`` with ``reduction="mean"`` over a sharded batch: raises on
uneven shards and is silently wrong with ``ignore_index`` or class weights, torch 2.9 to 2.13.

Torch's strategy for ``aten.nll_loss_forward`` averages the per-rank weighted means
(``Partial("avg")``) and refuses uneven shards ("The intermediate results of nll_loss cannot
be evenly sharded"). Even shards are wrong too whenever the ranks' total weights differ: a
rank whose targets are mostly ``ignore_index`` (padding) counts as much as a full one.
Measured on 2 ranks: ``F.cross_entropy`` of a 5x3 ``Shard(0)`` batch raises on 2.9.1 to
2.13.0; ``F.nll_loss(..., ignore_index=1)`` of a 4x3 ``Shard(0)`` batch is wrong on 2.13.0.
Torch 2.14 replicates the batch for ``mean`` instead (correct, gathers).

Trigger: token-level cross entropy of a language model with the batch or sequence sharded
(data/sequence parallel), with padding ignored.

Fix (:func:`dtensor_patches.patches.losses._global_mean.nll_loss`): batch (and spatial) dims stay sharded, the
class dim is gathered, ``mean`` divides the global weighted sum by the global total weight
(one scalar all-reduce); ``nll_loss2d`` likewise. Replaces torch's strategy
(``overrides_existing``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import uneven_or_sharded
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.patches.losses._global_mean import nll_loss
from dtensor_patches.reproducers import Case, loss_and_grad, randn

OPS = (
    "aten.nll_loss_forward.default",
    "aten.nll_loss_backward.default",
    "aten.nll_loss2d_forward.default",
    "aten.nll_loss2d_backward.default",
)


def _registrations() -> list[Handler]:
    return [Handler(op, nll_loss) for op in OPS]


def _labels(*values: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.tensor(values)


# The tripwire's cases: Uneven, weighted and ``ignore_index`` means, sum and none, 1-d and 2-d targets.
CASES = [
    Case(
        "cross_entropy(mean) 5x3 Shard(0) + grad",
        loss_and_grad(F.cross_entropy),
        lambda: [randn(5, 3), _labels(0, 2, 1, 1, 0)()],
        ["S0", "S0"],
    ),
    Case(
        "nll_loss(mean, ignore_index=1) 4x3 Shard(0) + grad",
        loss_and_grad(lambda x, t: F.nll_loss(x, t, ignore_index=1)),
        lambda: [torch.log_softmax(randn(4, 3), 1), _labels(0, 2, 1, 1)()],
        ["S0", "S0"],
    ),
    Case(
        "cross_entropy(mean, weight) 5x3 Shard(0) + grad",
        loss_and_grad(lambda x, t, w: F.cross_entropy(x, t, weight=w)),
        lambda: [randn(5, 3), _labels(0, 2, 1, 1, 0)(), torch.tensor([0.5, 2.0, 1.5])],
        ["S0", "S0", "R"],
    ),
    Case(
        "cross_entropy(sum) 5x3 Shard(0) + grad",
        loss_and_grad(lambda x, t: F.cross_entropy(x, t, reduction="sum")),
        lambda: [randn(5, 3), _labels(0, 2, 1, 1, 0)()],
        ["S0", "S0"],
    ),
    Case(
        "cross_entropy(none) 5x3 Shard(0) + grad",
        loss_and_grad(lambda x, t: F.cross_entropy(x, t, reduction="none")),
        lambda: [randn(5, 3), _labels(0, 2, 1, 1, 0)()],
        ["S0", "S0"],
    ),
    Case(
        "cross_entropy(mean) 3x3x5 Shard(2) (nll_loss2d) + grad",
        loss_and_grad(lambda x, t: F.cross_entropy(x.unsqueeze(-1), t.unsqueeze(-1))),
        lambda: [randn(3, 3, 5), torch.tensor([[0, 1, 2, 0, 1], [2, 2, 1, 0, 0], [1, 0, 0, 2, 1]])],
        ["S2", "S1"],
    ),
]


PATCH = Patch(
    name="nll_loss",
    summary="nll_loss/cross_entropy mean over a sharded batch: raises on uneven shards, wrong with ignore_index or weights (2.9-2.13)",
    ops=OPS,
    gate=SpecifierSet(">=2.9,<2.14"),
    registrations=_registrations,
    cases=CASES,
    concerns=uneven_or_sharded,
    overrides_existing=True,
    communication="one scalar all-reduce for `mean`; a shard on the class dim is gathered",
)
