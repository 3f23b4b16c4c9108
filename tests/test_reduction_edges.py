"""Reductions given an empty dim list (ATen: every dim) on sharded DTensors, the gradients of
``amax()``/``amin()``/``max()``/``min()`` over every dim that autograd computes with them,
divisions by a pending sum, and infinity norms of a pending maximum (``empty_dims_reduce_all``,
``partial_divisor``, ``extremum_partial_norms``): each against the same computation on plain
tensors, with ``apply_all()``. Every rank reports whether its call
raised before any rank reads a result, so a regression fails instead of hanging."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool, raised_on_any_rank


def _grad(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def grad(x: Any) -> Any:
        leaf = x.detach().requires_grad_(True)
        (out,) = torch.autograd.grad(fn(leaf).sum(), leaf)
        return out

    return grad


def _const(x: Any, value: float) -> Any:
    """A 0-d constant beside ``x``: ``Replicate()`` where ``x`` is a DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    out = torch.tensor(value)
    if isinstance(x, DTensor):
        return distribute_tensor(out, x.device_mesh, [Replicate()])
    return out


_TIES = torch.tensor([[3.0, 1.0, 0.0], [0.5, 2.0, 3.0], [3.0, 0.0, 1.0], [1.0, 1.0, -2.0]])

# name -> (full input, the dim placed Shard, the computation)
_USER_CODE: dict[str, tuple[Callable[[], torch.Tensor], int, Callable[[Any], Any]]] = {
    "sum_empty_dims_keepdim": (lambda: torch.randn(4, 3), 0, lambda x: x.sum([], keepdim=True)),
    "sum_empty_dims": (lambda: torch.randn(4, 3), 1, lambda x: torch.sum(x, dim=())),
    "mean_empty_dims": (lambda: torch.randn(4, 6), 1, lambda x: x.mean([])),
    "var_empty_dims": (lambda: torch.randn(4, 3), 0, lambda x: x.var([])),
    "std_empty_dims_keepdim": (lambda: torch.randn(4, 3), 0, lambda x: x.std([], keepdim=True)),
    "var_mean_empty_dims": (lambda: torch.randn(4, 3), 1, lambda x: torch.var_mean(x, [])[1]),
    "norm_empty_dims": (
        lambda: torch.randn(3, 4),
        1,
        lambda x: torch.linalg.vector_norm(x, dim=[], keepdim=True),
    ),
    "count_nonzero_empty_dims": (
        lambda: torch.randn(4, 3).relu(),
        0,
        lambda x: torch.count_nonzero(x, []),
    ),
    # Gradients over every dim: ties split across ranks, and a shard holding no extremum.
    "grad_amax_ties_across_shards": (lambda: _TIES.clone(), 0, _grad(lambda x: x.amax())),
    "grad_max_ties_across_shards": (lambda: _TIES.clone(), 1, _grad(lambda x: x.max())),
    "grad_amin_no_minimum_on_a_shard": (lambda: torch.randn(4, 3), 1, _grad(lambda x: x.amin())),
    "grad_min_1d": (lambda: torch.tensor([1.0, 3.0, -1.0, 0.5]), 0, _grad(lambda x: x.min())),
    "grad_inf_norm": (
        lambda: _TIES.clone(),
        0,
        _grad(lambda x: torch.linalg.vector_norm(x, float("inf"))),
    ),
    # Divisions by a pending sum of more dims than the numerator (wrong on 2.11).
    "scalar_over_pending_sum": (
        lambda: torch.randn(4, 3),
        0,
        lambda x: _const(x, 3.0) / x.sum([0, 1], keepdim=True),
    ),
    "normaliser_of_column_sums": (
        lambda: torch.randn(4, 3).exp(),
        0,
        lambda x: _const(x, 1.0) / x.sum(0),
    ),
    # The largest |value| of a per-column maximum over a sharded dim (pending as a maximum).
    "inf_norm_of_column_maxima": (
        lambda: torch.randn(4, 3) - 2.0,
        0,
        lambda x: torch.linalg.vector_norm(x.amax(0), float("inf")),
    ),
    "neg_inf_norm_of_row_minima": (
        lambda: torch.randn(3, 4) - 2.0,
        1,
        lambda x: torch.linalg.vector_norm(x.amin(1, keepdim=True), -float("inf"), dim=0),
    ),
}


def _against_one_device(name: str) -> tuple[str | None, bool]:
    """(the first rank's error, if any rank raised; value equal to the plain computation)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        make, dim, fn = _USER_CODE[name]
        torch.manual_seed(3)
        full = make()
        mesh = world_mesh()
        x = distribute_tensor(full.clone(), mesh, [Shard(dim)])

        got, raised = raised_on_any_rank(lambda: fn(x))
        if raised is not None:
            return raised, False
        want = fn(full)
        have = got.full_tensor()
        return None, have.shape == want.shape and torch.allclose(have, want, atol=1e-5)
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("name", list(_USER_CODE))
def test_against_one_device(pool2: RankPool, name: str) -> None:
    for error, equal in pool2.run(_against_one_device, name):
        assert error is None, error
        assert equal, name


# name -> (the computation on a Shard(0) x of [64, 256] float32 (64 KiB), the lower bound of
# what it must move to a rank: the reduced values it combines, never x itself)
_BYTES: dict[str, tuple[Callable[[Any], Any], int]] = {
    "sum_empty_dims_keepdim": (lambda x: x.sum([], keepdim=True), 4),
    # The column sums (256 float32), reduced once; then the division is local.
    "scalar_over_column_sums": (lambda x: _const(x, 1.0) / x.sum(0), 256 * 4),
    # The column maxima (256 float32), reduced once; then the norm is local.
    "inf_norm_of_column_maxima": (
        lambda x: torch.linalg.vector_norm(x.amax(0), float("inf")),
        256 * 4,
    ),
    # The maximum and the tie count; then the gradient is local.
    "grad_amax_over_every_dim": (_grad(lambda x: x.amax()), 2 * 4),
}
# Besides the lower bound: a few single numbers (a replicated constant's broadcast, a pending
# scalar read or re-reduced by torch's own backward), never a row of x.
_NUMBERS = 4 * 4


def _bytes_moved(name: str) -> tuple[int, int]:
    """(bytes every collective delivered to this rank, the bound) for ``_BYTES[name]`` under
    ``apply_all()``, a reduced result read whole."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.comm_bytes import CommBytes
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        fn, lower_bound = _BYTES[name]
        x = distribute_tensor(torch.randn(64, 256), world_mesh(), [Shard(0)])
        with CommBytes() as moved:
            out = fn(x)
            if out.numel() < x.numel():
                out.full_tensor()  # a reduced result read whole (a gradient stays sharded)
        return moved.received, lower_bound + _NUMBERS
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("name", list(_BYTES))
def test_bytes_stay_at_the_lower_bound(pool2: RankPool, name: str) -> None:
    for received, bound in pool2.run(_bytes_moved, name):
        assert received <= bound, (name, received, bound)
