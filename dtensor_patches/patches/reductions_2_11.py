"""``aten.nansum.default`` and ``aten.std_mean.correction`` have no sharding strategy on torch
2.9 to 2.11.

Trigger: ``torch.nansum(x, dim)``, ``torch.nanmean(x, dim)`` (which calls ``nansum``; with
``pointwise_2_11`` for its ``!=``), ``torch.std_mean(x, dim)`` (advantage whitening, metrics)
on DTensors.

Fix: dimwise reductions (``strategies.dimwise_strategy``): shards on the dims not reduced stay
sharded, a shard on a reduced dim is gathered first. ``nansum`` is linear, so a ``Partial()``
input stays ``Partial()``; ``std_mean`` gathers it and places both outputs alike. Measured fixed
upstream in torch 2.12.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._dimwise import dims_arg, dimwise, keepdim_arg


def _registrations() -> list[Strategy]:
    return [
        dimwise(
            "aten.nansum.default",
            dims=dims_arg(1),
            keepdim=keepdim_arg(2),
            linear=True,
            static_kwargkey=("dtype",),
        ),
        dimwise(
            "aten.std_mean.correction",
            dims=dims_arg(1),
            keepdim=keepdim_arg(99),  # keyword-only
            num_outputs=2,
            static_kwargkey=("correction", "keepdim"),
        ),
    ]


def _with_nan(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[1, 2] = float("nan")
    return x


CASES = [
    Case("nansum(x, 1)", lambda x: torch.nansum(x, 1), lambda: [_with_nan(randn(5, 6))], ["S0"]),
    Case("nansum(x)", torch.nansum, lambda: [_with_nan(randn(5, 6))], ["S1"]),
    Case("nansum(P, 0)", lambda x: torch.nansum(x, 0), lambda: [randn(5, 6)], ["P"]),
    Case("std_mean(x, 1)", lambda x: torch.std_mean(x, 1), lambda: [randn(5, 6)], ["S0"]),
    Case(
        "std_mean(x, 0, keepdim)",
        lambda x: torch.std_mean(x, 0, keepdim=True),
        lambda: [randn(5, 6)],
        ["S0"],
    ),
]


def reproduce(mesh: object) -> str | None:
    """``nansum`` and ``std_mean`` over sharded and unsharded dims vs single-device."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="reductions_2_11",
    summary="strategies for nansum and std_mean.correction (torch 2.9 to 2.11)",
    ops=("aten.nansum.default", "aten.std_mean.correction"),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_fix="native strategies or decompositions from torch 2.12 (measured)",
)
