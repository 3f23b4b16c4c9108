"""Max/min-type reductions over a sharded dim that leaves a rank's shard empty (a batch of one
row on two ranks): stock torch raises on that rank only and the others hang in the reduction;
with ``apply_all()`` every rank gets the single-device value (empty_shard_extrema, and
argmax_all for ``argmax``/``argmin``). Each rank reports whether its call raised before any
rank reads the result, so a regression fails instead of hanging."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool, raised_on_any_rank


def _out(x: Any, *shape: int, dtype: torch.dtype | None = None) -> Any:
    """An ``out=`` tensor for a result of ``shape``: ``Replicate()`` beside a DTensor ``x``."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    out = torch.full(shape, -7.0, dtype=dtype or x.dtype)
    if isinstance(x, DTensor):
        return distribute_tensor(out, x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return out


def _both(pair: Any) -> Any:
    """Values and indices (or minima and maxima) in one tensor, to compare them together."""
    first, second = pair
    return torch.cat([first.reshape(-1), second.reshape(-1).to(first.dtype)])


# name -> (full shape, the dim placed Shard, the computation).
_USER_CODE: dict[str, tuple[tuple[int, ...], int, Callable[[Any], Any]]] = {
    "amax_over_batch": ((1, 5), 0, lambda x: x.amax(0)),
    "amin_everything": ((1, 5), 0, lambda x: x.amin()),
    "max_everything": ((1, 5), 0, lambda x: x.max()),
    "min_everything": ((1, 3, 4), 0, lambda x: x.min()),
    "amax_over_two_dims": ((1, 3, 4), 0, lambda x: x.amax(dim=(0, 2))),
    "inf_norm_over_batch": ((1, 5), 0, lambda x: torch.linalg.vector_norm(x, math.inf, dim=0)),
    "argmax_over_batch": ((1, 5), 0, lambda x: x.argmax(0)),
    "argmin_over_batch_keepdim": ((1, 3, 4), 0, lambda x: x.argmin(0, keepdim=True)),
    "foreach_max_of_gradients": (
        (1, 5),
        0,
        lambda x: torch.stack(torch._foreach_max([x, x * 2])),
    ),
    "amax_no_empty_shard": ((3, 5), 0, lambda x: x.amax(0)),
    # Values and indices along the dim (torch's own handler on 2.11 raised on the empty rank).
    "max_values_and_indices": ((1, 5), 0, lambda x: _both(torch.max(x, 0))),
    "min_values_and_indices_keepdim": ((1, 3, 4), 0, lambda x: _both(x.min(0, keepdim=True))),
    "aminmax_over_batch": ((1, 5), 0, lambda x: _both(torch.aminmax(x, dim=0))),
    # The out= overloads: the result is read back from the out tensor.
    "amax_into_out": ((1, 5), 0, lambda x: (torch.amax(x, 0, out=(o := _out(x, 5))), o)[1]),
    "amin_keepdim_into_out_size_one_dim": (
        (3, 2, 1, 2),
        2,
        lambda x: (torch.amin(x, 2, keepdim=True, out=(o := _out(x, 3, 2, 1, 2))), o)[1],
    ),
    "max_everything_into_out": ((1, 5), 0, lambda x: (torch.max(x, out=(o := _out(x))), o)[1]),
    "min_everything_into_out": ((1, 3, 4), 0, lambda x: (torch.min(x, out=(o := _out(x))), o)[1]),
    "aminmax_into_out": (
        (1, 5),
        0,
        lambda x: _both(torch.aminmax(x, dim=0, out=(_out(x, 5), _out(x, 5)))),
    ),
    "inf_norm_into_out": (
        (1, 5),
        0,
        lambda x: (torch.linalg.vector_norm(x, math.inf, dim=0, out=(o := _out(x, 5))), o)[1],
    ),
    "max_values_and_indices_into_out": (
        (1, 5),
        0,
        lambda x: _both(torch.max(x, 0, out=(_out(x, 5), _out(x, 5, dtype=torch.long)))),
    ),
}


def _against_one_device(
    name: str, mesh_shape: tuple[int, ...] = (2,), rows: int | None = None
) -> tuple[str | None, bool]:
    """(the first rank's error, if any rank raised; value equal to the plain op's). On a 2-D
    ``mesh_shape`` the dim is sharded over every mesh dim in turn (``[Shard(d), Shard(d)]``),
    ``rows`` long where given."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import grid_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        shape, dim, fn = _USER_CODE[name]
        if rows is not None:
            shape = tuple(rows if d == dim else n for d, n in enumerate(shape))
        full = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
        mesh = grid_mesh(mesh_shape)
        x = distribute_tensor(full.clone(), mesh, [Shard(dim)] * mesh.ndim)
        got, raised = raised_on_any_rank(lambda: fn(x))
        if raised is not None:
            return raised, False
        return None, torch.equal(got.full_tensor(), fn(full))
    finally:
        dtensor_patches.revert_all()


# On a 2x2 mesh with the reduced dim sharded over both mesh dims (nested shards: 2 rows give
# 1, 0, 1, 0; 3 rows give 1, 1, 1, 0), where a check of each mesh dim alone sees no empty shard.
_NESTED = ["amax_over_batch", "max_values_and_indices", "argmax_over_batch", "amax_into_out"]


@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("name", _NESTED)
def test_extrema_over_nested_shards_on_a_2x2_mesh(pool4: RankPool, name: str, rows: int) -> None:
    for error, equal in pool4.run(_against_one_device, name, (2, 2), rows):
        assert error is None, error
        assert equal, name


@pytest.mark.parametrize("name", list(_USER_CODE))
def test_extrema_over_an_empty_shard(pool2: RankPool, name: str) -> None:
    for error, equal in pool2.run(_against_one_device, name):
        assert error is None, error
        assert equal, name


def _amax_gradient() -> bool:
    """``x.amax(0).sum().backward()`` on a ``[1, 5]`` ``Shard(0)`` x: the single-device
    gradient."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        full = torch.randn(1, 5, generator=torch.Generator().manual_seed(3))
        plain = full.clone().requires_grad_(True)
        plain.amax(0).sum().backward()
        x = distribute_tensor(full.clone(), world_mesh(), [Shard(0)]).requires_grad_(True)
        x.amax(0).sum().backward()
        return torch.allclose(x.grad.full_tensor(), plain.grad)
    finally:
        dtensor_patches.revert_all()


def test_gradient_of_amax_over_an_empty_shard(pool2: RankPool) -> None:
    assert all(pool2.run(_amax_gradient))
