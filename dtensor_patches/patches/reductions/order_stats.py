"""Order statistics with no sharding strategy on torch 2.9 to 2.11: ``kthvalue``,
``median``/``nanmedian`` (with and without ``dim``), ``mode``.

Trigger: ``torch.kthvalue(x, k, 1)``, ``torch.median(x, 1)``, ``torch.median(x)``,
``torch.nanmedian(x)`` on a DTensor (robust reward statistics, quantile clipping).

Fix: dimwise with two outputs (values, indices): shards on other dims stay, a shard on the
reduced dim is gathered first, so indices are global. ``median()``/``nanmedian()`` of the
whole tensor (one 0-d value) gather the input: the median of per-rank medians is not the
median. Measured fixed upstream in torch 2.12.
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
            "aten.kthvalue.default",
            dims=dims_arg(2, default=-1),
            keepdim=keepdim_arg(3),
            num_outputs=2,
        ),
        dimwise("aten.median.dim", dims=dims_arg(1), keepdim=keepdim_arg(2), num_outputs=2),
        dimwise("aten.nanmedian.dim", dims=dims_arg(1), keepdim=keepdim_arg(2), num_outputs=2),
        # Over every dim: a 0-d value, so every input placement is gathered.
        dimwise("aten.median.default", dims=lambda op_schema: None, keepdim=False),
        dimwise("aten.nanmedian.default", dims=lambda op_schema: None, keepdim=False),
        dimwise(
            "aten.mode.default", dims=dims_arg(1, default=-1), keepdim=keepdim_arg(2), num_outputs=2
        ),
    ]


def _with_nan(*shape: int) -> torch.Tensor:
    x = randn(*shape)
    return x.masked_fill(x > 1.0, float("nan"))


# The tripwire's cases: Order statistics along sharded and unsharded dims vs single-device (indices exact).
CASES = [
    Case("kthvalue(x, 2, 1)", lambda x: torch.kthvalue(x, 2, 1), lambda: [randn(4, 6)], ["S1"]),
    Case(
        "kthvalue(x, 2, 1)", lambda x: torch.kthvalue(x, 2, 1, True), lambda: [randn(5, 6)], ["S0"]
    ),
    Case("median(x, 1)", lambda x: torch.median(x, 1), lambda: [randn(4, 6)], ["S1"]),
    Case("nanmedian(x, 0)", lambda x: torch.nanmedian(x, 0), lambda: [randn(5, 6)], ["S1"]),
    Case("median(x)", lambda x: torch.median(x), lambda: [randn(5, 6)], ["S1"]),
    Case("nanmedian(x)", lambda x: torch.nanmedian(x), lambda: [_with_nan(5, 6)], ["S0"]),
    Case("mode(x, 1)", lambda x: torch.mode(x, 1), lambda: [randn(4, 6).round()], ["S1"]),
]


PATCH = Patch(
    name="order_stats",
    summary="strategies for kthvalue, median/nanmedian (with and without dim), mode "
    "(torch 2.9 to 2.11)",
    ops=(
        "aten.kthvalue.default",
        "aten.median.dim",
        "aten.nanmedian.dim",
        "aten.median.default",
        "aten.nanmedian.default",
        "aten.mode.default",
    ),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategies from torch 2.12 (measured)",
    communication="only a shard on `dim` (all of it without `dim`)",
)
