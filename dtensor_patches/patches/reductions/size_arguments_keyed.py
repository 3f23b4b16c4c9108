"""``topk`` with another ``k``, ``histc`` with another ``bins``: the cached decision of the first
call is reused, and the result's shape is the first call's.

torch registers these ops with a ``RuntimeSchemaInfo(static_argnum=2)``: the propagation cache
hashes their arguments from index 2 on, not ``k`` / ``bins`` (index 1), so the second call with
the same input layouts gets the first call's output spec. ``topk(x, 4, dim=1)`` after
``topk(x, 2, dim=1)`` on a ``Shard(0)`` ``[n, 6]`` DTensor returns a DTensor of shape ``[n, 2]``
whose local tensors are ``[n / 2, 4]``; ``histc(r, bins=7)`` after ``bins=5`` claims shape
``[5]`` and holds 7 values. The values reach the user (``.to_local()``, a view, the next op)
under a wrong shape, and ``verify()`` reports it; no error is raised. Measured on every release
2.9.1 to 2.15.0, and on 2.15 for ``topk.values`` and ``histc.out`` too.

Fix (for the kind, not the two ops): every positional integer argument (``int``, ``SymInt``,
their lists and optionals; dtypes, layouts and memory formats are integers in op schemas)
that a registered ``RuntimeSchemaInfo`` leaves out of the key is put in it, by moving the
op's ``static_argnum`` down to it (:class:`~dtensor_patches.dispatch.cache_key.CacheKey`).
The ops are found in the release's own tables when the patch applies (:func:`keyed_too_late`):
an op torch adds with the same omission is found too, and ``tests/test_cache_keys.py`` fails
until it is listed here. Cost: one more cache entry per distinct value of such an argument;
nothing per cached call, no communication.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.schemas import positional_argument_types
from dtensor_patches.patch import CacheKey, Patch

# Every op the rule finds on some release 2.9.1 to 2.15.0 (measured): only ``topk`` and
# ``histc`` shape their output by the argument (``kthvalue``'s ``k`` picks values, not the
# shape); keying the rest changes no result and costs nothing.
OPS = (
    "aten.topk.default",
    "aten.topk.values",
    "aten.histc.default",
    "aten.histc.out",
    "aten.kthvalue.default",
    "aten.kthvalue.values",
    "aten.randint_like.default",
    "aten.randint_like.low_dtype",
    "aten.randint_like.low_dtype_out",
    "aten.to.dtype",
    "aten.mvlgamma.default",
    "aten.mvlgamma.out",
    "aten.mvlgamma_.default",
    "aten.polygamma.default",
    "aten.polygamma.out",
    "aten.polygamma_.default",
    "aten.ldexp.default",
    "aten.eye.m_out",
)

# The ops whose output shape is the argument: a call of one may be the case (when another call
# with another value came first); keying the others changes no result.
SHAPED_BY_ARGUMENT = ("aten.topk.", "aten.histc.")

_INTEGER = re.compile(r"(Optional\[)?(List\[)?(int|SymInt)(\[\])?\]?\]?")


def keyed_too_late() -> list[tuple[str, str, int]]:
    """``(table, op, index)`` for every op with a ``RuntimeSchemaInfo`` in this release's
    tables whose first positional integer argument that is not hashed lies at ``index``
    (before its ``static_argnum``)."""
    found = []
    for table, infos in torch_tables.schema_infos().items():
        for op, info in list(infos.items()):
            static = getattr(info, "static_argnum", None)
            if static is None:
                continue
            types = positional_argument_types(op)[:static]
            index = next((i for i, t in enumerate(types) if _INTEGER.fullmatch(t)), None)
            if index is not None:
                found.append((table, str(op), index))
    return found


def _registrations() -> list[CacheKey]:
    return [CacheKey(op, index, table) for table, op, index in keyed_too_late() if op in OPS]


def reproduce(mesh: Any) -> str | None:
    """``topk`` of a ``Shard(0)`` ``[2 p, 6]`` tensor along dim 1 with ``k = 2`` then ``4``, and
    ``histc`` of a ``Replicate()`` tensor with ``bins = 5`` then ``7``, against the plain
    tensors (shape and values)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rows = 2 * mesh.size()
    full = torch.arange(rows * 6, dtype=torch.float32).reshape(rows, 6).flip(1)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    for k in (2, 4):
        values = torch.topk(sharded, k, dim=1).values
        if tuple(values.shape) != (rows, k) or not torch.equal(
            values.full_tensor(), torch.topk(full, k, dim=1).values
        ):
            return f"topk(k={k}) after another k: shape {list(values.shape)}, expected {[rows, k]}"
    points = torch.tensor([1.5, 2.0, 7.0])
    replicated = distribute_tensor(points, mesh, [Replicate()])
    for bins in (5, 7):
        counts = torch.histc(replicated, bins=bins)
        if tuple(counts.shape) != (bins,) or not torch.equal(
            counts.to_local(), torch.histc(points, bins=bins)
        ):
            return f"histc(bins={bins}) after other bins: shape {list(counts.shape)}, expected [{bins}]"
    return None


PATCH = Patch(
    name="size_arguments_keyed",
    summary="topk's k, histc's bins (any integer argument) key the cached sharding decision",
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
    out_variants=False,
    # A call may be the case (only after a call with another value of the argument).
    concerns=lambda call: None if call.op.startswith(SHAPED_BY_ARGUMENT) else False,
    communication="none",
)
