"""Tensors empty along one dim, sharded unevenly along another (``[3, 0]`` over 2 ranks; a
``[5, 1]`` weight laid out ``[Shard(1), Shard(0)]`` on a 2x2 mesh, which leaves two ranks an
empty column): distributing, gathering, resharding and computing on them give the
single-device result with ``apply_all()`` on every release. On 2.9 stock torch's padding
raised on the ranks with an empty shard and the others hung (empty_shard_padding). Each rank
reports whether it raised before any rank reads a result, so a regression fails instead of
hanging."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool, raised_on_any_rank


def _full(t: Any) -> torch.Tensor:
    """The whole value of ``t`` (a DTensor gathered; a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _resharded(t: Any, dim: int) -> Any:
    """``t`` redistributed to ``Shard(dim)`` (a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor, Shard

    return t.redistribute(t.device_mesh, [Shard(dim)]) if isinstance(t, DTensor) else t


# name -> (full shape, placements per mesh dim as "S<d>"/"R", the computation).
_CASES: dict[str, tuple[tuple[int, ...], tuple[str, ...], Callable[[Any], Any]]] = {
    "gather_of_empty_columns": ((3, 0), ("S0",), lambda x: x),
    "sum_over_rows_of_empty_columns": ((3, 0), ("S0",), lambda x: x.sum(0)),
    "reshard_rows_of_empty_columns": ((5, 0, 2), ("S0",), lambda x: _resharded(x, 2)),
    "nested_weight_gathered": ((5, 1), ("S1", "S0"), lambda x: x),
    "nested_weight_plus_one": ((5, 1), ("S1", "S0"), lambda x: x + 1),
    "nested_weight_expanded": ((5, 1), ("S1", "S0"), lambda x: x.expand(5, 4)),
    "nested_weight_times_itself": ((5, 1), ("S1", "S0"), lambda x: x * x),
    "nested_rows_of_empty_columns": ((4, 0), ("S0", "S0"), lambda x: x),
}


def _against_one_device(name: str, mesh_shape: tuple[int, ...]) -> tuple[str | None, bool]:
    """(the first rank's error, if any rank raised; whether the result equals the plain
    computation's)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import grid_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        shape, layout, fn = _CASES[name]
        full = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
        mesh = grid_mesh(mesh_shape)
        placements = [Replicate() if p == "R" else Shard(int(p[1:])) for p in layout]
        want = fn(full.clone())
        got, raised = raised_on_any_rank(
            lambda: _full(fn(distribute_tensor(full, mesh, placements)))
        )
        if raised is not None:
            return raised, False
        return None, got.shape == want.shape and torch.equal(got, want)
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("name", [n for n, c in _CASES.items() if len(c[1]) == 1])
def test_empty_along_another_dim_on_two_ranks(pool2: RankPool, name: str) -> None:
    for error, equal in pool2.run(_against_one_device, name, (2,)):
        assert error is None, error
        assert equal, name


@pytest.mark.parametrize("name", [n for n, c in _CASES.items() if len(c[1]) == 2])
def test_nested_shards_with_an_empty_rank_on_a_2x2_mesh(pool4: RankPool, name: str) -> None:
    for error, equal in pool4.run(_against_one_device, name, (2, 2)):
        assert error is None, error
        assert equal, name
