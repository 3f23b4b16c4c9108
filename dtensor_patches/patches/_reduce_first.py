"""A miss rule for ops that are wrong on a pending reduction: reduce the ``Partial`` inputs
first, then let torch run the call on the reduced inputs (its normal strategy).

The condition (an input placed ``Partial``) is in the op schema, so it is decided once per
distinct schema: calls without a ``Partial`` input keep torch's cached fast path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from dtensor_patches import compat
from dtensor_patches.patch import MissRule

__all__ = ["reduce_partial_first"]


def _has_partial(value: Any) -> bool:
    placements = getattr(value, "placements", None)
    return placements is not None and any(p.is_partial() for p in placements)


def _reduce(value: Any) -> Any:
    from torch.distributed.tensor import Replicate

    if isinstance(value, compat.dtensor_class()) and _has_partial(value):
        wanted = [Replicate() if p.is_partial() else p for p in value.placements]
        return value.detach().redistribute(value.device_mesh, wanted)
    return value


def _run_reduced(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with torch.no_grad():
        args, kwargs = pytree.tree_map(_reduce, (args, kwargs))
    return op_call(*args, **kwargs)


def _rule(schema: Any, native: compat.NativeDecision) -> compat.DivertedCall | None:
    leaves = pytree.tree_leaves((schema.args_schema, schema.kwargs_schema))
    return _run_reduced if any(_has_partial(x) for x in leaves) else None


def reduce_partial_first(op: str) -> MissRule:
    """A :class:`~dtensor_patches.patch.MissRule` for ``op``: calls with a ``Partial`` input
    run on the reduced (``Replicate()`` on those mesh dims) inputs instead."""
    return MissRule(op, _rule)
