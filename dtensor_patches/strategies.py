"""Sharding-strategy builders written for this library (torch's own helpers move between releases).

A strategy function takes an ``OpSchema`` whose tensor arguments are ``OpStrategy`` objects (the
candidate placements of each input) and returns an ``OpStrategy`` listing acceptable
``OpSpec``s: output placements, the input placements they need, and the cost of moving each
input there.
"""

from __future__ import annotations

import copy
from typing import Any

from dtensor_patches import compat
from dtensor_patches.errors import PatchError

__all__ = ["follow_input_strategy", "redistribute_cost"]


def redistribute_cost(src: Any, dst: Any) -> float:
    """Rough cost of redistributing ``src`` to ``dst`` (both ``DTensorSpec``).

    Zero when the placements are equal, otherwise the tensor's size in bytes (an upper bound
    for one collective over it); only the ordering matters to DTensor's strategy selection.
    """
    if tuple(src.placements) == tuple(dst.placements):
        return 0.0
    meta = src.tensor_meta
    if meta is None:
        return 1.0
    numel = 1
    for size in meta.shape:
        numel *= int(size)
    return float(numel * meta.dtype.itemsize)


def follow_input_strategy(op_schema: Any) -> Any:
    """Output placements equal input placements, no communication.

    For ops whose result, on any placement, is the same op applied to each local shard with the
    same layout: ``alias``, ``view_of``-like identities. The first argument must be a tensor;
    one ``OpSpec`` is offered per candidate placement of it.

    Raises:
        PatchError: the first argument is not a single tensor strategy.
    """
    types = compat.dtensor_types()
    src = op_schema.args_schema[0]
    if not isinstance(src, types.OpStrategy):
        raise PatchError(f"{op_schema.op}: expected a tensor first argument, got {type(src)}")
    candidates = [s.output_spec for s in src.strategies]
    specs = []
    for target in candidates:
        out = copy.copy(target)  # keeps every DTensorSpec field of this release (shard_order…)
        specs.append(
            types.OpSpec(
                output_specs=out,
                input_specs=(copy.copy(target),),
                redistribute_cost=[[redistribute_cost(c, target) for c in candidates]],
            )
        )
    return types.OpStrategy(specs)
