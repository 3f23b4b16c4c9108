"""Indexed writes into a sharded DTensor fail on every release 2.9 to 2.15.

Trigger: ``x.index_put_((idx,), v)`` / ``x[idx] = v`` / ``x.index_put_(..., accumulate=True)``
with ``x`` sharded on an indexed dim (scattering per-token values into a sharded buffer).

A ``Partial(sum)`` target (every other mesh dim replicated) stays ``Partial(sum)`` with no
communication of the target: the values are written into the shares of mesh coordinate 0
and zeros into the others, which is what torch does where it can run such a call.

Fix: a custom handler (``dtensor_patches.dispatch.gather.inplace_through_full``): the write is applied
to the gathered tensor and each rank copies its own shard of the result back into the caller's
local tensor, so ``x`` changes in place, keeps its placements, and no write that lands on
another rank's shard is lost. The out-of-place ``index_put`` returns the same values,
``Replicate()``.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import full_tensor, local_tensor
from dtensor_patches._torch.schemas import op_arguments, resolve_op
from dtensor_patches.calls import mixed_and_sharded
from dtensor_patches.dispatch.gather import inplace_through_full, replicated_result
from dtensor_patches.dispatch.shards import partial_shares
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, randn


def _sum_partial_only(x: Any) -> bool:
    """Every mesh dim ``Partial(sum)`` or ``Replicate()``, at least one ``Partial(sum)``."""
    from torch.distributed.tensor import Partial, Replicate

    placements = x.placements
    return any(type(p) is Partial for p in placements) and all(
        (type(p) is Partial and p.reduce_op == "sum") or isinstance(p, Replicate)
        for p in placements
    )


def _put_into_partial(op_call: Any, args: Any, kwargs: Any) -> Any:
    """``index_put_`` into a ``Partial(sum)`` target, kept ``Partial(sum)`` with no
    communication of the target (as torch does where it can run the call): the values go into
    the shares of mesh coordinate 0, zeros into the others, so the shares reduce to the
    single-device result for ``accumulate`` either way. Indices and values are gathered (they
    are small next to the target)."""
    bound = op_arguments(op_call, tuple(args), dict(kwargs))
    target = bound["self"]
    indices = [full_tensor(i) for i in bound["indices"]]
    values = full_tensor(bound["values"])
    local = local_tensor(target)
    with torch.no_grad():
        share = partial_shares(values, target.device_mesh, target.placements)
        result = local.clone()
        result.index_put_(indices, share.to(local.dtype), accumulate=bool(bound["accumulate"]))
        local.copy_(result)
    return target


def _inplace(op_call: Any, args: Any, kwargs: Any) -> Any:
    from torch.distributed.tensor import DTensor

    target = args[0]
    if isinstance(target, DTensor) and _sum_partial_only(target):
        return _put_into_partial(op_call, args, kwargs)
    return inplace_through_full(op_call, args, kwargs)


def _functional(op_call: Any, args: Any, kwargs: Any) -> Any:
    from torch.distributed.tensor import DTensor

    target = args[0]
    if isinstance(target, DTensor) and _sum_partial_only(target):
        copy = DTensor.from_local(
            local_tensor(target).clone(),
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )
        inplace_op = resolve_op("aten.index_put_.default")
        return _put_into_partial(inplace_op, (copy, *args[1:]), kwargs)
    return replicated_result(op_call, args, kwargs)


def _registrations() -> list[Handler]:
    return [
        Handler("aten.index_put_.default", _inplace),
        Handler("aten._index_put_impl_.default", _inplace),
        Handler("aten.index_put.default", _functional),
    ]


def _idx() -> torch.Tensor:
    return torch.tensor([0, 3, 4, 3])


def _put(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return x.index_put_((_idx(),), v)


def _accumulate(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return x.index_put_((_idx(),), v, accumulate=True)


def _setitem(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    x[:, torch.tensor([1, 5])] = v
    return x


# The tripwire's cases: Indexed writes into a sharded dim; the caller's tensor is compared after the write.
CASES = [
    Case(
        "x.index_put_((idx,), v)",
        _put,
        lambda: [randn(5, 6), randn(4, 6, seed=1)],
        ["S0", "R"],
        inplace=True,
    ),
    Case(
        "index_put_(accumulate)",
        _accumulate,
        lambda: [randn(5, 6), randn(4, 6, seed=1)],
        ["S0", "R"],
        inplace=True,
    ),
    Case(
        "x[:, idx] = v",
        _setitem,
        lambda: [randn(5, 6), randn(5, 2, seed=1)],
        ["S1", "R"],
        inplace=True,
    ),
    Case(
        "index_put",
        lambda x, v: torch.index_put(x, (_idx(),), v),
        lambda: [randn(5, 6), randn(4, 6, seed=1)],
        ["S0", "R"],
    ),
]


def _put_into_sum(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    p = x.sum(0)
    return p.index_put_((torch.tensor([1, 3]),), v, accumulate=True)


CASES.append(
    Case(
        "x.sum(0).index_put_(accumulate)",
        _put_into_sum,
        lambda: [randn(4, 6), randn(2, seed=1)],
        ["S0", "R"],
    )
)


PATCH = Patch(
    name="index_put",
    summary="index_put_/index_put into sharded dims, in place, nothing lost",
    ops=("aten.index_put_.default", "aten._index_put_impl_.default", "aten.index_put.default"),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    concerns=mixed_and_sharded,
    replicates=True,
    overrides_existing=True,
    communication="**replicates** (gathers, writes back the shard)",
)
