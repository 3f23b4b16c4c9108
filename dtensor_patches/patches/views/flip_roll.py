"""``flip`` and ``roll`` have no sharding strategy on torch 2.9 to 2.11.

Trigger: ``torch.flip(x, [1])``, ``torch.roll(x, 1, 1)`` on a DTensor (reversed cumulative sums
for returns, shifted targets).

Fix: dimwise and linear: shards on the dims not flipped/rolled stay, ``Partial()`` stays
``Partial()`` (both ops are linear), a shard on a flipped/rolled dim is gathered first.
``roll`` without ``dims`` rolls the flattened tensor and gathers everything. Measured fixed
upstream in torch 2.12.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    return [
        dimwise("aten.flip.default", dims=dims_arg(1), linear=True),
        dimwise("aten.roll.default", dims=dims_arg(2, "dims", ()), linear=True),
    ]


# The tripwire's cases: ``flip``/``roll`` along sharded/unsharded dims and on ``Partial`` vs single-device.
CASES = [
    Case("flip(x, [1])", lambda x: torch.flip(x, [1]), lambda: [randn(4, 6)], ["S1"]),
    Case("flip(x, [1])", lambda x: torch.flip(x, [1]), lambda: [randn(5, 6)], ["S0"]),
    Case("flip(x, [0])", lambda x: torch.flip(x, [0]), lambda: [randn(5, 6)], ["P"]),
    Case("roll(x, 1, 1)", lambda x: torch.roll(x, 1, 1), lambda: [randn(4, 6)], ["S1"]),
    Case("roll(x, 2)", lambda x: torch.roll(x, 2), lambda: [randn(5, 6)], ["S0"]),
]


PATCH = Patch(
    name="flip_roll",
    summary="strategies for flip and roll (torch 2.9 to 2.11)",
    ops=("aten.flip.default", "aten.roll.default"),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategies from torch 2.12 (measured)",
    communication="only a shard on a flipped/rolled dim",
)
