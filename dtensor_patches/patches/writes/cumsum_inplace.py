"""In-place ``cumsum_`` fails on DTensors on every release 2.9 to 2.15.

Measured (2-rank CPU gloo mesh): no sharding strategy for ``aten.cumsum_.default`` on 2.9 to
2.13; from 2.14 torch has one, but refuses a scan along the sharded dim (``in-place operations
that require placement changes are not supported``). Out-of-place ``cumsum`` works on every
release.

Fix: a custom handler: the scan runs through torch's own out-of-place ``cumsum`` strategy
(shards on other dims and ``Partial()`` stay, a shard on ``dim`` is gathered), and each rank
writes its block of the result back into the caller's local tensor, so ``x`` changes in place
and keeps its placements. Only a shard on ``dim`` moves data.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches.calls import partial_or_sharded_target
from dtensor_patches.dispatch.shards import shard_of
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import is_shard


def cumsum_inplace(op_call: Any, args: Any, kwargs: Any) -> Any:
    """``x.cumsum_(dim, dtype=None)``: ``args[0]`` updated in place, placements kept."""
    from torch.distributed.tensor import Replicate

    target = args[0]
    # A non-negative dim: torch 2.9 to 2.13's cumsum strategy mistakes a negative dim for an
    # unsharded one (see the cumsum_negative_dim patch), and this must not depend on it.
    dim = int(args[1]) % max(target.ndim, 1)
    out = torch.ops.aten.cumsum.default(target, dim, *args[2:], **kwargs)
    placements = tuple(target.placements)
    if tuple(out.placements) == placements:
        block = local_tensor(out)
    elif all(is_shard(p) or isinstance(p, Replicate) for p in placements):
        # Replicate/Shard -> Shard is a local slice: no communication.
        block = local_tensor(out.redistribute(target.device_mesh, placements))
    else:
        block = shard_of(out.full_tensor(), target.device_mesh, placements)
    with torch.no_grad():
        local_tensor(target).copy_(block)
    return target


def _registrations() -> list[Handler]:
    return [Handler("aten.cumsum_.default", cumsum_inplace)]


# The tripwire's cases: ``cumsum_`` along sharded and unsharded dims; the caller's tensor vs single-device.
CASES = [
    Case("x.cumsum_(1), x Shard(1)", lambda x: x.cumsum_(1), lambda: [randn(5, 6)], ["S1"], True),
    Case("x.cumsum_(1), x Shard(0)", lambda x: x.cumsum_(1), lambda: [randn(5, 6)], ["S0"], True),
    Case("x.cumsum_(0), x Partial()", lambda x: x.cumsum_(0), lambda: [randn(5, 6)], ["P"], True),
]


PATCH = Patch(
    name="cumsum_inplace",
    summary="in-place cumsum_ on sharded and Partial DTensors",
    ops=("aten.cumsum_.default",),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    concerns=partial_or_sharded_target,
    overrides_existing=True,
    communication="only a shard on `dim`",
)
