"""Custom DTensor op handlers: for ops that no sharding strategy can serve.

A handler runs instead of DTensor's sharding propagation for one op (see
``compat.register_custom_handler``). Two kinds live here:

- :func:`replicated_result`: ops whose output shape depends on the data (``nonzero``,
  ``masked_select``, ``unique``, ``bincount``) fail inside shape propagation, before any
  strategy is consulted. The handler gathers the inputs, runs the op once on full tensors and
  returns ``Replicate()`` DTensors with the correct global result.
- :func:`inplace_through_full`: in-place ops whose result at one position depends on other
  positions (``index_put_`` with indices into a sharded dim, ``masked_scatter_``). The handler
  computes the full result, then writes the caller's own shard of it into the caller's local
  tensor, so the object is updated in place and keeps its placements.

Both move whole tensors; the README's patch table says which patches use them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from dtensor_patches import compat

__all__ = ["full_tensor", "inplace_through_full", "replicated_result", "shard_of"]


def _dtensor_class() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def _mesh_of(args: Any, kwargs: Any) -> Any:
    dtensor = _dtensor_class()
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, dtensor):
            return leaf.device_mesh
    raise TypeError("a DTensor handler was called without DTensor arguments")


def _full(value: Any) -> Any:
    if isinstance(value, _dtensor_class()):
        return value.full_tensor()
    return value


def full_tensor(value: Any) -> Any:
    """``value.full_tensor()`` for a DTensor (gathered on every rank); anything else as is."""
    return _full(value)


def _replicated(mesh: Any, value: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


def replicated_result(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Run ``op_call`` on the gathered inputs; every tensor output is a ``Replicate()`` DTensor.

    Plain tensors among the arguments are taken as already replicated (the same on every rank).
    """
    mesh = _mesh_of(args, kwargs)
    out = op_call(*tree_map(_full, args), **tree_map(_full, kwargs))
    return tree_map(lambda v: _replicated(mesh, v), out)


def shard_of(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
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
    coordinate = mesh.get_coordinate()
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op == "sum" and coordinate[mesh_dim] != 0:
            local = torch.zeros_like(local)
    return local


def inplace_through_full(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Apply an in-place op to the gathered first argument, then write back this rank's shard.

    The caller's DTensor object (``args[0]``) is updated in place and keeps its placements;
    every rank sees every write, whichever shard it lands in.
    """
    target = args[0]
    full_args = tree_map(_full, args)
    op_call(*full_args, **tree_map(_full, kwargs))
    local = compat.local_tensor(target)
    with torch.no_grad():
        local.copy_(shard_of(full_args[0], target.device_mesh, target.placements))
    return target
