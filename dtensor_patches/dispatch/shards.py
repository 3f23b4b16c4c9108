"""This rank's local tensor of a full value under given placements, with no communication."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["contiguous_stride", "partial_shares", "shard_of"]


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape`` (size-0 dims count as 1, as ATen does).

    For ``DTensor.from_local(..., shape=, stride=)`` when a handler builds a global result.
    """
    stride, running = [], 1
    for size in reversed(tuple(shape)):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


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
