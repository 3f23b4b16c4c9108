"""``isin`` and ``searchsorted`` have no sharding strategy on torch 2.9 to 2.15.

Trigger: ``torch.isin(tokens, stop_ids)`` (stop-token masks), ``torch.searchsorted(edges, x)``
(bucketing rewards or lengths) with DTensor arguments.

Fix: both are elementwise in the queried tensor (``elements`` / ``self``), which keeps any
``Shard(d)`` with no communication; the lookup table (``test_elements`` / a 1-D
``sorted_sequence``) is gathered. ``searchsorted`` with an N-D ``sorted_sequence`` (one table per
row) gathers everything. ``Partial`` inputs are reduced first. No upstream strategy as of 2.15
for ``searchsorted``; ``isin`` on a sharded test set measured failing on every release.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.strategies import (
    replicate_strategy,
    schema_info,
    tensor_meta,
    uniform_strategy,
)


def _isin(op_schema: Any) -> Any:
    return uniform_strategy(op_schema)


def _searchsorted(op_schema: Any) -> Any:
    if len(tensor_meta(op_schema.args_schema[0]).shape) != 1:
        return replicate_strategy(op_schema, driver=1)
    return uniform_strategy(op_schema, driver=1)


def _registrations() -> list[Strategy]:
    flags = schema_info(2, ("assume_unique", "invert"))
    return [
        Strategy("aten.isin.Tensor_Tensor", _isin, flags),
        Strategy("aten.isin.Tensor_Scalar", _isin, flags),
        Strategy(
            "aten.searchsorted.Tensor",
            _searchsorted,
            schema_info(2, ("out_int32", "right", "side", "sorter")),
        ),
    ]


def _tokens() -> torch.Tensor:
    return torch.arange(30).reshape(5, 6) % 7


CASES = [
    Case("isin(x, x)", lambda x, t: torch.isin(x, t), lambda: [_tokens(), _tokens()], ["S0", "S0"]),
    Case(
        "isin(x, ids)",
        lambda x, t: torch.isin(x, t, invert=True),
        lambda: [_tokens(), torch.tensor([1, 3, 5])],
        ["S1", "R"],
    ),
    Case("isin(x, 3)", lambda x: torch.isin(x, 3), lambda: [_tokens()], ["S0"]),
    Case(
        "searchsorted(edges, x)",
        lambda e, x: torch.searchsorted(e, x),
        lambda: [torch.linspace(-2, 2, 9), randn(5, 6)],
        ["R", "S1"],
    ),
    Case(
        "searchsorted(edges, x, right)",
        lambda e, x: torch.searchsorted(e, x, right=True),
        lambda: [torch.linspace(-2, 2, 8), randn(5, 6)],
        ["S0", "S0"],
    ),
    Case(
        "searchsorted(rows, x)",
        lambda e, x: torch.searchsorted(e, x),
        lambda: [torch.sort(randn(4, 6), dim=-1).values, randn(4, 3, seed=1)],
        ["S0", "S0"],
    ),
]


def reproduce(mesh: object) -> str | None:
    """``isin``/``searchsorted`` with sharded queries and sharded or replicated tables."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="isin_searchsorted",
    summary="strategies for isin and searchsorted (torch 2.9 to 2.15)",
    ops=("aten.isin.Tensor_Tensor", "aten.isin.Tensor_Scalar", "aten.searchsorted.Tensor"),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
)
