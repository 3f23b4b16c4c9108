"""Handlers shared by the indexed-write patches: ``index_add_``, ``index_copy_``,
``index_fill_``, ``index_reduce_``, ``scatter_``, ``scatter_add_``, ``scatter_reduce_``,
``put_`` and their out-of-place forms.

Each rank writes into its own block of ``self`` (the caller's local tensor, so the caller's
object changes in place and keeps its placements) and never gathers ``self`` where the math
allows:

- ``self`` sharded on dims other than the op's ``dim``: the op is local. The ``index``/``src``
  (``source``) arguments are cut to the rows that line up with this rank's block (no
  communication when they are already sharded like ``self``; otherwise they are gathered,
  they are usually small or replicated).
- ``index_*`` ops with ``self`` sharded on ``dim`` itself: every rank keeps the index entries
  that land in its block (shifted to local positions) and the matching slices of ``source``.
  Rows never receive entries from two ranks, so ``index_reduce_`` (``prod``, ``mean``,
  ``amax``, ``amin``, ``include_self``) stays exact. Out-of-range indices take the gathered
  path, so torch raises its own error, on every rank.
- ``scatter*`` with ``self`` sharded on ``dim``, ``put_`` (flat indices), ``Partial`` or other
  placements: gathered, written, and each rank copies its shard of the result back
  (:func:`dtensor_patches.dispatch.gather.inplace_through_full`).

Plain tensors among the arguments (an index built from a Python list, say) are taken as
replicated: the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from dtensor_patches._torch.dtensors import (
    dtensor_class,
    full_tensor,
    local_shape_and_offset,
    local_tensor,
)
from dtensor_patches._torch.schemas import inplace_overload
from dtensor_patches.dispatch.gather import inplace_through_full
from dtensor_patches.strategies import is_shard

__all__ = ["INDEX_OPS", "SCATTER_OPS", "indexed_functional", "indexed_inplace"]

# Ops whose ``index`` is 1-D along ``dim`` and whose ``source`` matches ``self`` off ``dim``.
INDEX_OPS = frozenset({"index_add_", "index_copy_", "index_fill_", "index_reduce_"})
# Ops whose ``index``/``src`` have ``self``'s ndim and may be shorter than ``self`` on any dim.
SCATTER_OPS = frozenset({"scatter_", "scatter_add_", "scatter_reduce_"})


def _windows(target: Any) -> dict[int, tuple[int, int]] | None:
    """Tensor dim -> (global offset, length) of this rank's block, for the sharded dims.

    ``None`` when a placement is neither ``Shard(d)`` nor ``Replicate()`` (``Partial``,
    ``_StridedShard``): those take the gathered path.
    """
    from torch.distributed.tensor import Replicate

    placements = tuple(target.placements)
    if not all(is_shard(p) or isinstance(p, Replicate) for p in placements):
        return None
    ndim = max(target.ndim, 1)
    dims = {p.dim % ndim for p in placements if is_shard(p)}
    if not dims:
        return {}
    local_shape, offset = local_shape_and_offset(target.shape, target.device_mesh, placements)
    return {d: (offset[d], local_shape[d]) for d in dims}


def _aligned(value: Any, target: Any, windows: dict[int, tuple[int, int]]) -> bool:
    """``value`` is a DTensor whose local block already lines up with ``target``'s."""
    return (
        isinstance(value, dtensor_class())
        and value.device_mesh == target.device_mesh
        and tuple(value.placements) == tuple(target.placements)
        and value.ndim == target.ndim
        and all(value.shape[d] == target.shape[d] for d in windows)
    )


def _cut(value: Any, target: Any, windows: dict[int, tuple[int, int]], skip: int) -> Any:
    """The part of a tensor argument that lines up with this rank's block of ``target``.

    Narrowed along every sharded dim except ``skip`` (the op's ``dim``); an argument shorter
    than ``target`` on a dim keeps only the rows inside the block (possibly none).
    """
    if not isinstance(value, torch.Tensor):
        return value
    if skip not in windows and _aligned(value, target, windows):
        return local_tensor(value)
    full = full_tensor(value)
    for d, (offset, length) in windows.items():
        if d == skip or full.ndim <= d:
            continue
        start = min(offset, full.shape[d])
        full = full.narrow(d, start, max(0, min(length, full.shape[d] - start)))
    return full


def _out_of_range(index: torch.Tensor, size: int, wraps: bool) -> bool:
    low = -size if wraps else 0
    return bool(((index < low) | (index >= size)).any())


def indexed_inplace(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Handler for the in-place ops (``index_add_``, ``scatter_``… ``put_``) on a DTensor ``self``.

    Returns ``args[0]``, updated in place with its placements unchanged.

    Raises:
        TypeError: ``self`` is a plain tensor (DTensor arguments cannot be written into it).
    """
    target = args[0]
    if not isinstance(target, dtensor_class()):
        raise TypeError(
            f"{op_call}: in-place write into a plain torch.Tensor from DTensor arguments; "
            "make self a DTensor"
        )
    name = op_call.overloadpacket.__name__
    windows = _windows(target)
    if windows is None or (name not in INDEX_OPS and name not in SCATTER_OPS):
        return inplace_through_full(op_call, args, kwargs)
    dim = int(args[1]) % max(target.ndim, 1)
    if name in SCATTER_OPS and dim in windows:
        return inplace_through_full(op_call, args, kwargs)
    # index_* take a 1-D index along ``dim``: used whole; scatter* take one shaped like self.
    index = full_tensor(args[2]) if name in INDEX_OPS else _cut(args[2], target, windows, dim)
    rest = [_cut(a, target, windows, dim) for a in args[3:]]
    kw = {k: full_tensor(v) for k, v in kwargs.items()}
    if name in INDEX_OPS and dim in windows:
        size = int(target.shape[dim])
        wraps = name == "index_fill_"  # index_fill_ alone accepts negative indices
        if index.ndim != 1 or _out_of_range(index, size, wraps):
            # Gathered: torch's own checks raise its own error, the same on every rank.
            return inplace_through_full(op_call, args, kwargs)
        offset, length = windows[dim]
        index = torch.where(index < 0, index + size, index)
        keep = (index >= offset) & (index < offset + length)
        if name != "index_fill_":  # the others take a source sliced like the index
            rest[0] = rest[0].index_select(dim, keep.nonzero().flatten())
        index = index[keep] - offset
    with torch.no_grad():
        op_call(local_tensor(target), dim, index, *rest, **kw)
    return target


def indexed_functional(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Handler for the out-of-place forms (``scatter_reduce``, ``index_add``…).

    The result is a copy of ``self`` with its placements (a plain ``self`` is taken as
    replicated), written by :func:`indexed_inplace` with the in-place overload.
    """
    from torch.distributed.tensor import DTensor, Replicate

    target = args[0]
    if isinstance(target, DTensor):
        out = target.clone()
    else:
        mesh = next(a.device_mesh for a in args if isinstance(a, DTensor))
        out = DTensor.from_local(target.clone(), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return indexed_inplace(inplace_overload(op_call), (out, *args[1:]), kwargs)
