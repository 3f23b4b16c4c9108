"""Gaps we know of and leave alone (listed in the README). Each test asserts the gap is still
there, so the day torch fixes it this fails and the README and the oracle get updated."""

from __future__ import annotations

import torch

from dtensor_patches.testing import RankPool


def _cumprod_backward() -> float:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    plain = full.clone().requires_grad_()
    torch.cumprod(plain, 1).sum().backward()
    x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    with dtensor_patches.patched():
        torch.cumprod(x, 1).sum().backward()
    assert x.grad is not None and plain.grad is not None
    return float((x.grad.full_tensor() - plain.grad).abs().max())


def test_cumprod_gradient_mixes_plain_tensors(pool2: RankPool) -> None:
    # Autograd's cumprod backward (FunctionsManual.cpp) builds plain tensors and feeds them to
    # DTensor ops (aten.cat on 2.9, aten.where on 2.13); stock torch refuses them up to 2.13
    # (measured: 2.14.1 and 2.15.0 run the backward). They hold the same values on every rank,
    # so the checked reading of plain tensors (issue 18) takes them as Replicate() and the
    # gradient is the single device's on every release.
    for diff in pool2.run(_cumprod_backward):
        assert diff < 1e-5, diff
