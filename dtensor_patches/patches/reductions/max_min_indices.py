"""``torch.max(x, dim)`` / ``torch.min(x, dim)`` return shard-local indices on torch 2.9 and 2.10.

Trigger: ``torch.max(x, 0)`` with ``x`` ``Shard(0)``: torch reduces the values correctly
(``Partial(max)``) but each rank's index counts from the start of its own shard, so the
indices are silently wrong (greedy token choice over a vocab-parallel dim, best-of-n
selection).

Fix (replacing torch's strategy): dimwise with two outputs: shards on other dims stay with no
communication; a shard on the reduced dim is gathered first, so indices are global. Measured
correct from torch 2.11.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise, keepdim_arg
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    return [
        dimwise(op, dims=dims_arg(1), keepdim=keepdim_arg(2), num_outputs=2)
        for op in ("aten.max.dim", "aten.min.dim")
    ]


# The tripwire's cases: Values and indices of max/min over sharded and unsharded dims (indices exact).
# Uneven sizes that leave no rank an empty shard on 2 or 4 ranks (7: 4, 3 and 2, 2, 2, 1): an
# extremum of an empty shard raises on that rank alone and the others wait.
CASES = [
    Case("torch.max(x, 0)", lambda x: torch.max(x, 0), lambda: [randn(7, 4)], ["S0"]),
    Case(
        "torch.min(x, 1, keepdim)", lambda x: torch.min(x, 1, True), lambda: [randn(4, 7)], ["S1"]
    ),
    Case("torch.max(x, 1)", lambda x: torch.max(x, 1), lambda: [randn(7, 6)], ["S0"]),
]


PATCH = Patch(
    name="max_min_indices",
    summary="global indices from torch.max/min(dim) over a sharded dim (torch 2.9, 2.10)",
    ops=("aten.max.dim", "aten.min.dim"),
    gate=SpecifierSet(">=2.9,<2.11"),
    registrations=_registrations,
    cases=CASES,
    overrides_existing=True,
    communication="only a shard on the reduced dim",
)
