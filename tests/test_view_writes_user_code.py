"""Writes through views that DTensor has to redistribute, as model code writes them (issue 18):
the padding row of a row-sharded embedding zeroed at init, the first rows of a sharded weight
overwritten from a plain source, ``x[1:3].copy_(v)``, ``out=`` into a row. Each is compared with
the single-device program on 2 ranks, 4 ranks and a 2x2 mesh; on every release 2.9 to 2.15
(on 2.10/2.11 through the tracked view's ``__torch_function__``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool

PAD = 3


def _programs(w: torch.Tensor, src: torch.Tensor) -> None:
    """What the model code does, on a plain tensor or a DTensor ``w`` alike."""
    with torch.no_grad():
        torch.nn.init.zeros_(w[PAD])  # the padding embedding row
        w[:2].copy_(src)  # the first rows from a (replicated) source
        w[5:7].fill_(0.25)
        w[4].mul_(-1.0)
        torch.add(w[1], 1.0, out=w[6])


def _source() -> torch.Tensor:
    return torch.linspace(-1, 1, 12).reshape(2, 6)


def _weight() -> torch.Tensor:
    return torch.randn(9, 6, generator=torch.Generator().manual_seed(1))


def _on_rank(mesh_shape: tuple[int, ...], module: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_patches import patched
    from dtensor_patches.testing import spec_disagreement

    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(0)]
    with patched():
        if module:  # an nn.Embedding whose weight the TP plan shards by rows
            from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

            emb = torch.nn.Embedding(9, 6)
            with torch.no_grad():
                emb.weight.copy_(_weight())
            parallelize_module(emb, mesh, RowwiseParallel())
            w = emb.weight
        else:
            w = distribute_tensor(_weight(), mesh, placements)
        src = distribute_tensor(_source(), mesh, [Replicate()] * mesh.ndim)
        _programs(w, src)
        return {"spec": spec_disagreement(w), "full": w.full_tensor().detach()}


@pytest.mark.parametrize("module", [False, True], ids=["dtensor", "rowwise-embedding"])
def test_writes_through_views_on_two_ranks(pool2: RankPool, module: bool) -> None:
    _check(pool2.run(_on_rank, (2,), module))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d-4", "2x2"])
def test_writes_through_views_on_four_ranks(pool4: RankPool, mesh_shape: tuple[int, ...]) -> None:
    _check(pool4.run(_on_rank, mesh_shape, False))


def _check(results: list[dict[str, Any]]) -> None:
    expected = _weight()
    _programs(expected, _source())
    for got in results:
        assert got["spec"] is None, got["spec"]
        torch.testing.assert_close(got["full"], expected)
