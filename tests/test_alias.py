"""The alias patch on a real 2-rank CPU gloo mesh, against single-device results."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtensor_patches.testing import RankPool


def _alias_results() -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import dtensor_patches

    alias = dtensor_patches.get("alias")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    stock = alias.reproduce_on(mesh)
    out: dict[str, object] = {"in_gate": alias.applies_to(), "stock": stock}
    with dtensor_patches.patched(only=["alias"]):
        out["patched"] = alias.reproduce_on(mesh)
        torch.manual_seed(0)
        full = torch.randn(5, 6, 3)  # 5 rows on 2 ranks: uneven Shard(0)
        checks = {}
        for placement in (Shard(0), Shard(1), Shard(2), Replicate()):
            dx = distribute_tensor(full, mesh, [placement])
            y = torch.ops.aten.alias.default(dx)
            sliced = dx[:, :6, :]
            checks[str(placement)] = (
                tuple(y.placements) == (placement,)
                and torch.equal(y.full_tensor(), full)
                and torch.equal(sliced.full_tensor(), full)
            )
        # A Partial input stays Partial: alias must not reduce it.
        share = full / dist.get_world_size()
        partial = DTensor.from_local(share, mesh, [Partial()], run_check=False)
        y = torch.ops.aten.alias.default(partial)
        checks["Partial"] = isinstance(y.placements[0], Partial) and torch.allclose(
            y.full_tensor(), full
        )
        # Gradients flow through the whole-dim slice like through the plain tensor.
        w = distribute_tensor(full.clone(), mesh, [Shard(1)]).requires_grad_()
        (w[:, :6, :] * 2).sum().backward()
        checks["grad"] = torch.equal(w.grad.full_tensor(), torch.full_like(full, 2.0))
        out["checks"] = checks
    out["after_revert"] = alias.reproduce_on(mesh)
    return out


def test_alias_patch_matches_single_device(pool2: RankPool) -> None:
    for rank_result in pool2.run(_alias_results):
        in_gate = rank_result["in_gate"]
        # Stock torch has the bug exactly where the gate says (torch 2.9).
        assert (rank_result["stock"] is not None) is in_gate
        if in_gate:
            assert "aten.alias.default" in str(rank_result["stock"])
        assert rank_result["patched"] is None
        assert rank_result["checks"] == {
            "S(0)": True,
            "S(1)": True,
            "S(2)": True,
            "R": True,
            "Partial": True,
            "grad": True,
        }
        # revert() restored the registry and cleared the caches: stock behaviour is back.
        assert rank_result["after_revert"] == rank_result["stock"]
