"""Elementwise ops with no sharding strategy on torch 2.9 and 2.10: ``floor_divide`` (``//``)
and ``masked_fill`` with a tensor value; ``masked_fill_`` with a scalar on 2.9.

Trigger: ``ids // block``, ``x.masked_fill(mask, torch.tensor(v))``, ``x.masked_fill_(mask, v)``
on DTensors (attention masks, bucketing token ids).

Fix: an elementwise strategy with broadcasting (``strategies.elementwise_strategy``): the input
keeps its ``Shard(d)``, the other tensors are sharded alike where they have that dim and
replicated where they broadcast; in-place variants keep the caller's placements. Measured
fixed upstream in torch 2.11 (the triggers run through decompositions there; ``masked_fill_``
with a scalar from 2.10).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.strategies import elementwise_strategy

OPS = (
    "aten.floor_divide.default",
    "aten.floor_divide_.Tensor",
    "aten.masked_fill.Tensor",
    "aten.masked_fill_.Tensor",
    "aten.masked_fill_.Scalar",
)


def _pointwise(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema, driver=0)


def _registrations() -> list[Strategy]:
    return [Strategy(op, _pointwise) for op in OPS]


def _fill_(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x.masked_fill_(m, -1.0)


CASES = [
    Case("ids // 4", lambda x: x // 4, lambda: [torch.arange(30).reshape(5, 6)], ["S0"]),
    Case(
        "floor_divide(x, y)",
        torch.floor_divide,
        lambda: [torch.arange(30).reshape(5, 6), torch.arange(1, 7)],
        ["S1", "S0"],
    ),
    Case(
        "x.masked_fill(mask, tensor)",
        lambda x, m: x.masked_fill(m, torch.tensor(0.5)),
        lambda: [randn(5, 6), randn(5, 6, seed=1) > 0],
        ["S1", "S1"],
    ),
    Case(
        "x.masked_fill(mask[1, S], tensor)",
        lambda x, m: x.masked_fill(m, torch.tensor(0.5)),
        lambda: [randn(5, 6), randn(1, 6, seed=1) > 0],
        ["S0", "R"],
    ),
    Case(
        "x.masked_fill_(mask, v)",
        _fill_,
        lambda: [randn(5, 6), randn(5, 6, seed=1) > 0],
        ["S1", "S1"],
        inplace=True,
    ),
]


def reproduce(mesh: object) -> str | None:
    """``//`` and ``masked_fill`` with sharded, broadcast and in-place operands vs single-device."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="pointwise_gaps",
    summary="strategies for floor_divide and masked_fill variants (torch 2.9 to 2.11)",
    ops=OPS,
    gate=SpecifierSet(">=2.9,<2.11"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_fix="native strategies or decompositions from torch 2.11 (measured)",
)
