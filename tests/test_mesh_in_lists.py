"""Calls whose DTensors all sit in a list or in ``out=`` (issue 18): a factory writing into a
DTensor, ``block_diag`` of DTensors, ``einsum`` under ``inference_mode``, as model and eval code
writes them, against plain tensors, on 2 ranks and a 2x2 mesh, after ``apply_all()`` (torch 2.9
and 2.10 find no mesh for them without it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool


def _plain() -> dict[str, torch.Tensor]:
    a = torch.arange(12.0).reshape(4, 3) / 5
    b = torch.linspace(-1, 1, 12).reshape(4, 3)
    return {
        "zeros_out": torch.zeros(4, 3),
        "arange_out": torch.arange(8.0),
        "block_diag": torch.block_diag(a, b),
        "einsum": torch.einsum("ij,kj->ik", a, b),
        "a": a,
        "b": b,
    }


def _on_rank(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_patches import patched
    from dtensor_patches.testing import spec_disagreement

    plain = _plain()
    mesh = init_device_mesh("cpu", mesh_shape)
    rows = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(0)]
    out: dict[str, Any] = {}
    with patched():
        a = distribute_tensor(plain["a"], mesh, rows)
        b = distribute_tensor(plain["b"], mesh, rows)
        target = distribute_tensor(torch.ones(4, 3), mesh, rows)
        torch.zeros(4, 3, out=target)  # reset a buffer in place
        out["zeros_out"] = target.full_tensor()
        steps = distribute_tensor(torch.empty(8), mesh, rows)
        torch.arange(8.0, out=steps)
        out["arange_out"] = steps.full_tensor()
        out["block_diag"] = torch.block_diag(a, b).full_tensor()
        with torch.inference_mode():  # eval code: einsum reaches DTensor undecomposed
            out["einsum"] = torch.einsum("ij,kj->ik", a, b).full_tensor()
        out["specs"] = [spec_disagreement(t) for t in (target, steps)]
    return out


@pytest.mark.parametrize("mesh_shape", [(2,)], ids=["1d-2"])
def test_dtensors_only_in_lists_or_out_on_two_ranks(
    pool2: RankPool, mesh_shape: tuple[int, ...]
) -> None:
    _check(pool2.run(_on_rank, mesh_shape))


def test_dtensors_only_in_lists_or_out_on_a_2d_mesh(pool4: RankPool) -> None:
    _check(pool4.run(_on_rank, (2, 2)))


def _check(results: list[dict[str, Any]]) -> None:
    plain = _plain()
    for got in results:
        assert got["specs"] == [None, None]
        for key in ("zeros_out", "arange_out", "block_diag", "einsum"):
            torch.testing.assert_close(got[key], plain[key], msg=key)
