"""``aten.var_mean.correction`` and ``aten.std_mean.correction`` have no sharding strategy on
torch 2.9 to 2.11.

Trigger: ``torch.var_mean(x, dim)``, ``torch.std_mean(x, dim)`` on a DTensor (layer statistics,
advantage whitening).

Fix: a dimwise reduction with two outputs (variance or std, mean), both placed alike: shards on the
dims not reduced stay sharded, a shard on a reduced dim or a ``Partial`` input is gathered
first. Measured fixed upstream in torch 2.12.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise, keepdim_arg
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    return [
        dimwise(
            op,
            dims=dims_arg(1),
            keepdim=keepdim_arg(99),  # keyword-only
            num_outputs=2,
            static_kwargkey=("correction", "keepdim"),
        )
        for op in ("aten.var_mean.correction", "aten.std_mean.correction")
    ]


# The tripwire's cases: ``var_mean`` over sharded and unsharded dims vs single-device results.
CASES = [
    Case("var_mean(x, 1)", lambda x: torch.var_mean(x, 1), lambda: [randn(4, 6)], ["S1"]),
    Case(
        "var_mean(x, 1)",
        lambda x: torch.var_mean(x, 1, keepdim=True),
        lambda: [randn(5, 6)],
        ["S0"],
    ),
    Case("var_mean(x)", lambda x: torch.var_mean(x, correction=0), lambda: [randn(5, 6)], ["S0"]),
    Case("std_mean(x, 1)", lambda x: torch.std_mean(x, 1), lambda: [randn(5, 6)], ["S1"]),
    Case("std_mean(x)", lambda x: torch.std_mean(x), lambda: [randn(5, 6)], ["S0"]),
]


PATCH = Patch(
    name="var_mean",
    summary="strategies for var_mean and std_mean (torch 2.9 to 2.11)",
    ops=("aten.var_mean.correction", "aten.std_mean.correction"),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="torch 2.12: a native var_mean strategy; std_mean runs decomposed (measured)",
    communication="only a shard on a reduced dim",
)
