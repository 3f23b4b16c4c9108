"""``torch.stack`` along a negative dim labels the output shards wrongly on torch 2.9 to 2.11.

Trigger: ``torch.stack([a, b], -1)`` with ``a`` and ``b`` of shape 3x4 ``Shard(1)`` (the last dim,
as ``Shard(-1)`` puts it): torch normalises ``dim=-1`` against the *input* rank (to 1) instead
of the output rank (to 2), so it shifts the shard to ``Shard(2)`` although the local stack put
the sharded dim at 1. The output claims shape 3x2x4 instead of 3x4x2: silently wrong (no error).
Any ``dim=-k`` with an input sharded on dim ``ndim - k`` does this (stacking per-head or
per-layer tensors along the last dim under tensor parallelism).

Fix (replacing torch's strategy): the new dim is normalised against ``ndim + 1``; each input keeps
its ``Shard(d)``, which becomes ``Shard(d + 1)`` at and after the new dim, with no communication.
``stack`` is linear, so a ``Partial`` shared by every input stays ``Partial``; anything else is
replicated. Measured fixed upstream in torch 2.12 (torch's strategy there normalises against the
output rank).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import dtensor_types, spec_with_placements
from dtensor_patches.errors import PatchError
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import arg, is_shard, redistribute_cost, schema_info, tensor_meta


def _is_partial(placement: Any) -> bool:
    return bool(getattr(placement, "is_partial", lambda: False)())


def _stack(op_schema: Any) -> Any:
    """Strategy for ``aten.stack.default(tensors, dim=0)``: one ``OpSpec`` per distinct input
    placement, every input redistributed to it, the output's shard dims shifted past ``dim``."""
    from torch.distributed.tensor import Replicate, Shard

    types = dtensor_types()
    inputs = op_schema.args_schema[0]
    if not isinstance(inputs, types.TupleStrategy):
        raise PatchError(f"{op_schema.op}: expected a list of tensors, got {type(inputs)}")
    children = list(inputs.children)
    ndim = len(tensor_meta(children[0]).shape)
    dim = int(arg(op_schema, 1, "dim", 0))
    if not -(ndim + 1) <= dim <= ndim:
        raise IndexError(f"stack: dim {dim} out of range for {ndim}-d inputs")
    dim %= ndim + 1  # the new dim counts in the output, which has one dim more
    current = [child.strategies[0].output_spec.placements for child in children]

    def rule(mesh_dim: int, p: Any) -> tuple[Any, Any]:
        if is_shard(p):
            return p, Shard(p.dim + 1 if p.dim >= dim else p.dim)
        # Linear: a Partial of the same kind on every input stays Partial.
        if _is_partial(p) and all(c[mesh_dim] == p for c in current):
            return p, p
        return Replicate(), Replicate()

    seen: set[tuple[Any, ...]] = set()
    specs = []
    for placements in current:
        pairs = [rule(i, p) for i, p in enumerate(placements)]
        wanted = tuple(p for p, _ in pairs)
        if wanted in seen:
            continue
        seen.add(wanted)
        input_specs, costs = [], []
        for child in children:
            template = child.strategies[0].output_spec
            spec = spec_with_placements(template, wanted)
            input_specs.append(spec)
            costs.append([redistribute_cost(s.output_spec, spec) for s in child.strategies])
        first = children[0].strategies[0].output_spec
        out = types.DTensorSpec(mesh=first.mesh, placements=tuple(p for _, p in pairs))
        specs.append(
            types.OpSpec(output_specs=out, input_specs=tuple(input_specs), redistribute_cost=costs)
        )
    return types.OpStrategy(specs)


def _registrations() -> list[Strategy]:
    return [Strategy("aten.stack.default", _stack, schema_info(1, needs_pytree=True))]


def _pair(*shape: int) -> list[torch.Tensor]:
    return [randn(*shape), randn(*shape, seed=1)]


# The tripwire's cases: ``stack`` along negative and positive dims of sharded inputs vs single-device results.
CASES = [
    Case(
        "stack([a, b], -1) Shard(1)",
        lambda a, b: torch.stack([a, b], -1),
        lambda: _pair(3, 4),
        ["S1", "S1"],
    ),
    Case(
        "stack([a, b], -2) Shard(0)",
        lambda a, b: torch.stack([a, b], -2),
        lambda: _pair(5, 4),
        ["S0", "S0"],
    ),
    Case(
        "stack([a, b], 1) Shard(1)",
        lambda a, b: torch.stack([a, b], 1),
        lambda: _pair(3, 5),
        ["S1", "S1"],
    ),
    Case(
        "stack([a, b], -1) Shard(0)/R",
        lambda a, b: torch.stack([a, b], -1),
        lambda: _pair(3, 4),
        ["S0", "R"],
    ),
]


PATCH = Patch(
    name="stack_dim",
    summary="stack along negative dims keeps the right shard dim (torch 2.9 to 2.11)",
    ops=("aten.stack.default",),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="torch 2.12 normalises stack's dim against the output rank (measured)",
    overrides_existing=True,
    communication="none",
)
