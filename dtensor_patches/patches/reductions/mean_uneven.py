"""``mean`` over an unevenly sharded dim is silently wrong on torch 2.9.

Trigger: ``x.mean()`` or ``x.mean(0)`` with ``x`` of shape 3x4 ``Shard(0)`` on 2 ranks: torch
2.9 averages each rank's shard and then averages those averages (``Partial(avg)``), which
weighs a 1-row shard like a 2-row one. Masked means of losses and advantages over batches that
do not divide by the data-parallel degree hit this; so does the backward of ``var``/``std``.

Fix (replacing torch's strategy): a mean along a sharded dim stays ``Partial(avg)`` only when
every rank holds the same number of elements along it; otherwise that dim is gathered first.
Shards on dims not reduced stay sharded; a ``Partial(sum)`` input stays ``Partial(sum)`` (the
mean is linear). Measured correct from torch 2.10.
"""

from __future__ import annotations

from typing import Any

from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import uneven_shards
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import (
    arg,
    evenly_sharded,
    is_shard,
    normalize_dims,
    rule_strategy,
    schema_info,
    tensor_meta,
)


def _mean_strategy(op_schema: Any) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    src = op_schema.args_schema[0]
    spec = src.strategies[0].output_spec
    ndim = len(tensor_meta(src).shape)
    along = normalize_dims(arg(op_schema, 1, "dim", None), ndim)
    keepdim = bool(arg(op_schema, 2, "keepdim", False))

    def rule(p: Any) -> tuple[Any, Any]:
        if is_shard(p) and p.dim not in along:
            out_dim = p.dim if keepdim else p.dim - sum(1 for d in along if d < p.dim)
            return p, Shard(out_dim)
        if is_shard(p) and evenly_sharded(spec, p.dim):
            return p, Partial("avg")
        if isinstance(p, Partial) and p.reduce_op == "sum":
            return p, p
        return Replicate(), Replicate()

    return rule_strategy(op_schema, rule)


def _registrations() -> list[Strategy]:
    return [
        Strategy("aten.mean.default", _mean_strategy, schema_info(1, ("dtype",))),
        Strategy("aten.mean.dim", _mean_strategy, schema_info(1, ("dtype",))),
    ]


# The tripwire's cases: Means over uneven and even shards vs single-device results.
CASES = [
    Case("x.mean() 3x4 Shard(0)", lambda x: x.mean(), lambda: [randn(3, 4)], ["S0"]),
    Case("x.mean(0) 3x4 Shard(0)", lambda x: x.mean(0), lambda: [randn(3, 4)], ["S0"]),
    Case(
        "x.mean(1, keepdim) 3x5 Shard(1)",
        lambda x: x.mean(1, keepdim=True),
        lambda: [randn(3, 5)],
        ["S1"],
    ),
    Case("x.mean(0) 4x4 Shard(0)", lambda x: x.mean(0), lambda: [randn(4, 4)], ["S0"]),
]


PATCH = Patch(
    name="mean_uneven",
    summary="correct mean over unevenly sharded dims (torch 2.9)",
    ops=("aten.mean.default", "aten.mean.dim"),
    gate=SpecifierSet(">=2.9,<2.10"),
    registrations=_registrations,
    cases=CASES,
    concerns=uneven_shards,
    upstream_fix="correct from torch 2.10 (measured)",
    overrides_existing=True,
    communication="only uneven reduced dims",
)
