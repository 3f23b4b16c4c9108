"""``squeeze`` drops dims that are size 1 only locally on torch 2.9 to 2.11.

Trigger: ``x.squeeze()`` with ``x`` of global shape 2x4 ``Shard(0)`` on 2 ranks: each local
shard is 1x4, the local ``squeeze`` drops dim 0, and the result has the wrong shape
(``full_tensor()`` gives 8 elements in one dim). Any ``squeeze``/``squeeze(dim)`` of a tensor
whose sharded dim has one element per rank does this (per-sample losses, ``[B, 1]`` heads).

Fix: a custom handler that squeezes only the dims whose *global* size is 1: this rank's local
tensor is squeezed along exactly those dims and the output keeps the input's placements
(shard dims renumbered). No communication; a size-1 dim that is itself sharded (one rank holds
it, the others hold nothing) is gathered first. Measured fixed upstream in torch 2.12 (which
rewrites ``squeeze`` to ``squeeze.dims`` with the globally singleton dims).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches.dispatch.shards import contiguous_stride
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import is_shard, normalize_dims


def _squeeze(op_call: Any, args: Any, kwargs: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x = args[0]
    ndim = x.ndim
    if len(args) < 2:
        requested: Any = range(ndim)
    elif isinstance(args[1], (tuple, list)) and not args[1]:
        requested = ()  # squeeze(x, ()) squeezes nothing (unlike an empty reduction dim list)
    else:
        requested = normalize_dims(args[1], ndim)
    drop = [d for d in requested if ndim > 0 and x.shape[d] == 1]
    placements = list(x.placements)
    if any(is_shard(p) and p.dim in drop for p in placements):
        placements = [Replicate() if is_shard(p) and p.dim in drop else p for p in placements]
        x = x.redistribute(x.device_mesh, placements)
    local = local_tensor(x)
    out_local = local.squeeze(tuple(drop)) if drop else local.view(local.shape)
    out_placements = [
        Shard(p.dim - sum(1 for d in drop if d < p.dim)) if is_shard(p) else p for p in placements
    ]
    shape = torch.Size(s for d, s in enumerate(x.shape) if d not in drop)
    return DTensor.from_local(
        out_local,
        x.device_mesh,
        out_placements,
        run_check=False,
        shape=shape,
        stride=contiguous_stride(shape),
    )


def _registrations() -> list[Handler]:
    return [
        Handler("aten.squeeze.default", _squeeze),
        Handler("aten.squeeze.dim", _squeeze),
        Handler("aten.squeeze.dims", _squeeze),
    ]


# The tripwire's cases: ``squeeze`` of tensors with locally and globally size-1 dims vs single-device results.
CASES = [
    Case("x.squeeze() 2x4 Shard(0)", lambda x: x.squeeze(), lambda: [randn(2, 4)], ["S0"]),
    Case("x.squeeze(0) 2x4 Shard(0)", lambda x: x.squeeze(0), lambda: [randn(2, 4)], ["S0"]),
    Case("x.squeeze() 2x1x3 Shard(0)", lambda x: x.squeeze(), lambda: [randn(2, 1, 3)], ["S0"]),
    Case("x.squeeze(-1) 4x1 Shard(0)", lambda x: x.squeeze(-1), lambda: [randn(4, 1)], ["S0"]),
]


PATCH = Patch(
    name="squeeze",
    summary="squeeze only globally size-1 dims (torch 2.9 to 2.11)",
    ops=("aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims"),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    overrides_existing=True,
    communication="none, unless a size-1 dim is itself sharded",
)
