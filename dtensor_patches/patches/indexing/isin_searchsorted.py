"""``isin`` and ``searchsorted`` have no sharding strategy on torch 2.9 to 2.15.

Trigger: ``torch.isin(tokens, stop_ids)`` (stop-token masks), ``torch.searchsorted(edges, x)``
(bucketing rewards or lengths) with DTensor arguments.

Fix: both are elementwise in the queried tensor (``elements`` / ``self``), which keeps any
``Shard(d)`` with no communication; the lookup table (``test_elements`` / a 1-D
``sorted_sequence``) is gathered. ``searchsorted`` with an N-D ``sorted_sequence`` (one table per
row) gathers everything. ``Partial`` inputs are reduced first. No upstream strategy as of 2.15
for ``searchsorted``; ``isin`` on a sharded test set measured failing on every release.

``searchsorted`` is a custom handler rather than a strategy because of its keyword-only
``sorter=`` tensor: DTensor redistributes positional tensor arguments to the placements a
strategy asks for but hands keyword tensors to the kernel as their local shards, so a sharded
``sorter`` reached the kernel as a piece of itself (``boundary and sorter must have the same
size``). The handler gathers the table and the sorter and runs the kernel on this rank's shard
of the queried tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import full_tensor, local_tensor
from dtensor_patches.dispatch.gather import replicated_result
from dtensor_patches.dispatch.shards import contiguous_stride
from dtensor_patches.patch import Handler, Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import is_shard, schema_info, uniform_strategy


def _isin(op_schema: Any) -> Any:
    return uniform_strategy(op_schema)


def _searchsorted(op_call: Any, args: Any, kwargs: Any) -> Any:
    """``searchsorted(sorted_sequence, self, *, out_int32, right, side, sorter)`` on DTensors.

    A 1-D table: the output is sharded like ``self`` (its ``Shard`` placements kept, anything
    else reduced or gathered first), from the gathered table and sorter; no other
    communication. An N-D table (one per row): every input gathered, the output replicated.
    """
    from torch.distributed.tensor import DTensor, Replicate

    table, values = args[0], args[1]
    if not isinstance(values, DTensor) or table.ndim != 1:
        return replicated_result(op_call, args, kwargs)
    placements = tuple(p if is_shard(p) else Replicate() for p in values.placements)
    if placements != tuple(values.placements):
        values = values.redistribute(values.device_mesh, placements)
    local = op_call(
        full_tensor(table),
        local_tensor(values),
        *args[2:],
        **{k: full_tensor(v) for k, v in kwargs.items()},
    )
    return DTensor.from_local(
        local,
        values.device_mesh,
        placements,
        run_check=False,
        shape=values.shape,
        stride=contiguous_stride(values.shape),  # the kernel's output is contiguous
    )


def _registrations() -> list[Strategy | Handler]:
    flags = schema_info(2, ("assume_unique", "invert"))
    return [
        Strategy("aten.isin.Tensor_Tensor", _isin, flags),
        Strategy("aten.isin.Tensor_Scalar", _isin, flags),
        Handler("aten.searchsorted.Tensor", _searchsorted),
    ]


def _tokens() -> torch.Tensor:
    return torch.arange(30).reshape(5, 6) % 7


# The tripwire's cases: ``isin``/``searchsorted`` with sharded queries and sharded or replicated tables.
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


def _sorter_table() -> list[torch.Tensor]:
    table = randn(10, seed=3)  # unsorted; ``sorter`` sorts it
    return [table, randn(4, 6, seed=5), torch.argsort(table)]


CASES += [
    Case(
        "searchsorted(t, x, sorter=s) R/S0/R",
        lambda t, x, o: torch.searchsorted(t, x, sorter=o),
        _sorter_table,
        ["R", "S0", "R"],
    ),
    Case(
        "searchsorted(t, x, sorter=s) S0/S1/S0",
        lambda t, x, o: torch.searchsorted(t, x, right=True, sorter=o),
        _sorter_table,
        ["S0", "S1", "S0"],
    ),
]


PATCH = Patch(
    name="isin_searchsorted",
    summary="strategies for isin and searchsorted (torch 2.9 to 2.15)",
    ops=("aten.isin.Tensor_Tensor", "aten.isin.Tensor_Scalar", "aten.searchsorted.Tensor"),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    communication="the lookup table (and sorter) is gathered",
)
