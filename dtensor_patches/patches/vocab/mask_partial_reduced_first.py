"""A vocab-parallel lookup's ``_MaskPartial`` result loses its mask once it is viewed, indexed or
reduced before its pending sum is reduced, on every release 2.9 to 2.15 (pytorch/pytorch#160697):
an ``IndexError`` or silently wrong values that differ between ranks.

Trigger: ``F.embedding(ids, weight)`` of a vocab-sharded ``Shard(0)`` weight with replicated ids
(a vocab-parallel embedding or output lookup used outside ``RowwiseParallel``, whose output hook
reduces it at once), then ``.view(...)``, ``e[0]``, ``e.sum(-1)`` on the result. torch keeps the
lookup's out-of-shard mask with the placement, shaped like the lookup; a view changes the shape
and the reduction fails (``IndexError: The shape of the mask [2, 3] ... does not match``), an
index raises an ``AssertionError``, and ``sum(-1)`` gave the right value on one rank and a wrong
one on the other (measured on 2.13.0, 2 ranks).

Fix (a miss rule for every op, consulted only on a cache miss, that acts only when an input is
placed ``_MaskPartial``): that input is reduced first (torch's own masked all-reduce, of the
lookup's size: the communication it would pay anyway) and becomes its ``Replicate()`` value in
place (torch releases the mask after one reduction, so a second use of the lookup, ``e.view(...)``
then ``e.sum()``, would otherwise reduce unmasked), then the op runs as usual. Such calls
run in Python on every call; every other call keeps torch's cached path, and torch's own
redistributions of the lookup (``RowwiseParallel``'s output hook) are not ops and are untouched.
``gather`` of ids does not make a ``_MaskPartial`` since ``gather_over_shards``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import (
    is_dtensor,
    is_mask_partial,
    local_tensor,
    mask_partial_class,
    set_local,
    set_spec,
    spec_of,
)
from dtensor_patches.dispatch.miss_rules import ANY_OP, DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches._builders import holds_placement
from dtensor_patches.reproducers import compare, failure_of, randn


def _masked(value: Any) -> bool:
    placements = getattr(value, "placements", None)
    return placements is not None and any(is_mask_partial(p) for p in placements)


def _reduce_masked(value: Any) -> Any:
    from torch.distributed.tensor import Replicate

    if isinstance(value, (list, tuple)):
        return type(value)(_reduce_masked(item) for item in value)
    if not (is_dtensor(value) and _masked(value)):
        return value
    wanted = [Replicate() if is_mask_partial(p) else p for p in value.placements]
    # No detach(): it is an op, and would come back to this rule with the same input. Below
    # autograd (inside DTensor's dispatch) the value carries no history to detach from.
    with torch.no_grad():
        reduced = value.redistribute(value.device_mesh, wanted)
    # torch releases the mask once it has reduced with it, so a second use of the same lookup
    # would reduce without it: the DTensor itself becomes its reduced value (same global
    # value and local shape; relabelled last, after the reduction succeeded).
    set_local(value, local_tensor(reduced))
    set_spec(value, spec_of(reduced))
    return value


def _run_reduced(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    args = tuple(_reduce_masked(a) for a in args)
    kwargs = {k: _reduce_masked(v) for k, v in kwargs.items()}
    return op_call(*args, **kwargs)


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    mask_partial = mask_partial_class()
    if holds_placement(schema.args_schema, mask_partial) or holds_placement(
        schema.kwargs_schema.values(), mask_partial
    ):
        return _run_reduced
    return None


def _registrations() -> list[MissRule]:
    mask_partial_class()  # a release that moved the class fails here, at apply time
    return [MissRule(ANY_OP, _rule)]


def reproduce(mesh: Any) -> str | None:
    """``F.embedding`` of replicated ids in a ``Shard(0)`` weight ``[10, 4]``, then a view, a
    reduction over the embedding dim, and an index of the lookup: single-device values."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    weight = randn(10, 4)
    ids = torch.tensor([[1, 7, 3], [9, 0, 5]])
    expected = F.embedding(ids, weight)
    dist_weight = distribute_tensor(weight, mesh, [Shard(0)])
    dist_ids = distribute_tensor(ids, mesh, [Replicate()])
    twice = F.embedding(dist_ids, dist_weight)
    for label, then in (
        ("embedding(ids, Shard(0) weight).view(-1, 4)", lambda e: e.view(-1, 4)),
        ("embedding(ids, Shard(0) weight).sum(-1)", lambda e: e.sum(-1)),
        ("embedding(ids, Shard(0) weight)[0]", lambda e: e[0]),
        (
            "e = embedding(...); e.view(-1, 4); then e.sum(-1)",
            lambda e: (twice.view(-1, 4), twice.sum(-1))[1] if is_dtensor(e) else e.sum(-1),
        ),
    ):
        got, error = failure_of(
            lambda then=then: then(F.embedding(dist_ids, dist_weight)).full_tensor()
        )
        if error is not None:
            return f"{label}: {error}"
        problem = compare(got, then(expected), what=label)
        if problem is not None:
            return problem
    return None


PATCH = Patch(
    name="mask_partial_reduced_first",
    summary="a vocab-parallel lookup's _MaskPartial result is reduced before an op that would lose its mask (view, index, reduction)",
    # The op that makes a _MaskPartial; the rule itself looks at every op's inputs.
    ops=("aten.embedding.default",),
    gate=SpecifierSet(">=2.9"),
    overrides_existing=True,
    registrations=_registrations,
    reproduce=reproduce,
    upstream_issue="https://github.com/pytorch/pytorch/issues/160697",
    communication="the masked all-reduce of the lookup, as torch's own reduction of it",
)
