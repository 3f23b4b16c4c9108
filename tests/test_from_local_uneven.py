"""Local tensors of uneven shards turned back into DTensors with ``DTensor.from_local`` (issue
18), written as RL code writes them: per-rank token log-probs re-wrapped for a metric, an EMA
kept on the local shards of a parameter whose rows do not divide by the mesh, a differentiable
re-wrap. Each result is checked for the ranks' agreement on the global spec
(``spec_disagreement``) and compared with the same computation on the plain tensor, on 2 ranks
and a 2x2 mesh."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool


def _full(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) / 7 - 1


def _wrap_chunks(rows: int, cols: int, dim: int, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """Rank r holds torch.chunk's part r of the full tensor along ``dim`` (2x2: rows over
    mesh dim 0, columns over mesh dim 1) and wraps it with ``from_local`` without ``shape=``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from dtensor_patches import patched
    from dtensor_patches.testing import spec_disagreement

    full = _full(rows, cols)
    mesh = init_device_mesh("cpu", mesh_shape)
    coords = mesh.get_coordinate()
    # (tensor dim, mesh dim) pairs that shard, outermost first
    cuts = [(dim, 0)] if len(mesh_shape) == 1 else [(0, 0)] + ([(1, 1)] if dim == 1 else [])
    local, offset = full, [0, 0]
    for tensor_dim, mesh_dim in cuts:
        chunks = torch.chunk(local, mesh_shape[mesh_dim], tensor_dim)
        offset[tensor_dim] += sum(c.shape[tensor_dim] for c in chunks[: coords[mesh_dim]])
        local = chunks[coords[mesh_dim]] if coords[mesh_dim] < len(chunks) else local[:0]
    placements: list[Any] = [Replicate()] * len(mesh_shape)
    for tensor_dim, mesh_dim in cuts:
        placements[mesh_dim] = Shard(tensor_dim)
    leaf = local.clone().requires_grad_()
    with patched():
        x = DTensor.from_local(leaf, mesh, placements)
        out: dict[str, Any] = {"spec": spec_disagreement(x), "shape": tuple(x.shape)}
        out["full"] = x.full_tensor().detach()
        out["sum0"] = x.sum(0).full_tensor().detach()
        out["mean"] = x.mean().full_tensor().detach()
        out["replicated"] = x.redistribute(mesh, [Replicate()] * mesh.ndim).to_local().detach()
        (x.sum(1) ** 2).sum().backward()
    out["leaf_grad"], out["local"], out["offset"] = leaf.grad, local, tuple(offset)
    return out


@pytest.mark.parametrize(
    ("rows", "cols", "dim"),
    [(5, 3, 0), (4, 3, 0), (3, 5, 1), (1, 4, 0)],
    ids=["rows-5", "rows-4-even", "cols-5", "rows-1-empty-last-shard"],
)
def test_from_local_of_uneven_shards_matches_the_plain_tensor(
    pool2: RankPool, rows: int, cols: int, dim: int
) -> None:
    full = _full(rows, cols)
    for got in pool2.run(_wrap_chunks, rows, cols, dim, (2,)):
        assert got["spec"] is None, got["spec"]
        assert got["shape"] == (rows, cols)
        torch.testing.assert_close(got["full"], full)
        torch.testing.assert_close(got["sum0"], full.sum(0))
        torch.testing.assert_close(got["mean"], full.mean())
        torch.testing.assert_close(got["replicated"], full)
        _check_grad(full, got)


def _check_grad(full: torch.Tensor, got: dict[str, Any]) -> None:
    """The local leaf's gradient is its block of the plain gradient of sum(x.sum(1) ** 2)."""
    grad = (2 * full.sum(1, keepdim=True)).expand_as(full)
    (r0, c0), (rows, cols) = got["offset"], got["local"].shape
    torch.testing.assert_close(got["leaf_grad"], grad[r0 : r0 + rows, c0 : c0 + cols])


@pytest.mark.parametrize("dim", [0, 1], ids=["rows-over-dp", "rows-and-cols"])
def test_from_local_of_uneven_shards_on_a_2d_mesh(pool4: RankPool, dim: int) -> None:
    full = _full(5, 3)
    for got in pool4.run(_wrap_chunks, 5, 3, dim, (2, 2)):
        assert got["spec"] is None, got["spec"]
        assert got["shape"] == (5, 3)
        torch.testing.assert_close(got["full"], full)
        torch.testing.assert_close(got["sum0"], full.sum(0))
        torch.testing.assert_close(got["replicated"], full)
        _check_grad(full, got)


def _rl_patterns() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from dtensor_patches import patched
    from dtensor_patches.testing import spec_disagreement

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with patched():
        # Token log-probs of this rank's own sequences (3 tokens on rank 0, 2 on rank 1).
        logp = torch.tensor([-0.5, -1.0, -0.25]) if rank == 0 else torch.tensor([-2.0, -0.75])
        tokens = DTensor.from_local(logp, mesh, [Shard(0)])
        out["logp_spec"] = spec_disagreement(tokens)
        out["logp_mean"] = tokens.mean().full_tensor()
        # An EMA kept on the local shards of a 5-row parameter, re-wrapped to compare.
        param = distribute_tensor(torch.linspace(-1, 1, 15).reshape(5, 3), mesh, [Shard(0)])
        ema_local = param.to_local().clone() * 0.5
        ema = DTensor.from_local(ema_local, mesh, param.placements)
        out["ema_spec"] = spec_disagreement(ema)
        out["ema_minus_half"] = (ema - param * 0.5).abs().max().full_tensor()
        # A differentiable re-wrap: the gradient reaches the local tensor.
        leaf = param.to_local().clone().requires_grad_()
        wrapped = DTensor.from_local(leaf, mesh, [Shard(0)])
        (wrapped.sum(0) ** 2).sum().backward()
        out["leaf_grad"] = leaf.grad
        out["rank"] = rank
    return out


def test_rl_code_rewrapping_local_tensors(pool2: RankPool) -> None:
    plain_param = torch.linspace(-1, 1, 15).reshape(5, 3)
    grad = (2 * plain_param.sum(0)).expand(5, 3)
    for got in pool2.run(_rl_patterns):
        assert got["logp_spec"] is None and got["ema_spec"] is None
        torch.testing.assert_close(
            got["logp_mean"], torch.tensor([-0.5, -1.0, -0.25, -2.0, -0.75]).mean()
        )
        assert got["ema_minus_half"].item() == 0
        torch.testing.assert_close(got["leaf_grad"], torch.chunk(grad, 2)[got["rank"]])


def _refused(lengths: tuple[int, int], explicit_shape: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dtensor_patches import patched

    mesh = init_device_mesh("cpu", (2,))
    local = torch.ones(lengths[dist.get_rank()], 2)
    with patched():
        if explicit_shape:  # torch's own way: left as torch has it
            d = DTensor.from_local(
                local, mesh, [Shard(0)], shape=torch.Size([sum(lengths), 2]), stride=(2, 1)
            )
            return {"shape": tuple(d.shape)}
        try:
            DTensor.from_local(local, mesh, [Shard(0)])
        except ValueError as exc:
            return {"error": str(exc)}
    return {"error": None}


def test_shards_that_are_not_dtensors_layout_are_refused_on_every_rank(pool2: RankPool) -> None:
    for got in pool2.run(_refused, (2, 3), False):
        assert got["error"] is not None
        assert "[2, 3]" in got["error"] and "not DTensor's layout" in got["error"]
        assert "shape=" in got["error"]
    for got in pool2.run(_refused, (3, 2), True):
        assert got["shape"] == (5, 2)


def _mismatched(kind: str) -> str | None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dtensor_patches import patched

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    local = {
        "ndim": torch.ones(3, 2) if rank == 0 else torch.ones(3),
        "other_dim": torch.ones(3, 2) if rank == 0 else torch.ones(2, 3),
    }[kind]
    with patched():
        try:
            DTensor.from_local(local, mesh, [Shard(0)])
        except ValueError as exc:
            return str(exc)
    return None


@pytest.mark.parametrize(
    ("kind", "words"), [("ndim", "dims"), ("other_dim", "differ outside dim 0")]
)
def test_local_tensors_that_cannot_form_one_dtensor_raise_on_every_rank(
    pool2: RankPool, kind: str, words: str
) -> None:
    for error in pool2.run(_mismatched, kind):
        assert error is not None and words in error and "cannot form one DTensor" in error
