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

from dtensor_patches.testing import RankPool

# name -> (full shape, the computation); x is placed Shard(0).
_USER_CODE: dict[str, tuple[tuple[int, ...], Callable[[Any], Any]]] = {
    "amax_over_batch": ((1, 5), lambda x: x.amax(0)),
    "amin_everything": ((1, 5), lambda x: x.amin()),
    "max_everything": ((1, 5), lambda x: x.max()),
    "min_everything": ((1, 3, 4), lambda x: x.min()),
    "amax_over_two_dims": ((1, 3, 4), lambda x: x.amax(dim=(0, 2))),
    "inf_norm_over_batch": ((1, 5), lambda x: torch.linalg.vector_norm(x, math.inf, dim=0)),
    "argmax_over_batch": ((1, 5), lambda x: x.argmax(0)),
    "argmin_over_batch_keepdim": ((1, 3, 4), lambda x: x.argmin(0, keepdim=True)),
    "foreach_max_of_gradients": ((1, 5), lambda x: torch.stack(torch._foreach_max([x, x * 2]))),
    "amax_no_empty_shard": ((3, 5), lambda x: x.amax(0)),
}


def _against_one_device(name: str) -> tuple[str | None, bool]:
    """(the first rank's error, if any rank raised; value equal to the plain op's)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        shape, fn = _USER_CODE[name]
        full = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
        x = distribute_tensor(full.clone(), world_mesh(), [Shard(0)])
        error = None
        try:
            got = fn(x)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        raised = next((e for e in errors if e is not None), None)
        if raised is not None:
            return raised, False
        return None, torch.equal(got.full_tensor(), fn(full))
    finally:
        dtensor_patches.revert_all()


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
