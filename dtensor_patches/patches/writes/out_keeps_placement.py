"""An ``out=`` DTensor keeps its placements, and a view's base gets the write.

Trigger (2.9 to 2.13, measured on each of them, 2-rank CPU gloo mesh): an ``out=`` call
whose strategy decides another output placement than the out tensor's own. torch writes the
local result of its decision into the out's local tensor and relabels the out to that
placement: ``torch.amax(x, 1, out=o)`` with ``x`` ``Shard(1)`` and ``o`` ``Replicate()``
leaves ``o`` as ``Partial(max)`` (its ``to_local()`` a per-rank maximum, not the replica the
user made), and where ``o`` is a view of another DTensor (``out=buf[1]``,
``out=buf.view(...)``) the local write lands in a buffer of another layout: ``buf`` keeps its
old values, silently. The same for ``amin``, ``mean``, ``prod``, ``any``, ``var`` and ``std``
``out=``. No upstream report found; torch's dispatcher relabels every out tensor to the
decided output spec (``OpDispatcher``, the ``is_out_variant_op`` branch). From 2.14 torch
checks that a strategy places every tensor keyword: the reductions without a placement for
their out refuse clearly ("Strategy length 2 != expected 3"; the call fallback answers them
after ``apply_all()``) and the others (``var``, ``std``, ``sum``, ``cumsum`` ``out=``) follow
the out's placement (measured on 2.14.1 and 2.15.0): the gate ends there.

Fix: one miss rule for every op (``ANY_OP``). It acts on ``out=`` overloads whose out tensors
are all DTensors laid out with ``Shard``/``Replicate`` only, when torch's decision gives
another placement than an out's (seen in torch's own ``OutputSharding``, for the same global
shape; a resize stays torch's). The call then computes into scratch DTensors of torch's
decided placements (torch's own cached path), redistributes each result into its out's
placements, and copies the local results into the outs last: the outs keep their placements
and a view's base sees the write. All-or-nothing: nothing is written before every result is
computed and redistributed.

Cost: the rule runs once per sharding decision (on a miss) and is one tuple lookup for ops
without an out argument. Calls whose out already has the decided placement (the common case,
``mm.out`` and ``bmm.out`` from 2.13, whose strategies follow the out) keep torch's cached
fast path. A diverted call pays what the placement change costs (one redistribute of the
result) plus a local copy.

Not covered: ``out=`` overloads torch propagates through their decomposition (no strategy of
their own, 2.11+; torch's decision there is the output itself), and outs with a ``Partial``
placement (the rule leaves them to torch).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_shape_and_offset, local_tensor
from dtensor_patches._torch.schemas import out_argument_names
from dtensor_patches._torch.versions import torch_release
from dtensor_patches.dispatch.miss_rules import ANY_OP, DivertedCall, MissRule, NativeDecision
from dtensor_patches.dispatch.shards import sharded_result
from dtensor_patches.patch import CacheKey, Patch
from dtensor_patches.patches._along_shards import plain_layout
from dtensor_patches.patches.writes.out_tensors_keyed import PATCH as OUT_TENSORS_KEYED
from dtensor_patches.patches.writes.out_tensors_keyed import out_tensors_unkeyed

__all__ = ["PATCH"]


OPS = (
    "aten.amax.out",
    "aten.amin.out",
    "aten.any.out",
    "aten.eye.m_out",
    "aten.max.out",
    "aten.mean.out",
    "aten.min.out",
    "aten.prod.int_out",
    "aten.randint_like.low_dtype_out",
    "aten.std.correction_out",
    "aten.var.correction_out",
)
"""The ``out=`` overloads whose out tensors 2.9 to 2.11 leave out of the cache key (measured;
``tests/test_out_keeps_placement.py`` checks the running release): keyed here before 2.12. The
rule itself sees every ``out=`` overload."""


@functools.cache
def _out_names(op: Any) -> tuple[str, ...]:
    return out_argument_names(op)


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    names = _out_names(schema.op)
    if not names:
        return None
    outs = [schema.kwargs_schema.get(name) for name in names]
    if not all(hasattr(out, "placements") for out in outs):
        return None  # a plain tensor (the mixed-tensor patches' case) or no out given
    if not all(plain_layout(out.placements) for out in outs):
        return None
    specs = native.output_specs()
    if specs is None or len(specs) != len(outs):
        return None
    if any(getattr(spec, "placements", None) is None for spec in specs):
        return None
    if all(tuple(s.placements) == tuple(o.placements) for s, o in zip(specs, outs, strict=True)):
        return None
    if any(tuple(s.shape) != tuple(o.shape) for s, o in zip(specs, outs, strict=True)):
        return None  # torch resizes the out: its own business
    decided = tuple(tuple(spec.placements) for spec in specs)
    return functools.partial(_into_out_placements, decided)


def _scratch(out: Any, placements: Sequence[Any]) -> Any:
    """An uninitialised DTensor shaped and typed like ``out`` and placed ``placements``."""
    mesh = out.device_mesh
    local_shape, _ = local_shape_and_offset(out.shape, mesh, placements)
    local = torch.empty(local_shape, dtype=out.dtype, device=local_tensor(out).device)
    return sharded_result(local, mesh, placements, out.shape)


def _into_out_placements(
    decided: tuple[tuple[Any, ...], ...], op_call: Any, args: tuple[Any, ...], kwargs: dict
) -> Any:
    """Run ``op_call`` into scratch outs placed as torch decided, then write each result into
    its out in the out's own placements (see the module doc)."""
    names = _out_names(op_call)
    outs = [kwargs[name] for name in names]
    scratch = {
        name: _scratch(out, placements)
        for name, out, placements in zip(names, outs, decided, strict=True)
    }
    op_call(*args, **{**kwargs, **scratch})
    with torch.no_grad():
        values = [
            local_tensor(scratch[name].redistribute(out.device_mesh, out.placements))
            for name, out in zip(names, outs, strict=True)
        ]
        for out, value in zip(outs, values, strict=True):
            local_tensor(out).copy_(value)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _registrations() -> list[MissRule | CacheKey]:
    registrations: list[MissRule | CacheKey] = [MissRule(ANY_OP, _rule)]
    if torch_release() not in OUT_TENSORS_KEYED.gate:
        # The rule sees a call only on a miss, so the out's placement must key the decision:
        # else a call into a replicated out reuses the decision cached for the scratch out.
        # From 2.12 ``out_tensors_keyed`` keys them (required); before, this patch does.
        registrations += [
            CacheKey(op, None, table, keywords=outs)
            for table, op, outs in out_tensors_unkeyed()
            if op in OPS
        ]
    return registrations


def reproduce(mesh: Any) -> str | None:
    """``torch.amax(x, 1, out=o)`` and ``torch.amin(x, 0, out=buf.view(2, 3)[0])`` with ``x``
    sharded and ``o``/``buf`` replicated: the out's placements and the full values of ``o`` and
    ``buf`` against the plain calls. A clear refusal (2.14+: "Strategy length"; no strategy
    for the ``out=`` overload) is not this bug: ``None``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_patches.testing import raised_on_any_rank

    torch.manual_seed(11)
    # Sizes that leave no rank an empty shard on 2 or 4 ranks: an extremum of an empty shard
    # raises on that rank alone and the others wait in the reduction (``empty_shard_extrema``).
    rows = torch.randn(4, 8)
    columns = torch.randn(4, 3)
    calls = [
        ("torch.amax(x, 1, out=o)", rows, Shard(1), (4,), lambda x, o: torch.amax(x, 1, out=o)),
        (
            "torch.amin(x, 0, out=buf.view(2, 3)[0])",
            columns,
            Shard(0),
            (6,),
            lambda x, buf: torch.amin(x, 0, out=buf.view(2, 3)[0]),
        ),
    ]
    for label, full, placement, shape, call in calls:
        x = distribute_tensor(full, mesh, [placement])
        out = distribute_tensor(torch.zeros(shape), mesh, [Replicate()])
        want = torch.zeros(shape)
        call(full, want)
        _, raised = raised_on_any_rank(lambda call=call, x=x, out=out: call(x, out))
        if raised is not None:
            if "Strategy length" in raised or "does not have a sharding strategy" in raised:
                return None  # refused clearly: not a lost write
            return f"{label}: {raised}"
        if tuple(out.placements) != (Replicate(),):
            return f"{label}: the replicated out was relabelled {tuple(out.placements)}"
        if not torch.allclose(out.full_tensor(), want):
            return f"{label}: the out does not hold the single-device result"
    return None


PATCH = Patch(
    name="out_keeps_placement",
    summary="an out= DTensor keeps its placements and a view's base gets the write",
    ops=OPS,
    gate=SpecifierSet(">=2.9,<2.14"),
    registrations=_registrations,
    reproduce=reproduce,
    requires=("out_tensors_keyed",),
    overrides_existing=True,
    out_variants=False,
    communication=(
        "nothing on cached calls; a call whose out has another placement than torch decides: "
        "one redistribute of the result into the out's placements"
    ),
)
