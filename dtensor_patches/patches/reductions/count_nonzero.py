"""``aten.count_nonzero`` has no sharding strategy on torch 2.9 and 2.10.

Trigger: ``torch.count_nonzero(mask, dim)`` on a DTensor, e.g. counting valid tokens per
sequence of an attention or loss mask.

Fix: a dimwise reduction: shards on the dims not counted over stay sharded, a shard on a counted
dim is gathered first (a count is a sum, but ``count_nonzero`` of a ``Partial`` input is not
the sum of the partial counts, so ``Partial`` inputs are reduced first). Measured fixed upstream
in torch 2.11.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    return [
        dimwise("aten.count_nonzero.default", dims=dims_arg(1), keepdim=False),
        dimwise("aten.count_nonzero.dim_IntList", dims=dims_arg(1), keepdim=False),
    ]


# The tripwire's cases: Counts over sharded and unsharded dims vs single-device results.
CASES = [
    Case(
        "count_nonzero(x, 1)",
        lambda x: torch.count_nonzero(x, 1),
        lambda: [randn(4, 6).relu()],
        ["S1"],
    ),
    Case(
        "count_nonzero(x, 1)",
        lambda x: torch.count_nonzero(x, 1),
        lambda: [randn(5, 6).relu()],
        ["S0"],
    ),
    Case(
        "count_nonzero(x)", lambda x: torch.count_nonzero(x), lambda: [randn(5, 6).relu()], ["S0"]
    ),
    Case(
        "count_nonzero(x, (0, 1))",
        lambda x: torch.count_nonzero(x, (0, 1)),
        lambda: [randn(3, 4, 6).relu()],
        ["S2"],
    ),
]


PATCH = Patch(
    name="count_nonzero",
    summary="strategies for aten.count_nonzero (torch 2.9, 2.10)",
    ops=("aten.count_nonzero.default", "aten.count_nonzero.dim_IntList"),
    gate=SpecifierSet(">=2.9,<2.11"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategy from torch 2.11 (measured)",
    communication="only a shard on a counted dim",
)
