"""Shared pieces of the patches that compute along a sharded dim (``vocab``, ``losses``): which
mesh dims shard a tensor dim, this rank's offset along it, reductions of small local tensors
over those mesh dims, and softmax forward and backward on the shards.

Everything here runs inside DTensor's dispatch (below autograd) on local tensors: the
collectives are plain in-place ``torch.distributed`` calls on the mesh dims' process groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtensor_patches._torch.dtensors import local_shape_and_offset, local_tensor
from dtensor_patches.dispatch.shards import sharded_result
from dtensor_patches.strategies import is_shard

__all__ = [
    "LOW_PRECISION",
    "all_gather_along",
    "all_reduce_over",
    "block_lookup",
    "mesh_dims_sharding",
    "plain_layout",
    "replicated_over",
    "shard_extent",
    "sharded_along",
    "softmax_backward_on_shards",
    "softmax_on_shards",
    "summed_over",
]

LOW_PRECISION = (torch.float16, torch.bfloat16)
"""Dtypes computed in float32 and cast back, as ATen accumulates them."""


def plain_layout(placements: Sequence[Any]) -> bool:
    """Only ``Shard(d)`` and ``Replicate()``: no pending reduction, no ``_StridedShard``."""
    return all(is_shard(p) or p.is_replicate() for p in placements)


def mesh_dims_sharding(placements: Sequence[Any], dim: int) -> tuple[int, ...]:
    """The mesh dims whose placement is ``Shard(dim)`` (``dim`` non-negative)."""
    return tuple(i for i, p in enumerate(placements) if is_shard(p) and p.dim == dim)


def replicated_over(placements: Sequence[Any], mesh_dims: Sequence[int]) -> bool:
    """Whether ``placements`` is ``Replicate()`` on every mesh dim of ``mesh_dims``: the ids of
    a lookup must be whole on the mesh dims that split the looked-up dim."""
    return all(placements[i].is_replicate() for i in mesh_dims)


def block_lookup(ids: torch.Tensor, offset: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global indices ``ids`` (any shape, int64) made local to a block of ``size`` entries
    starting at ``offset``: ``(local, inside)``, where ``local`` is clamped into ``[0, size)``
    (so a lookup never leaves the block) and the bool ``inside`` marks the ids the block holds.
    The lookups of ``gather`` and ``embedding`` zero what is not ``inside`` and sum the blocks
    (``Partial("sum")``): each id is held by exactly one block. ``size`` 0 gives all-false."""
    shifted = ids - offset
    inside = (shifted >= 0) & (shifted < size)
    return shifted.clamp(0, max(size - 1, 0)), inside


def summed_over(placements: Sequence[Any], mesh_dims: Sequence[int]) -> list[Any]:
    """``placements`` with ``Partial("sum")`` on the mesh dims of ``mesh_dims``."""
    from torch.distributed.tensor import Partial

    return [Partial("sum") if i in mesh_dims else p for i, p in enumerate(placements)]


def shard_extent(
    shape: Sequence[int], mesh: Any, placements: Sequence[Any], dim: int
) -> tuple[int, int]:
    """``(offset, size)`` of this rank's block along ``dim``: the global index of its first
    element and its length (0 for an empty last shard), cut exactly as DTensor cuts."""
    local_shape, offset = local_shape_and_offset(shape, mesh, placements)
    return offset[dim], local_shape[dim]


def all_reduce_over(
    tensor: torch.Tensor, mesh: Any, mesh_dims: Sequence[int], op: dist.ReduceOp.RedOpType
) -> torch.Tensor:
    """``tensor`` reduced in place over every mesh dim of ``mesh_dims`` (one all-reduce each);
    returns it. ``op`` is ``dist.ReduceOp.SUM`` or ``MAX``."""
    for mesh_dim in mesh_dims:
        dist.all_reduce(tensor, op=op, group=mesh.get_group(mesh_dim))
    return tensor


def all_gather_along(tensor: torch.Tensor, mesh: Any, mesh_dim: int, dim: int) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape on each) of mesh dim ``mesh_dim`` concatenated along
    ``dim`` in mesh-coordinate order (the order of DTensor's shards)."""
    group = mesh.get_group(mesh_dim)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim)


def sharded_along(spec: Any, dim: Any) -> bool:
    """Whether the DTensor or ``DTensorSpec`` ``spec`` is sharded on ``dim`` (an int) with
    plain placements only (nothing pending)."""
    placements = getattr(spec, "placements", None)
    if placements is None or not isinstance(dim, int) or not plain_layout(placements):
        return False
    ndim = len(spec.shape)
    return ndim > 0 and bool(mesh_dims_sharding(placements, dim % ndim))


def _like(local: torch.Tensor, template: Any) -> Any:
    """``local`` as this rank's block of a contiguous DTensor laid out like ``template``."""

    return sharded_result(local, template.device_mesh, template.placements, template.shape)


def softmax_on_shards(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_softmax`` / ``_log_softmax(x, dim, half_to_float)`` of an ``x`` sharded on ``dim``, on
    the shard: a ``MAX`` and a ``SUM`` all-reduce of ``[..., 1]``; the output is laid out like
    ``x`` (float32 for ``half_to_float``)."""
    x, dim, half_to_float = args[0], args[1], bool(args[2])
    dim %= x.ndim
    mesh, over = x.device_mesh, mesh_dims_sharding(x.placements, dim)
    local = local_tensor(x)
    out_dtype = torch.float32 if half_to_float else local.dtype
    acc = local.float() if local.dtype in LOW_PRECISION else local
    if acc.size(dim) == 0:
        shape = list(acc.shape)
        shape[dim] = 1
        peak = acc.new_full(shape, float("-inf"))
    else:
        peak = acc.amax(dim, keepdim=True)
    all_reduce_over(peak, mesh, over, dist.ReduceOp.MAX)
    shifted = acc - peak
    total = all_reduce_over(shifted.exp().sum(dim, keepdim=True), mesh, over, dist.ReduceOp.SUM)
    if op_call.name().startswith("aten::_log_softmax"):
        out = shifted - total.log()
    else:
        out = shifted.exp() / total
    return _like(out.to(out_dtype), x)


def softmax_backward_on_shards(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_softmax_backward_data`` / ``_log_softmax_backward_data`` of an output sharded on the
    softmax dim, on the shard: the gradient is brought to the output's placements first."""
    grad, output, dim, input_dtype = args[0], args[1], args[2], args[3]
    dim %= output.ndim
    mesh, over = output.device_mesh, mesh_dims_sharding(output.placements, dim)
    if tuple(grad.placements) != tuple(output.placements):
        with torch.no_grad():
            grad = grad.detach().redistribute(mesh, output.placements)
    g, y = local_tensor(grad), local_tensor(output)
    if y.dtype in LOW_PRECISION:
        g, y = g.float(), y.float()
    if op_call.name().startswith("aten::_log_softmax"):
        total = all_reduce_over(g.sum(dim, keepdim=True), mesh, over, dist.ReduceOp.SUM)
        out = g - y.exp() * total
    else:
        total = all_reduce_over((g * y).sum(dim, keepdim=True), mesh, over, dist.ReduceOp.SUM)
        out = y * (g - total)
    return _like(out.to(input_dtype), output)
