"""``aten.all.dims`` and ``aten.any.dims`` have no sharding strategy on torch 2.9 and 2.10.

Trigger: ``mask.all(dim=(0, 1))``, ``torch.isnan(x).any(dim=(1, 2), keepdim=True)`` of a
DTensor (the several-dims overloads, also reached from ``all(dim=[...])``): a mask check over
the batch and sequence dims of a sequence-sharded tensor. Through the fallback every rank
gathers the whole mask. From 2.11 torch decomposes them.

Fix: the same strategy as torch's ``all``/``any`` (``partial_reduction``): each rank reduces its
shard, a shard on a reduced dim gives ``Partial(product)`` for ``all`` (an AND) and
``Partial(sum)`` for ``any`` (an OR), a shard on another dim stays sharded, a ``Partial`` input
is reduced first.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import partial_reduction
from dtensor_patches.reproducers import Case, randn_nan_last


def _registrations() -> list[Strategy]:
    return [
        partial_reduction("aten.all.dims", "product"),
        partial_reduction("aten.any.dims", "sum"),
    ]


# The tripwire's cases: several-dims checks where one rank's shard decides, vs the single device.
CASES = [
    Case(
        "isfinite(x).all(dim=(0, 1), keepdim=True)",
        lambda x: torch.isfinite(x).all(dim=(0, 1), keepdim=True),
        lambda: [randn_nan_last(4, 6)],
        ["S1"],
    ),
    Case(
        "isnan(x).any(dim=(0, 2))",
        lambda x: torch.isnan(x).any(dim=(0, 2)),
        lambda: [randn_nan_last(5, 3, 2)],
        ["S0"],
    ),
    Case(
        "isnan(x).any(dim=(1,))",
        lambda x: torch.isnan(x).any(dim=(1,)),
        lambda: [randn_nan_last(5, 3)],
        ["S0"],
    ),
]


PATCH = Patch(
    name="all_any_dims",
    summary="strategies for aten.all.dims / aten.any.dims (torch 2.9, 2.10)",
    ops=("aten.all.dims", "aten.any.dims"),
    gate=SpecifierSet(">=2.9,<2.11"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="torch 2.11 decomposes them (measured)",
    communication="none (one AND/OR of the results when read)",
)
