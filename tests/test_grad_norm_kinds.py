"""Gradient norms over DTensors of several meshes beside plain tensors (issue 23, item 14).

A plain gradient beside DTensor gradients may be the same on every rank (a parameter left out
of TP) or each rank's own (FSDP2 ``ignored_params``, whose gradients nobody reduces). Either
way every rank must get the one global norm, or ``clip_grad_norm_`` scales the shards of one
DTensor by different coefficients. Compared with the same norm on one device: the
concatenation of every DTensor's full value and, for per-rank plain gradients, every rank's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtensor_patches.testing import RankPool


def _case(norm_type: float, per_rank: bool, reading: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.dispatch.mixed import total_norm

    n, rank = dist.get_world_size(), dist.get_rank()
    mesh1 = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    mesh2 = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(5, 3, generator=g), torch.randn(3, 4, generator=g)
    plains = [torch.randn(4, generator=g) * 3 for _ in range(n)]
    mine = plains[rank] if per_rank else plains[0]
    with dtensor_patches.patched():
        pa = torch.nn.Parameter(distribute_tensor(a.clone(), mesh1, [Shard(0)]))
        pb = torch.nn.Parameter(distribute_tensor(b.clone(), mesh2, [Shard(1)]))
        pc = torch.nn.Parameter(torch.zeros(4))
        pa.grad = distribute_tensor(a.clone(), mesh1, [Shard(0)])
        pb.grad = distribute_tensor(b.clone(), mesh2, [Shard(1)])
        pc.grad = mine.clone()
        grads = [pa.grad, pb.grad, pc.grad]
        if reading == "torch":
            norm = torch.nn.utils.get_total_norm(grads, norm_type)
        else:
            norm = total_norm(grads, norm_type, plain=reading)  # type: ignore[arg-type]
        clipped = torch.nn.utils.clip_grad_norm_([pa, pb, pc], 0.5, norm_type)
        grad_a = pa.grad.full_tensor()
    counted = plains if per_rank else plains[:1]
    if reading == "replicated":
        counted = [mine]
    flat = torch.cat([a.flatten(), b.flatten(), *counted])
    expected = torch.linalg.vector_norm(flat, norm_type)
    every_rank = [torch.zeros(()) for _ in range(n)]
    dist.all_gather(every_rank, norm.detach().reshape(()).clone())
    return {
        "norm": float(norm),
        "expected": float(expected),
        "same_on_every_rank": all(bool(v == every_rank[0]) for v in every_rank),
        "clipped_norm": float(clipped),
        # One coefficient for every shard: the gathered gradient is a scaled copy of `a`.
        "grad_a_scaled_uniformly": bool(
            torch.allclose(grad_a, a * (grad_a.flatten()[0] / a.flatten()[0]), atol=1e-6)
        ),
    }


@pytest.mark.parametrize("norm_type", [1.0, 2.0, float("inf")])
@pytest.mark.parametrize("per_rank", [False, True], ids=["replicated", "per_rank"])
def test_plain_grads_beside_two_meshes(pool2: RankPool, norm_type: float, per_rank: bool) -> None:
    for row in pool2.run(_case, norm_type, per_rank, "torch"):
        assert row["same_on_every_rank"], row
        assert row["norm"] == pytest.approx(row["expected"], rel=1e-5), row
        assert row["clipped_norm"] == pytest.approx(row["expected"], rel=1e-5), row
        assert row["grad_a_scaled_uniformly"], row


def test_the_caller_can_say_which_reading(pool2: RankPool) -> None:
    # "per_rank" on replicated grads counts each rank's copy; "replicated" on per-rank ones
    # takes this rank's: both readings are the caller's word, computed exactly.
    for row in pool2.run(_case, 2.0, False, "per_rank"):
        assert row["norm"] > row["expected"] * 1.01, row
    for row in pool2.run(_case, 2.0, True, "replicated"):
        assert row["norm"] == pytest.approx(row["expected"], rel=1e-5), row


def test_unknown_reading_is_refused() -> None:
    from dtensor_patches.dispatch.mixed import total_norm

    with pytest.raises(ValueError, match="plain must be"):
        total_norm([torch.ones(2)], plain="sometimes")  # type: ignore[arg-type]


def _float64_case() -> dict[str, Any]:
    """A float64 TP model (a ``Shard`` weight and a sequence-parallel ``Partial`` gradient)
    clipped with torch's own ``clip_grad_norm_`` after ``apply_all()``: the norm in float64,
    as torch gives it on one device."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    mesh, rank = world_mesh(), dist.get_rank()
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(3, generator=g)
    b = b.double()
    with dtensor_patches.patched():
        pw = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
        pb = torch.nn.Parameter(distribute_tensor(torch.zeros_like(b), mesh, [Shard(0)]))
        pw.grad = distribute_tensor(w.clone(), mesh, [Shard(0)])
        pb.grad = DTensor.from_local(b * (rank + 1) / 3, mesh, [Partial()], run_check=False)
        norm = torch.nn.utils.clip_grad_norm_([pw, pb], max_norm=0.5)
        clipped = [pw.grad.full_tensor(), pb.grad.full_tensor()]
    refs = [torch.nn.Parameter(torch.zeros_like(w)), torch.nn.Parameter(torch.zeros_like(b))]
    refs[0].grad, refs[1].grad = w.clone(), b.clone()
    ref = torch.nn.utils.clip_grad_norm_(refs, max_norm=0.5)  # the single device
    return {
        "dtype": str(norm.dtype),
        "norm": float(norm.full_tensor() if isinstance(norm, DTensor) else norm),
        "expected": float(ref),
        "clipped": all(
            torch.allclose(c, r.grad, rtol=1e-12) for c, r in zip(clipped, refs, strict=True)
        ),
    }


def test_float64_gradients_clipped_by_torch_own_call(pool2: RankPool) -> None:
    """float64 gradients were refused (``vector_norm`` will not narrow float64 to the float32
    it summed in); now their norm is float64, equal to the single device's."""
    for rank, r in enumerate(pool2.run(_float64_case)):
        assert r["dtype"] == "torch.float64", (rank, r)
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-12), (rank, r)
        assert r["clipped"], (rank, r)
