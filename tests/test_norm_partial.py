"""Norms over a sharded dim, then an op that combines them (norm_partial_reduced_first): what
users write (a weight-norm regulariser on a TP-sharded weight, per-row norms averaged or summed
in float64), values and gradients against the same computation on one device, and the bytes
moved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool

# name -> computation on x (rows, features), x sharded on features (the norm's dim).
_USER_CODE: dict[str, Callable[[Any], Any]] = {
    "row_norms_summed": lambda x: torch.linalg.vector_norm(x, dim=-1).sum(),
    "weight_norm_regulariser": lambda x: 0.01 * x.norm(dim=1).sum(),
    "row_norms_mean": lambda x: x.norm(p=2, dim=-1).mean(),
    "scaled_then_summed": lambda x: (torch.linalg.vector_norm(x, dim=-1) * 2.0).sum(),
    "float64_sum": lambda x: torch.linalg.vector_norm(x, dim=-1).to(torch.float64).sum(),
    "l1_norms_summed_over_rows": lambda x: torch.linalg.vector_norm(x, ord=1, dim=-1).sum(0),
    "norm_of_norms": lambda x: torch.linalg.vector_norm(torch.linalg.vector_norm(x, dim=-1)),
    "normalize": lambda x: torch.nn.functional.normalize(x, dim=-1).sum(),
}


def _against_one_device(name: str, patched: bool, backward: bool = True) -> tuple[bool, bool]:
    """(value equal, gradient equal or not run) of ``name`` on a ``Shard(1)`` DTensor vs plain
    tensors."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    if patched:
        dtensor_patches.apply_all()
    try:
        mesh = world_mesh()
        fn = _USER_CODE[name]
        full = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
        plain = full.clone().requires_grad_(True)
        expected = fn(plain)
        expected.backward()
        x = distribute_tensor(full.clone(), mesh, [Shard(1)]).requires_grad_(True)
        got = fn(x)
        value = torch.allclose(got.full_tensor().to(expected.dtype), expected.detach(), atol=1e-5)
        if not backward:
            return value, True
        got.backward()
        grad = torch.allclose(x.grad.full_tensor(), plain.grad, atol=1e-5)
        return value, grad
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("name", list(_USER_CODE))
def test_norms_of_sharded_rows_then_combined(pool2: RankPool, name: str) -> None:
    for value, grad in pool2.run(_against_one_device, name, True):
        assert value, name
        assert grad, name


def test_stock_torch_sums_pending_norms_as_sums(pool2: RankPool) -> None:
    """The bug the patch exists for: stock torch sums the shards' norms inside the patch's
    gate, and is right outside it (the forward only: 2.9 has no strategy for the norm's
    backward, ``masked_fill_``)."""
    from dtensor_patches.patches.reductions import norm_partial_reduced_first

    in_gate = norm_partial_reduced_first.PATCH.applies_to()
    for value, _ in pool2.run(_against_one_device, "row_norms_summed", False, False):
        assert value is not in_gate


def _bytes_of_row_norms_summed() -> tuple[int, int]:
    """(bytes every collective delivered to this rank, the largest single one) for
    ``vector_norm(x, dim=-1).sum()`` of a ``Shard(1)`` x [64, 32] float32, under
    ``apply_all()``, result read whole."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.comm_bytes import CommBytes
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        x = distribute_tensor(torch.randn(64, 32), world_mesh(), [Shard(1)])
        with CommBytes() as moved:
            torch.linalg.vector_norm(x, dim=-1).sum().full_tensor()
        return moved.received, moved.largest
    finally:
        dtensor_patches.revert_all()


def test_pending_norms_are_reduced_once_and_small(pool2: RankPool) -> None:
    """The lower bound: the per-row norms (64 float32, 256 bytes) are combined across ranks
    once; the [64, 32] input (8 KiB) never moves."""
    for received, largest in pool2.run(_bytes_of_row_norms_summed):
        assert largest <= 64 * 4, largest
        assert received <= 64 * 4 + 4, received


def _in_place_on_pending_norms(factor: float) -> bool:
    """``n.mul_(factor)`` then ``n.sum()`` on the pending per-row norms of a ``Shard(1)`` x:
    equal to the plain computation (a negative factor is not linear for a p-norm)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        full = torch.randn(5, 6, generator=torch.Generator().manual_seed(5))
        x = distribute_tensor(full, world_mesh(), [Shard(1)])
        n = torch.linalg.vector_norm(x, dim=-1)
        n.mul_(factor)
        expected = torch.linalg.vector_norm(full, dim=-1) * factor
        return torch.allclose(n.full_tensor(), expected, atol=1e-5) and torch.allclose(
            n.sum().full_tensor(), expected.sum(), atol=1e-5
        )
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("factor", [-1.0, 0.5])
def test_in_place_scaling_of_pending_norms(pool2: RankPool, factor: float) -> None:
    assert all(pool2.run(_in_place_on_pending_norms, factor))
