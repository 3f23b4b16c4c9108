"""``aten.fill_.Tensor`` has no sharding strategy on torch 2.9 to 2.15.

Trigger: ``x[:, 0] = 1.0`` (and ``x.fill_(t)`` with a 0-d tensor) on a DTensor: ATen fills the
selected view with a 0-d tensor value, e.g. masking the first position of every sequence.

Fix: a fill writes the same value everywhere, so the tensor keeps its ``Shard``/``Replicate``
placements with no communication and the 0-d value is replicated. On 2.15 ``x[:, 0] = 1.0``
works without the patch (torch routes it differently), but ``x.fill_(t)`` still fails.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.strategies import uniform_strategy


def _fill(op_schema: Any) -> Any:
    return uniform_strategy(op_schema)


def _registrations() -> list[Strategy]:
    return [Strategy("aten.fill_.Tensor", _fill), Strategy("aten.fill.Tensor", _fill)]


def _first_column(x: torch.Tensor) -> torch.Tensor:
    x[:, 0] = 1.0
    return x


def _fill_with_tensor(x: torch.Tensor) -> torch.Tensor:
    return x.fill_(torch.tensor(2.5))


CASES = [
    Case("x[:, 0] = 1.0", _first_column, lambda: [randn(5, 6)], ["S0"], inplace=True),
    Case("x.fill_(tensor)", _fill_with_tensor, lambda: [randn(5, 6)], ["S1"], inplace=True),
]


def reproduce(mesh: object) -> str | None:
    """Fills through views and whole tensors; the caller's tensor is compared afterwards."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="fill_tensor",
    summary="strategy for aten.fill_.Tensor (x[:, 0] = 1.0, x.fill_(t)) (torch 2.9 to 2.15)",
    ops=("aten.fill_.Tensor", "aten.fill.Tensor"),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
)
