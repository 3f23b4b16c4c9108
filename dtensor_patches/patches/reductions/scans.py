"""Scans with no sharding strategy on torch 2.9 to 2.11: ``cumprod``, ``logcumsumexp``,
``cummax``, ``cummin``.

Trigger: ``torch.cumprod(x, 1)`` etc. on a DTensor (discounted returns, running maxima of
rewards, log-space prefix sums).

Fix: a scan along ``d`` keeps shards on other dims with no communication and gathers only a
shard on ``d`` (``cummax``/``cummin`` indices are then global). Measured fixed upstream in torch
2.12.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    return [
        dimwise("aten.cumprod.default", dims=dims_arg(1), static_kwargkey=("dtype",)),
        dimwise("aten.logcumsumexp.default", dims=dims_arg(1)),
        dimwise("aten.cummax.default", dims=dims_arg(1), num_outputs=2),
        dimwise("aten.cummin.default", dims=dims_arg(1), num_outputs=2),
    ]


# The tripwire's cases: Scans along sharded and unsharded dims vs single-device results (indices exact).
CASES = [
    Case("cumprod(x, 1)", lambda x: torch.cumprod(x, 1), lambda: [randn(4, 6)], ["S1"]),
    Case("cumprod(x, 1)", lambda x: torch.cumprod(x, 1), lambda: [randn(5, 6)], ["S0"]),
    Case("logcumsumexp(x, 1)", lambda x: torch.logcumsumexp(x, 1), lambda: [randn(4, 6)], ["S1"]),
    Case("cummax(x, 1)", lambda x: torch.cummax(x, 1), lambda: [randn(4, 6)], ["S1"]),
    Case("cummin(x, 0)", lambda x: torch.cummin(x, 0), lambda: [randn(5, 6)], ["S0"]),
]


PATCH = Patch(
    name="scans",
    summary="strategies for cumprod, logcumsumexp, cummax, cummin (torch 2.9 to 2.11)",
    ops=(
        "aten.cumprod.default",
        "aten.logcumsumexp.default",
        "aten.cummax.default",
        "aten.cummin.default",
    ),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategies from torch 2.12 (measured)",
    communication="only a shard on `dim`",
)
