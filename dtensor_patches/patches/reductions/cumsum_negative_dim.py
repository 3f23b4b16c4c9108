"""``torch.cumsum(x, -1)`` on a DTensor sharded on its last dim is silently wrong on torch 2.9
to 2.13.

Trigger: ``torch.cumsum(x, dim=-1)`` (or any negative ``dim``) with ``x`` sharded on that dim
(prefix sums over a sequence-parallel sequence dim, cumulative rewards). Torch's strategy
compares the negative ``dim`` with the shard's non-negative dim, finds no match, keeps the
shard, and each rank returns the prefix sums of its own block only. The same call with the
non-negative dim is correct. Measured fixed in torch 2.14 (cumsum moved to a single-dim
strategy).

Fix: the scan strategy shared with ``scans`` (dims normalised): shards on other dims stay, a
shard on ``dim`` is gathered, ``Partial()`` stays ``Partial()`` (cumsum is linear).
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    return [
        dimwise("aten.cumsum.default", dims=dims_arg(1), linear=True, static_kwargkey=("dtype",))
    ]


# The tripwire's cases: ``cumsum`` along negative dims, sharded and not, vs single-device.
CASES = [
    Case("cumsum(x, -1), x Shard(1)", lambda x: torch.cumsum(x, -1), lambda: [randn(4, 6)], ["S1"]),
    Case(
        "cumsum(x, -1), x Shard(2)", lambda x: torch.cumsum(x, -1), lambda: [randn(2, 3, 5)], ["S2"]
    ),
    Case("cumsum(x, -2), x Shard(0)", lambda x: torch.cumsum(x, -2), lambda: [randn(5, 4)], ["S0"]),
    Case("cumsum(x, -1), x Shard(0)", lambda x: torch.cumsum(x, -1), lambda: [randn(5, 4)], ["S0"]),
]


PATCH = Patch(
    name="cumsum_negative_dim",
    summary="cumsum along a negative dim that is sharded (torch 2.9 to 2.13: silently wrong)",
    ops=("aten.cumsum.default",),
    gate=SpecifierSet(">=2.9,<2.14"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="single-dim cumsum strategy in torch 2.14 (measured)",
    overrides_existing=True,
    communication="only a shard on `dim`",
)
