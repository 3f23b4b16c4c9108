"""Advanced indexing of a DTensor with plain index tensors or boolean masks fails on every
release 2.9 to 2.15.

Trigger: ``x[[1, 2]]``, ``x[:, torch.tensor([1, 5])]``, ``x[row_mask]``, ``x[x > 0]``.
Python lists become plain tensors inside torch, so the user cannot pass a DTensor index;
``aten.index.Tensor`` then raises ``got mixed torch.Tensor and DTensor``. Boolean masks fail in
shape propagation even as DTensors (the output length depends on the data: ``aten.nonzero``
inside the strategy on 2.10+, ``Sharding propagation failed`` on 2.9). Indexing with
``Replicate()`` DTensor integer indices works on every release (measured), and is left to
torch only through this handler.

Fix: a custom handler for ``aten.index.Tensor``. Plain index tensors are taken as replicated
(the same on every rank, as every Python-built index is); DTensor indices are gathered; boolean
masks become the integer indices of their ``True`` entries (global, so the output shape is
right on every rank). Then:

- ``Shard(d)`` of ``x`` on a dim that is not indexed stays sharded (on its position in the
  output) with no communication;
- ``Shard(d)`` on an indexed dim is gathered (``Replicate()`` output);
- ``Partial()`` stays ``Partial()`` (selecting entries is linear);
- integer DTensor indices of one shape sharded alike stay sharded where ``x`` is replicated
  (the output is sharded on the matching index dim, as torch's own strategy does); other
  DTensor indices are gathered.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches.calls import mixed_and_sharded
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import is_shard


def _integer_indices(indices: list[Any]) -> list[torch.Tensor | None]:
    """Gathered index tensors, boolean masks expanded into one integer index per mask dim."""
    from torch.distributed.tensor import DTensor

    out: list[torch.Tensor | None] = []
    for index in indices:
        if isinstance(index, DTensor):
            index = index.full_tensor()
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            out.extend(index.nonzero().unbind(1))
        else:
            out.append(index)
    return out


def _layout(indices: list[Any]) -> tuple[list[int], int, int]:
    """(indexed input dims, broadcast ndim ``B`` of the index tensors, first output dim of the
    ``B`` index dims). When the indexed dims are adjacent, the ``B`` dims replace them in
    place; otherwise they go first and the unindexed dims follow in order."""
    indexed = [i for i, t in enumerate(indices) if t is not None]
    if not indexed:
        return indexed, 0, 0
    broadcast = len(torch.broadcast_shapes(*(tuple(indices[i].shape) for i in indexed)))
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    return indexed, broadcast, indexed[0] if adjacent else 0


def _output_dim(dim: int, indices: list[Any]) -> int:
    """Where the unindexed input dim ``dim`` lands in the output of advanced indexing."""
    indexed, broadcast, _ = _layout(indices)
    if not indexed:
        return dim
    if indexed == list(range(indexed[0], indexed[-1] + 1)):
        return dim if dim < indexed[0] else dim - len(indexed) + broadcast
    return broadcast + dim - sum(1 for i in indexed if i < dim)


def _sharded_alike(indices: list[Any]) -> Any:
    """The placements of the index tensors when all are integer DTensors of one shape placed
    alike (they can then stay sharded where ``x`` is replicated), else ``None``."""
    from torch.distributed.tensor import DTensor, Replicate

    present = [i for i in indices if i is not None]
    if not present or not all(isinstance(i, DTensor) for i in present):
        return None
    first = present[0]
    if any(i.dtype in (torch.bool, torch.uint8) for i in present):
        return None
    if any(
        i.shape != first.shape or tuple(i.placements) != tuple(first.placements) for i in present
    ):
        return None
    if not all(is_shard(p) or isinstance(p, Replicate) for p in first.placements):
        return None
    return tuple(first.placements)


def index_handler(op_call: Any, args: Any, kwargs: Any) -> Any:
    """``aten.index.Tensor(x, indices)`` on DTensors: see the module docstring."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    x, indices = args[0], list(args[1])
    if not isinstance(x, DTensor):  # plain x with DTensor indices: taken as replicated
        mesh = next(i.device_mesh for i in indices if isinstance(i, DTensor))
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    mesh = x.device_mesh
    if any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) and i.ndim == 0
        for i in indices
    ):
        # x[True] adds a dim of size 0/1: rare; gathered and computed once.
        out = op_call(x.full_tensor(), [None if i is None else _gathered(i) for i in indices])
        return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)
    index_placements = _sharded_alike(indices)
    # Either DTensor indices that may stay sharded, or gathered integer indices.
    integer: list[Any] = indices if index_placements is not None else _integer_indices(indices)
    indexed, broadcast, first = _layout(integer)
    index_ndim = max((integer[i].ndim for i in indexed), default=0)
    ndim = max(x.ndim, 1)
    x_needed, index_needed, out_placements = [], [], []
    for m, p in enumerate(x.placements):
        q = index_placements[m] if index_placements is not None else Replicate()
        if is_shard(p) and p.dim % ndim not in indexed:
            x_needed.append(p)
            index_needed.append(Replicate())
            out_placements.append(Shard(_output_dim(p.dim % ndim, integer)))
        elif isinstance(p, Partial):  # selecting entries is linear
            x_needed.append(p)
            index_needed.append(Replicate())
            out_placements.append(p)
        elif is_shard(q):  # x replicated here: the index shard picks its own output rows
            x_needed.append(Replicate())
            index_needed.append(q)
            out_placements.append(Shard(first + broadcast - index_ndim + q.dim))
        else:
            x_needed.append(Replicate())
            index_needed.append(Replicate())
            out_placements.append(Replicate())
    if tuple(x_needed) != tuple(x.placements):
        x = x.redistribute(mesh, x_needed)
    if index_placements is not None:
        local_indices = [
            None if i is None else local_tensor(i.redistribute(mesh, index_needed)) for i in integer
        ]
    else:
        local_indices = integer
    local = op_call(local_tensor(x), local_indices)
    # The global shape, from the same indexing on meta tensors (integer indices: shape only).
    meta = op_call(
        torch.empty(x.shape, dtype=x.dtype, device="meta"),
        [
            None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")
            for t in integer
        ],
    )
    return DTensor.from_local(
        local, mesh, out_placements, run_check=False, shape=meta.shape, stride=meta.stride()
    )


def _gathered(index: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return index.full_tensor() if isinstance(index, DTensor) else index


def _registrations() -> list[Handler]:
    return [Handler("aten.index.Tensor", index_handler)]


# The tripwire's cases: List, plain-tensor and boolean-mask indexing of sharded DTensors vs single-device.
CASES = [
    Case("x[[1, 2]], x Shard(1)", lambda x: x[[1, 2]], lambda: [randn(5, 6)], ["S1"]),
    Case("x[[4, 0, 4]], x Shard(0)", lambda x: x[[4, 0, 4]], lambda: [randn(5, 6)], ["S0"]),
    Case(
        "x[:, idx], x Shard(0)",
        lambda x: x[:, torch.tensor([1, 5, 1])],
        lambda: [randn(5, 6)],
        ["S0"],
    ),
    Case(
        "x[row_mask], x Shard(1)",
        lambda x: x[torch.tensor([True, False, True, True, False])],
        lambda: [randn(5, 6)],
        ["S1"],
    ),
    Case("x[x > 0], x Shard(0)", lambda x: x[x > 0], lambda: [randn(5, 6)], ["S0"]),
    Case(
        "x[mask], mask a DTensor, x Partial()",
        lambda x, m: x[m],
        lambda: [randn(5, 6), randn(5, 6, seed=3) > 0],
        ["P", "S1"],
    ),
]


PATCH = Patch(
    name="getitem",
    summary="x[[1, 2]], x[idx] with plain index tensors, x[mask]: aten.index.Tensor",
    ops=("aten.index.Tensor",),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    concerns=mixed_and_sharded,
    overrides_existing=True,
    communication="only a shard on an indexed dim",
)
