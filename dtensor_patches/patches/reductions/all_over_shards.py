"""``x.all()`` over a sharded dim is silently wrong on torch 2.9: an OR, not an AND.

Trigger: ``torch.isfinite(grad).all()``, ``mask.all(dim)`` or ``(x > 0).all()`` of a DTensor
sharded on a reduced dim (a NaN/inf guard over a sharded gradient, a check that every token of
a sequence-sharded batch is valid). Torch 2.9's strategy for ``aten.all`` makes the result
``Partial(sum)``, and a sum of bools is their OR: one rank's ``True`` wins, so a NaN on another
rank's shard is reported finite. Measured on 2 ranks: ``True`` where the single device gives
``False``. From 2.10 torch makes it ``Partial(product)`` (an AND).

Fix: strategies for ``aten.all.default``/``.dim`` (``.dims`` has none on 2.9: the
``all_any_dims`` patch): each rank reduces its shard and a shard on a reduced dim gives
``Partial(product)`` (no communication; one AND of the results when read); a shard on another
dim stays sharded (renumbered without ``keepdim``); a ``Partial`` input is reduced first
(``all`` of shares is not ``all`` of their sum).
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import partial_reduction
from dtensor_patches.reproducers import Case, randn_nan_last


def _registrations() -> list[Strategy]:
    return [
        partial_reduction("aten.all.default", "product"),
        partial_reduction("aten.all.dim", "product"),
    ]


# The tripwire's cases: an AND over shards where one rank's shard holds the only False.
CASES = [
    Case(
        "isfinite(x).all()",
        lambda x: torch.isfinite(x).all(),
        lambda: [randn_nan_last(5, 3)],
        ["S0"],
    ),
    Case(
        "isfinite(x).all(0)",
        lambda x: torch.isfinite(x).all(0),
        lambda: [randn_nan_last(4, 3)],
        ["S0"],
    ),
    Case(
        "isfinite(x).all(1)",
        lambda x: torch.isfinite(x).all(1),
        lambda: [randn_nan_last(5, 3)],
        ["S0"],
    ),
]


PATCH = Patch(
    name="all_over_shards",
    summary="x.all() over a sharded dim is an OR on torch 2.9 (Partial(sum)): Partial(product)",
    ops=("aten.all.default", "aten.all.dim"),
    gate=SpecifierSet(">=2.9,<2.10"),
    registrations=_registrations,
    cases=CASES,
    overrides_existing=True,
    upstream_fix="torch 2.10 reduces aten.all with Partial(product) (measured)",
    communication="none (one AND of the results when read)",
)
