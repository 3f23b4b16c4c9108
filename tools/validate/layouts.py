"""The placement patterns the validator gives a sample's tensors on a 1-D or a 2-D mesh, and
building DTensors whose full value is exactly a given plain tensor under each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PATTERNS: tuple[str, ...] = (
    "R",
    "S0",
    "S1",
    "S2",
    "S-1",
    "S0|R",
    "S1|R",
    "S-1|R",
    "R|S0",
    "R|S-1",
    "P.sum",
    "P.avg",
    "P.max",
    "P.min",
    "P.sum|R",
)
"""``S<d>``: every tensor with a dim ``d`` is ``Shard(d)`` (the others ``Replicate()``);
``P.<op>``: every floating tensor is ``Partial(op)``; ``A|B``: the first tensor gets ``A``, the
others ``B``. Integer and bool tensors are never ``Partial``. Sizes are op_db's (often 5 or
10 on 2 ranks, and 1): uneven and empty shards arise from them."""

PATTERNS_2D: tuple[str, ...] = (
    "S0/S1",
    "S1/S0",
    "S0/S0",
    "S-1/S-1",
    "S0/R",
    "R/S0",
    "R/S-1",
    "S0|R/R|S0",
    "R|S-1/S-1|R",
    "S0/P.sum",
    "P.sum/S-1",
    "P.sum/P.sum",
    "R/P.max",
    "S0/P.avg",
    "P.sum|R/S0",
)
"""Patterns on a 2-D mesh: one 1-D pattern per mesh dim, joined with ``/`` (``S0/S1``: every
tensor ``[Shard(0), Shard(1)]`` where it has those dims, the way FSDP2 + TP lay out a weight;
``S0/S0``: a dim sharded over both mesh dims, uneven on op_db's sizes of 5 and 10 over 4
ranks; ``S0/P.sum``: a data-parallel shard with a pending tensor-parallel sum). Each part
follows the 1-D rules above, mesh dim by mesh dim."""


def _one(pattern: str, t: Any) -> str:
    if pattern == "R":
        return "R"
    if pattern.startswith("S"):
        dim = int(pattern[1:])
        if t.dim() == 0 or not -t.dim() <= dim < t.dim():
            return "R"
        return f"S{dim % t.dim()}"
    if pattern.startswith("P."):
        return pattern if t.is_floating_point() else "R"
    raise ValueError(pattern)


def _one_mesh_dim(pattern: str, tensors: Sequence[Any]) -> tuple[str, ...]:
    first, _, rest = pattern.partition("|")
    rest = rest or first
    return tuple(_one(first if i == 0 else rest, t) for i, t in enumerate(tensors))


def placements_for(pattern: str, tensors: Sequence[Any]) -> tuple[str, ...]:
    """One layout text per tensor under ``pattern``: ``"R"``, ``"S1"``, ``"P.sum"`` on a 1-D
    mesh, ``"S0/S1"`` (one part per mesh dim, :func:`dtensor_patches.cells.layout_of`'s form)
    on a 2-D mesh."""
    per_mesh_dim = [_one_mesh_dim(part, tensors) for part in pattern.split("/")]
    return tuple("/".join(parts) for parts in zip(*per_mesh_dim, strict=True))


def mesh_ndim(pattern: str) -> int:
    """The number of mesh dims ``pattern`` lays tensors out over."""
    return pattern.count("/") + 1


def make_dtensor(t: Any, layout: str, mesh: Any, requires_grad: bool) -> Any:
    """A DTensor on ``mesh`` whose full value is ``t`` under ``layout`` (``"S0"``,
    ``"S0/P.sum"``; see :mod:`dtensor_patches.cell_record` for how ``Partial`` shares are
    chosen), a leaf with ``requires_grad`` where asked.

    Raises:
        ValueError: ``layout`` has another number of parts than ``mesh`` has dims.
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    from dtensor_patches.cell_record import partial_local, placements_of
    from dtensor_patches.dispatch.shards import contiguous_stride, distributed_locally, shard_of

    placements = placements_of(layout)
    if len(placements) != mesh.ndim:
        raise ValueError(f"layout {layout!r} is for a {len(placements)}-D mesh, not {mesh.ndim}-D")
    t = t.detach().clone()
    if not any(p.is_partial() for p in placements):
        out = distributed_locally(t, mesh, placements)
    else:
        # Shard first (a spec with the partial mesh dims replicated), then take each rank's
        # share. Fresh contiguous strides on every rank: an empty sample counts as contiguous
        # with any strides, and a share computed on one rank only (max/min) would get new
        # ones, so the ranks would disagree on the global stride.
        plain = [Replicate() if p.is_partial() else p for p in placements]
        local = shard_of(t, mesh, plain)
        local = partial_local(local, placements, mesh).clone(memory_format=torch.contiguous_format)
        out = DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=t.shape,
            stride=contiguous_stride(t.shape),
        )
    if requires_grad and (t.is_floating_point() or t.is_complex()):
        out = out.detach().requires_grad_(True)
    return out
