"""``squeeze`` drops dims that are size 1 only locally on torch 2.9 to 2.11.

Trigger: ``x.squeeze()`` with ``x`` of global shape 2x4 ``Shard(0)`` on 2 ranks: each local
shard is 1x4, the local ``squeeze`` drops dim 0, and the result has the wrong shape
(``full_tensor()`` gives 8 elements in one dim). Any ``squeeze``/``squeeze(dim)`` of a tensor
whose sharded dim has one element per rank does this (per-sample losses, ``[B, 1]`` heads).

Fix: a miss rule on the three ``squeeze`` overloads, taken only when a dim the call may drop
is sharded (the only way a local size can differ from the global one): it squeezes only the
dims whose *global* size is 1 (also where torch has no strategy: ``squeeze.dims`` on 2.11),
this rank's local tensor along exactly those dims, and the
output keeps the input's placements (shard dims renumbered). No communication; a size-1 dim
that is itself sharded (one rank holds it, the others hold nothing) is gathered first. Every
other squeeze (``values.squeeze(-1)`` of a ``[B, S, 1]`` head sharded on ``B`` or ``S``) keeps
torch's cached path: as a custom handler this patch cost every squeeze 5x on 2.11 (9 us to
52 us per call, ``benchmarks/call_overhead.py``). Measured fixed upstream in torch 2.12 (which
rewrites ``squeeze`` to ``squeeze.dims`` with the globally singleton dims).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.dispatch.shards import sharded_result
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import is_shard, normalize_dims

OPS = ("aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims")


def _squeeze(op_call: Any, args: Any, kwargs: Any) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    x = args[0]
    ndim = x.ndim
    # squeeze(x, ()) squeezes nothing (unlike an empty reduction dim list).
    requested = _requested(args, ndim)
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
    return sharded_result(out_local, x.device_mesh, out_placements, shape)


def _requested(args: Any, ndim: int) -> tuple[int, ...]:
    if len(args) < 2:
        return tuple(range(ndim))
    if isinstance(args[1], (tuple, list)) and not args[1]:
        return ()
    return tuple(normalize_dims(args[1], ndim))


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    args = schema.args_schema
    x = args[0] if args else None
    placements = getattr(x, "placements", None)
    if placements is None or len(x.shape) == 0:
        return None
    requested = _requested(args, len(x.shape))
    if any(p.is_shard() and getattr(p, "dim", None) in requested for p in placements):
        return _squeeze
    # 2.11 has no strategy for ``squeeze.dims`` at all: such calls are taken too (a decision
    # torch can make is cached, so this asks torch once per schema).
    return _squeeze if native.error() is not None else None


def _registrations() -> list[MissRule]:
    return [MissRule(op, _rule) for op in OPS]


def _ranks() -> int:
    """The number of ranks: ``[ranks, ...]`` placed ``Shard(0)`` leaves every rank one row, the
    locally size-1 dim this bug is about (2 fixed rows would leave ranks empty on 4 ranks, where
    stock torch's collectives disagree in size and abort gloo)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 2


# The tripwire's cases: ``squeeze`` of tensors with locally and globally size-1 dims vs single-device results.
CASES = [
    Case(
        "x.squeeze() [ranks, 4] Shard(0)",
        lambda x: x.squeeze(),
        lambda: [randn(_ranks(), 4)],
        ["S0"],
    ),
    Case(
        "x.squeeze(0) [ranks, 4] Shard(0)",
        lambda x: x.squeeze(0),
        lambda: [randn(_ranks(), 4)],
        ["S0"],
    ),
    Case(
        "x.squeeze() [ranks, 1, 3] Shard(0)",
        lambda x: x.squeeze(),
        lambda: [randn(_ranks(), 1, 3)],
        ["S0"],
    ),
    Case("x.squeeze(-1) 4x1 Shard(0)", lambda x: x.squeeze(-1), lambda: [randn(4, 1)], ["S0"]),
]


PATCH = Patch(
    name="squeeze",
    summary="squeeze only globally size-1 dims (torch 2.9 to 2.11)",
    ops=OPS,
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    overrides_existing=True,
    communication="none, unless a size-1 dim is itself sharded",
)
