"""Gaps we know of and leave alone (listed in the README). Each test asserts the gap is still
there, so the day torch fixes it this fails and the README and the oracle get updated."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from dtensor_patches.testing import RankError, RankPool


def _cumprod_backward() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]).requires_grad_()
    with dtensor_patches.patched():
        torch.cumprod(x, 1).sum().backward()


def test_cumprod_gradient_mixes_plain_tensors(pool2: RankPool) -> None:
    # Autograd's cumprod backward (FunctionsManual.cpp) builds plain tensors and feeds them to
    # DTensor ops (aten.cat on 2.9, aten.where on 2.13): no sharding strategy can intercept it.
    # Measured: fixed in torch 2.14 (2.14.1 and 2.15.0 run the backward).
    from dtensor_patches._torch.versions import torch_release

    if torch_release() >= Version("2.14"):
        pool2.run(_cumprod_backward)
        return
    with pytest.raises(RankError, match=r"mixed torch\.Tensor and DTensor"):
        pool2.run(_cumprod_backward)
