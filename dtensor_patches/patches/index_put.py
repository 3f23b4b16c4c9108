"""Indexed writes into a sharded DTensor fail on every release 2.9 to 2.15.

Trigger: ``x.index_put_((idx,), v)`` / ``x[idx] = v`` / ``x.index_put_(..., accumulate=True)``
with ``x`` sharded on an indexed dim (scattering per-token values into a sharded buffer).

Fix: a custom handler (``dtensor_patches.handlers.inplace_through_full``): the write is applied
to the gathered tensor and each rank copies its own shard of the result back into the caller's
local tensor, so ``x`` changes in place, keeps its placements, and no write that lands on
another rank's shard is lost. The out-of-place ``index_put`` returns the same values,
``Replicate()``.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.handlers import inplace_through_full, replicated_result
from dtensor_patches.patch import Handler, Patch


def _registrations() -> list[Handler]:
    return [
        Handler("aten.index_put_.default", inplace_through_full),
        Handler("aten._index_put_impl_.default", inplace_through_full),
        Handler("aten.index_put.default", replicated_result),
    ]


def _idx() -> torch.Tensor:
    return torch.tensor([0, 3, 4, 3])


def _put(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return x.index_put_((_idx(),), v)


def _accumulate(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return x.index_put_((_idx(),), v, accumulate=True)


def _setitem(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    x[:, torch.tensor([1, 5])] = v
    return x


CASES = [
    Case(
        "x.index_put_((idx,), v)",
        _put,
        lambda: [randn(5, 6), randn(4, 6, seed=1)],
        ["S0", "R"],
        inplace=True,
    ),
    Case(
        "index_put_(accumulate)",
        _accumulate,
        lambda: [randn(5, 6), randn(4, 6, seed=1)],
        ["S0", "R"],
        inplace=True,
    ),
    Case(
        "x[:, idx] = v",
        _setitem,
        lambda: [randn(5, 6), randn(5, 2, seed=1)],
        ["S1", "R"],
        inplace=True,
    ),
    Case(
        "index_put",
        lambda x, v: torch.index_put(x, (_idx(),), v),
        lambda: [randn(5, 6), randn(4, 6, seed=1)],
        ["S0", "R"],
    ),
]


def reproduce(mesh: object) -> str | None:
    """Indexed writes into a sharded dim; the caller's tensor is compared after the write."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="index_put",
    summary="index_put_/index_put into sharded dims, in place, nothing lost",
    ops=("aten.index_put_.default", "aten._index_put_impl_.default", "aten.index_put.default"),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    replicates=True,
    overrides_existing=True,
)
