"""Registration builders shared by several patches (not patches themselves):

- :func:`dimwise`: a strategy for an op that works along some dims (reductions, scans, order
  statistics, flips, ``select``), see :func:`dtensor_patches.strategies.dimwise_strategy`;
- :func:`partial_reduction`: a strategy for a reduction over dims that each rank can do on its
  shard (``nansum``, ``all``, ``any``): a shard on a reduced dim gives ``Partial`` of the op that
  combines the results, ``Partial`` inputs are reduced first;
- :func:`reduce_partial_first`: a miss rule for an op that is wrong on a pending reduction:
  ``Partial`` inputs are reduced first, then torch runs the call on the reduced inputs (its
  normal strategy). The condition is in the op schema, so it is decided once per distinct
  schema: calls without a ``Partial`` input keep torch's cached fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtensor_patches._torch.dtensors import is_dtensor
from dtensor_patches._torch.schemas import tree_leaves, tree_map
from dtensor_patches.dispatch.miss_rules import DivertedCall, MissRule, NativeDecision
from dtensor_patches.dispatch.strategy import Strategy
from dtensor_patches.strategies import (
    arg,
    dimwise_strategy,
    is_shard,
    normalize_dims,
    rule_strategy,
    schema_info,
    tensor_meta,
)

__all__ = ["dims_arg", "dimwise", "keepdim_arg", "partial_reduction", "reduce_partial_first"]

DimsOf = Callable[[Any], "int | Sequence[int] | None"]


def dims_arg(index: int, name: str = "dim", default: Any = None) -> DimsOf:
    """Read the op's dims from argument ``name`` (positional ``index``)."""
    return lambda op_schema: arg(op_schema, index, name, default)


def keepdim_arg(index: int, name: str = "keepdim") -> Callable[[Any], bool]:
    return lambda op_schema: bool(arg(op_schema, index, name, False))


def dimwise(
    op: str,
    *,
    dims: DimsOf,
    keepdim: bool | Callable[[Any], bool] = True,
    num_outputs: int | Callable[[Any], int] = 1,
    linear: bool = False,
    tuple_output: bool = False,
    static_argnum: int = 1,
    static_kwargkey: Sequence[str] | None = None,
) -> Strategy:
    """A :class:`Strategy` for ``op`` built on ``dimwise_strategy``.

    ``static_argnum``/``static_kwargkey`` name the non-tensor arguments (dims, keepdim, k…)
    that key the propagation cache; every argument from ``static_argnum`` on is hashed.
    """

    def strategy(op_schema: Any) -> Any:
        return dimwise_strategy(
            op_schema,
            dims=dims(op_schema),
            keepdim=keepdim(op_schema) if callable(keepdim) else keepdim,
            num_outputs=num_outputs(op_schema) if callable(num_outputs) else num_outputs,
            linear=linear,
            tuple_output=tuple_output,
        )

    return Strategy(op, strategy, schema_info(static_argnum, static_kwargkey))


def partial_reduction(
    op: str, combine: str, static_kwargkey: Sequence[str] | None = None
) -> Strategy:
    """A :class:`Strategy` for a reduction ``op(self, dim=None, keepdim=False, ...)`` whose
    per-shard results combine with one reduce op (``nansum``: ``"sum"``; ``all``:
    ``"product"``, an AND; ``any``: ``"sum"``, an OR): a shard on a reduced dim gives
    ``Partial(combine)``, a shard on another dim stays sharded (renumbered without
    ``keepdim``), anything else is replicated first (the reduction of ``Partial`` shares is
    not the reduction of their sum). No communication. ``static_kwargkey``: keyword
    arguments that key the propagation cache (``dtype``)."""

    def strategy(op_schema: Any) -> Any:
        from torch.distributed.tensor import Partial, Replicate, Shard

        ndim = len(tensor_meta(op_schema.args_schema[0]).shape)
        along = normalize_dims(arg(op_schema, 1, "dim"), ndim)
        keepdim = bool(arg(op_schema, 2, "keepdim", False))

        def rule(p: Any) -> tuple[Any, Any]:
            if is_shard(p) and p.dim in along:
                return p, Partial(combine)
            if is_shard(p):
                return p, Shard(p.dim if keepdim else p.dim - sum(1 for d in along if d < p.dim))
            return Replicate(), Replicate()

        return rule_strategy(op_schema, rule)

    return Strategy(op, strategy, schema_info(1, static_kwargkey))


def _has_partial(value: Any) -> bool:
    placements = getattr(value, "placements", None)
    return placements is not None and any(p.is_partial() for p in placements)


def _reduce(value: Any) -> Any:
    from torch.distributed.tensor import Replicate

    if is_dtensor(value) and _has_partial(value):
        wanted = [Replicate() if p.is_partial() else p for p in value.placements]
        return value.detach().redistribute(value.device_mesh, wanted)
    return value


def run_partials_reduced(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``op_call`` on its inputs with every ``Partial`` placement reduced first (a new
    DTensor each, no history: inside DTensor's dispatch)."""
    with torch.no_grad():
        args, kwargs = tree_map(_reduce, (args, kwargs))
    return op_call(*args, **kwargs)


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    leaves = tree_leaves((schema.args_schema, schema.kwargs_schema))
    return run_partials_reduced if any(_has_partial(x) for x in leaves) else None


def reduce_partial_first(op: str) -> MissRule:
    """A :class:`~dtensor_patches.dispatch.miss_rules.MissRule` for ``op``: calls with a ``Partial`` input
    run on the reduced (``Replicate()`` on those mesh dims) inputs instead."""
    return MissRule(op, _rule)


def holds_placement(values: Any, kind: type) -> bool:
    """Whether a spec in ``values`` (an op schema's arguments, lists walked) has a placement of
    class ``kind`` (``_MaskPartial``, ``_NormPartial``). Miss rules for every op run it on
    every miss of every op (AdamW's ``addcdiv_`` misses each step on 2.10/2.11 without
    ``float_keywords_unkeyed``), so it walks the schema in place, with no list built."""
    for value in values:
        if isinstance(value, (list, tuple)):
            if holds_placement(value, kind):
                return True
            continue
        for placement in getattr(value, "placements", None) or ():
            if isinstance(placement, kind):
                return True
    return False
