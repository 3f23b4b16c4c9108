"""The placement patterns the validator gives a sample's tensors on a 1-D mesh, and building
DTensors whose full value is exactly a given plain tensor under each."""

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


def placements_for(pattern: str, tensors: Sequence[Any]) -> tuple[str, ...]:
    """One placement text per tensor (``"R"``, ``"S1"``, ``"P.sum"``) under ``pattern``."""
    first, _, rest = pattern.partition("|")
    rest = rest or first
    return tuple(_one(first if i == 0 else rest, t) for i, t in enumerate(tensors))


def make_dtensor(t: Any, placement: str, mesh: Any, requires_grad: bool) -> Any:
    """A DTensor on ``mesh`` whose full value is ``t`` (see :mod:`dtensor_patches.cell_record`
    for how ``Partial`` shares are chosen), a leaf with ``requires_grad`` where asked."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    t = t.detach().clone()
    if placement == "R":
        out = distribute_tensor(t, mesh, [Replicate()])
    elif placement.startswith("S"):
        out = distribute_tensor(t, mesh, [Shard(int(placement[1:]))])
    else:
        from dtensor_patches.cell_record import partial_local

        partial = [Partial(placement[2:])]
        # Fresh contiguous strides on every rank: an empty sample counts as contiguous with
        # any strides, and a share computed on one rank only (max/min) would get new ones, so
        # the ranks would disagree on the global stride.
        local = partial_local(t, partial, mesh).clone(memory_format=torch.contiguous_format)
        out = DTensor.from_local(local, mesh, partial, run_check=False)
    if requires_grad and (t.is_floating_point() or t.is_complex()):
        out = out.detach().requires_grad_(True)
    return out
