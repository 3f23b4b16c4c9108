"""``aten.nansum.default`` has no sharding strategy on torch 2.9 to 2.11.

Trigger: ``torch.nansum(x, dim)`` and ``torch.nanmean(x, dim)`` (which divides a ``nansum`` by a
count of non-NaN entries) on a DTensor: masked reward and loss statistics where padding is NaN.
``nanmean`` also needs ``aten.ne.Tensor`` (its NaN test), which has no strategy on 2.9 to 2.11
either; that op is pointwise and covered elsewhere.

Fix: a sum over ``dim`` that skips NaNs is still a sum, so a shard on a reduced dim is summed
locally and stays ``Partial(sum)`` (no communication; reduced when the result is read), and a
shard on another dim stays sharded (renumbered without ``keepdim``). A ``Partial`` input is
reduced first: ``nansum`` of per-rank shares is not ``nansum`` of their sum where a share is
NaN. Measured fixed upstream in torch 2.12 (a native strategy).
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import partial_reduction
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    return [partial_reduction("aten.nansum.default", "sum", ("dtype",))]


def _with_nan(*shape: int) -> torch.Tensor:
    x = randn(*shape)
    return x.masked_fill(x > 0.8, float("nan"))


# The tripwire's cases: ``nansum`` over sharded and unsharded dims of a tensor with NaNs vs single-device.
CASES = [
    Case("nansum(x, 1)", lambda x: torch.nansum(x, 1), lambda: [_with_nan(5, 6)], ["S1"]),
    Case(
        "nansum(x, 1, True)", lambda x: torch.nansum(x, 1, True), lambda: [_with_nan(5, 6)], ["S0"]
    ),
    Case("nansum(x)", lambda x: torch.nansum(x), lambda: [_with_nan(5, 6)], ["S0"]),
]


PATCH = Patch(
    name="nansum",
    summary="strategy for aten.nansum.default: Partial(sum) over sharded dims (torch 2.9 to 2.11)",
    ops=("aten.nansum.default",),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategy from torch 2.12 (measured)",
    communication="none",
)
