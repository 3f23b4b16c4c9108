"""This rank's local tensor of a full value under given placements, with no communication; and
the full value of a DTensor in the layout it reports (:func:`gather_full`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dtensor_patches._torch.dtensors import is_dtensor, local_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "contiguous_stride",
    "gather_full",
    "in_layout_of",
    "nested_shards_leave_a_rank_empty",
    "partial_shares",
    "shard_of",
    "sharded_result",
    "stride_like",
]


def nested_shards_leave_a_rank_empty(size: int, ranks: Sequence[int]) -> bool:
    """Whether one dim of ``size`` sharded over one or more mesh dims in turn (``ranks``: each
    one's size, in mesh-dim order: ``Shard(0)`` on 2 ranks is ``[2]``, ``[Shard(0),
    Shard(0)]`` on a 2x2 mesh ``[2, 2]``) leaves some rank no elements. torch cuts
    ``ceil(size / n)``-sized chunks, so the last rank gets nothing once the first chunks cover
    the dim (1 row on 2 ranks; 5 rows on 4 ranks: 2, 2, 1, 0), and each further mesh dim cuts
    every chunk of the one before (5 rows: 3 and 2, then 2, 1 and 1, 1; 2 rows: 1, 0, 1, 0)."""
    sizes = [size]
    for n in ranks:
        sizes = [max(0, min(-(-s // n), s - i * -(-s // n))) for s in sizes for i in range(n)]
    return any(s == 0 for s in sizes)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape`` (size-0 dims count as 1, as ATen does).

    For ``DTensor.from_local(..., shape=, stride=)`` when a handler builds a global result.
    """
    stride, running = [], 1
    for size in reversed(tuple(shape)):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def stride_like(local: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` whose dims are laid out in ``local``'s order."""
    strides = local.stride()
    order = sorted(range(local.ndim), key=lambda d: (-strides[d], d))
    stride = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        stride[dim] = step
        step *= max(int(shape[dim]), 1)
    return tuple(stride)


def sharded_result(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    *,
    stride: Sequence[int] | None = None,
) -> Any:
    """``local`` as this rank's block of a DTensor of global ``shape`` placed ``placements``
    (``DTensor.from_local`` without checks or communication): how a handler or miss rule
    returns a result it computed on the shards. The global stride is contiguous unless
    ``stride`` is given (a kernel that lays its output out in another dim order:
    :func:`stride_like`)."""
    from torch.distributed.tensor import DTensor

    size = torch.Size(shape)
    return DTensor.from_local(
        local,
        mesh,
        tuple(placements),
        run_check=False,
        shape=size,
        stride=contiguous_stride(size) if stride is None else tuple(stride),
    )


def partial_shares(
    value: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]
) -> torch.Tensor:
    """This rank's share of ``value`` (the local tensor of the reduced value) under
    ``placements``: on every ``Partial(sum)`` mesh dim the value stays on coordinate 0 and is
    zero elsewhere, so the shares sum to it; other reductions (avg, max, min) keep the value on
    every rank. ``Shard``/``Replicate`` mesh dims are left as they are (no communication).
    """
    from torch.distributed.tensor import Partial

    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "partial_shares on a rank outside the mesh"
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op == "sum" and coordinate[mesh_dim] != 0:
            return torch.zeros_like(value)
    return value


def shard_of(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's local tensor of ``full`` under ``placements`` (no communication).

    ``Shard`` cuts as DTensor does (uneven last shards included); ``Partial(sum)`` puts the
    whole value on coordinate 0 of that mesh dim and zeros elsewhere, so the shares sum to it;
    other ``Partial`` reductions (avg, max, min) keep the value on every rank.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    placements = tuple(placements)
    shard_only = [Replicate() if isinstance(p, Partial) else p for p in placements]
    # Detached: on 2.9 a ``full`` that requires grad makes from_local's autograd wrapper call
    # aten.detach_ on a DTensor, which has no strategy there.
    local = (
        DTensor.from_local(full.detach(), mesh, [Replicate()] * mesh.ndim, run_check=False)
        .redistribute(mesh, shard_only)
        .to_local()
    )
    return partial_shares(local, mesh, placements)


def distributed_locally(
    full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]
) -> Any:
    """``full`` as a DTensor under ``placements`` (``Shard``/``Replicate`` only), each rank
    cutting its shard from its own copy of ``full``: no communication, contiguous locals, and
    ``full``'s shape and stride as the global ones (as ``distribute_tensor`` gives). Every rank
    must hold the same ``full``.

    ``distribute_tensor`` scatters from rank 0 and pads uneven shards first; on 2.9 that
    padding raises on the ranks whose shard is empty along another dim (a ``[5, 1]`` tensor as
    ``[Shard(1), Shard(0)]`` on a 2x2 mesh), and the other ranks hang in the scatter. Building
    samples this way keeps that bug out of what is measured about the ops.
    """
    from torch.distributed.tensor import DTensor

    local = shard_of(full, mesh, placements).contiguous()
    return DTensor.from_local(
        local,
        mesh,
        tuple(placements),
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )


def _dense_layout(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` lays out ``shape`` densely without overlap (a permutation of a
    contiguous layout: what a transpose of a contiguous tensor has)."""
    running = 1
    for size, step in sorted(zip(shape, stride, strict=True), key=lambda d: (d[1], d[0])):
        if size == 1:
            continue
        if step != running:
            return False
        running *= size
    return True


def in_layout_of(value: Any, full: torch.Tensor) -> torch.Tensor:
    """``full`` (the gathered tensor of the DTensor ``value``) with the strides ``value``
    reports, where those are a dense layout: view ops on the gathered tensor must succeed or
    fail as on a single device (the gather gives a contiguous tensor for ``x.t()`` of a
    ``Shard(0)`` ``x``, where ``x.t().view(-1)`` raises on one device; and a permuted one for a
    ``Shard(d > 0)`` on 2.9, where ``flatten`` must see the reported layout; issue 23, item
    15). A layout with overlap or gaps (``expand``) keeps the gathered one."""
    if full.stride() == value.stride() or full.numel() == 0:
        return full
    if not _dense_layout(value.shape, value.stride()):
        return full.contiguous() if value.is_contiguous() else full
    out = torch.empty_strided(value.shape, value.stride(), dtype=full.dtype, device=full.device)
    out.copy_(full)
    return out


def gather_full(value: Any) -> tuple[Any, int]:
    """The full tensor of a DTensor (detached, on every rank, ``Partial`` reduced, in the
    layout the DTensor reports) and the bytes it moved to this rank; anything else as it is.

    A collective on every rank of the mesh unless every placement is ``Replicate()`` (then the
    local tensor itself, detached: it aliases the DTensor's data).
    """
    from torch.distributed.tensor import Replicate

    if not is_dtensor(value):
        return value, 0
    local = local_tensor(value)
    if all(isinstance(p, Replicate) for p in value.placements):
        return local.detach(), 0
    if value.numel() == 0:
        # Nothing to gather; torch 2.9's all-gather of empty uneven shards hangs on some ranks.
        return torch.empty(value.shape, dtype=value.dtype, device=local.device), 0
    full = in_layout_of(value, value.detach().full_tensor())
    if any(p.is_shard() for p in value.placements):
        moved = max(full.numel() - local.numel(), 0) * full.element_size()
    else:
        # Partial only: a reduction, not a gather; every rank still received a full copy.
        moved = full.numel() * full.element_size()
    return full, moved
