"""A max-type reduction over a sharded dim where some rank's shard is empty deadlocks, on every
release 2.9 to 2.15.

Trigger (measured on 2.13.0, 2 ranks; the strategy validator's ``amax``/``amin`` OpInfos
"crashed" on 2.9.1 to 2.13.0 for this): ``x`` of shape ``[1, 5]`` placed ``Shard(0)`` (rank 1
holds ``[0, 5]``: a dim smaller than the mesh, or ``5`` rows on 4 ranks, chunked ``2, 2, 1, 0``),
then ``x.amax(0)``, ``x.amin()``, ``x.max()``, ``torch.linalg.vector_norm(x, inf, dim=0)``, and
their ``out=`` overloads (``torch.amax(x, 0, out=o)``). torch's strategy keeps the input sharded and reduces the per-rank results (``Partial(max)``);
the rank with the empty shard raises in its local kernel ("Expected reduction dim 0 to have
non-zero size": a maximum has no identity element in ATen), and every other rank waits in the
reduction's collective forever: a hang, no error on those ranks. Sums, means and
``logsumexp`` are unaffected (an empty sum is ``0``). On 2.11 ``torch.max(x, 0)`` /
``torch.min(x, 0)`` (values and indices) go to a custom handler of torch's that fails the same
way: the rank with the empty shard raises, the others wait in the handler's all-gather.

Fix (a miss rule, consulted only on a cache miss, acting only when the schema shows an
input ``Shard(d)`` of a reduced dim ``d`` that leaves some rank's shard empty): the input is
first made ``Replicate()`` on those mesh dims (an all-gather of a dim shorter than the mesh
or of its last chunk: the input is small along it), then torch's strategy runs on it. Every
other call keeps torch's cached decision and pays nothing. Where torch answers
``max.dim``/``min.dim`` with its own handler (2.11), that handler is wrapped: the same check on
the call's input (a few attribute reads per call of these two ops only), the same gather, then
torch's handler. Neither path writes anything before the gather has succeeded: a failed
gather leaves every tensor as it was.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dtensor_patches._torch.modes import foreach_max
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches._torch.tables import custom_op_handlers
from dtensor_patches._torch.versions import torch_release
from dtensor_patches.calls import uneven_shards
from dtensor_patches.dispatch.miss_rules import ANY_OP, DivertedCall, NativeDecision
from dtensor_patches.dispatch.shards import nested_shards_leave_a_rank_empty
from dtensor_patches.patch import Handler, MissRule, Patch
from dtensor_patches.reproducers import compare, failure_of, randn
from dtensor_patches.strategies import normalize_dims

# op -> (position of its dims argument, its keyword) ; None: a reduction over every dim. An
# ``out=`` overload takes the same arguments as its functional op, ``out`` as a keyword.
_DIMS: dict[str, tuple[int, str] | None] = {
    "aten.amax.default": (1, "dim"),
    "aten.amax.out": (1, "dim"),
    "aten.amin.default": (1, "dim"),
    "aten.amin.out": (1, "dim"),
    "aten.max.default": None,
    "aten.max.unary_out": None,
    "aten.min.default": None,
    "aten.min.unary_out": None,
    "aten.aminmax.default": (1, "dim"),
    "aten.aminmax.out": (1, "dim"),
    "aten.linalg_vector_norm.default": (2, "dim"),
    "aten.linalg_vector_norm.out": (2, "dim"),
    # Values and indices along one dim: a strategy on most releases, torch's handler on 2.11.
    "aten.max.dim": (1, "dim"),
    "aten.max.dim_max": (1, "dim"),
    "aten.min.dim": (1, "dim"),
    "aten.min.dim_min": (1, "dim"),
    # Each tensor of a list, over every dim (what clipping by the inf norm runs).
    "aten._foreach_max.default": None,
}
# The norms whose value over an empty dim is undefined in ATen (a max or min of |x|).
_EXTREME_ORDERS = (math.inf, -math.inf)


def _dims_of(name: str, args: Any, kwargs: Any, ndim: int) -> tuple[int, ...] | None:
    """The dims the call ``name(*args, **kwargs)`` reduces (a call's arguments or its schema's:
    same positions), or ``None`` when it is not a max-type reduction (a finite vector norm)."""
    if name.startswith("aten.linalg_vector_norm."):
        order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
        if order not in _EXTREME_ORDERS:
            return None
    where = _DIMS[name]
    if where is None:
        return tuple(range(ndim))
    index, keyword = where
    dims = args[index] if len(args) > index else None
    return normalize_dims(kwargs.get(keyword, dims), ndim)


def _empty_mesh_dims(shape: Any, placements: Any, mesh: Any, dims: tuple[int, ...]) -> list[int]:
    """The mesh dims whose ``Shard`` of one of ``dims`` leaves some rank's shard empty: every
    mesh dim that shards such a dim, where its shards (nested over several mesh dims on a 2-D
    mesh: ``[Shard(0), Shard(0)]`` of 5 rows gives 2, 1, 1, 1; of 2 rows, two empty) leave
    some rank none."""
    out = []
    for dim in dims:
        sharding = [
            mesh_dim
            for mesh_dim, placement in enumerate(placements)
            if placement.is_shard() and placement.dim % len(shape) == dim
        ]
        ranks = [mesh.size(mesh_dim) for mesh_dim in sharding]
        if sharding and nested_shards_leave_a_rank_empty(int(shape[dim]), ranks):
            out.extend(sharding)
    return sorted(set(out))


# 2.9 has no strategy for _foreach_max (the fallback answers it, right); from 2.10 torch's
# strategy reduces each tensor's shards and hangs on an empty one.
_FOREACH_MAX_STRATEGY = Version("2.10")


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    name = str(schema.op)
    if name not in _DIMS or not schema.args_schema:
        return None
    if name == "aten._foreach_max.default" and torch_release() < _FOREACH_MAX_STRATEGY:
        return None
    first = schema.args_schema[0]
    for spec in first if isinstance(first, list | tuple) else (first,):
        placements = getattr(spec, "placements", None)
        if not placements or not any(p.is_shard() for p in placements):
            continue
        shape = tuple(spec.shape)
        dims = _dims_of(name, schema.args_schema, schema.kwargs_schema, len(shape))
        if dims and _empty_mesh_dims(shape, placements, spec.mesh, dims):
            return _run_gathered
    return None


def _run_gathered(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    name = str(op_call)
    if isinstance(args[0], list | tuple):
        gathered = [_gathered(x, _dims_of(name, (x,), {}, x.dim())) for x in args[0]]
        return op_call(gathered, *args[1:], **kwargs)
    x = args[0]
    return op_call(_gathered(x, _dims_of(name, args, kwargs, x.dim())), *args[1:], **kwargs)


def _gathered(x: Any, dims: tuple[int, ...] | None) -> Any:
    """``x`` made ``Replicate()`` on the mesh dims that shard one of ``dims`` with an empty
    shard (``x`` itself when there is none)."""
    from torch.distributed.tensor import Replicate

    empty = _empty_mesh_dims(tuple(x.shape), x.placements, x.device_mesh, dims or ())
    if not empty:
        return x
    wanted = [Replicate() if i in empty else p for i, p in enumerate(x.placements)]
    # Below autograd (inside DTensor's dispatch): the gather carries no history, and the
    # input itself is not changed (a new DTensor is gathered).
    with torch.no_grad():
        return x.redistribute(x.device_mesh, wanted)


def _around_handler(native: Any) -> Any:
    """torch's handler of ``max.dim``/``min.dim`` (2.11), run on the input gathered where its
    reduced dim leaves a rank empty."""

    def handle(op_call: Any, args: Any, kwargs: Any) -> Any:
        x = args[0]
        gathered = _gathered(x, _dims_of(str(op_call), args, kwargs, x.dim()))
        if gathered is not x:
            args = (gathered, *args[1:])
        return native(op_call, args, kwargs)

    return handle


def _registrations() -> list[MissRule | Handler]:
    registrations: list[MissRule | Handler] = [MissRule(ANY_OP, _rule)]
    handlers = custom_op_handlers()
    for name in ("aten.max.dim", "aten.min.dim"):
        # A handler of torch's bypasses sharding propagation, so the miss rule never sees it.
        if resolve_op(name) in handlers:
            registrations.append(Handler(name, around=_around_handler))
    return registrations


# name -> the reduction; run on a [1, 5] x placed Shard(0) (rank 1's shard is empty on 2
# ranks) and on a [6, 5] one (no empty shard: torch's own path).
_TRIGGERS: dict[str, Any] = {
    "x.amax(0)": lambda x: x.amax(0),
    "x.amin()": lambda x: x.amin(),
    "x.max()": lambda x: x.max(),
    "vector_norm(x, inf, dim=0)": lambda x: torch.linalg.vector_norm(x, math.inf, dim=0),
    "_foreach_max([x, x])": lambda x: torch.stack(foreach_max()([x, x * 2])),
    "torch.amax(x, 0, out=o)": lambda x: torch.amax(x, 0, out=_out_like(x, 5)),
    "torch.max(x, 0)": lambda x: torch.max(x, 0).values,
    "torch.min(x, 0, keepdim=True)": lambda x: torch.min(x, 0, keepdim=True).values,
}


def _out_like(x: Any, *shape: int) -> Any:
    """An ``out=`` tensor for a reduction of ``x``: a ``Replicate()`` DTensor when ``x`` is one."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    out = torch.zeros(shape, dtype=x.dtype)
    if isinstance(x, DTensor):
        return distribute_tensor(out, x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return out


def _errors_on_ranks(fn: Any, x: Any, group: Any) -> tuple[Any, list[tuple[int, str]]]:
    """``fn(x)`` on every rank, and each rank's error: an object all-gather every rank reaches
    (the op itself does not communicate before its output is read), so a rank that raised is
    seen without the hang it causes in user code."""
    import torch.distributed as dist

    got, error = failure_of(lambda: fn(x))
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return got, [(rank, e) for rank, e in enumerate(errors) if e is not None]


def reproduce(mesh: Any) -> str | None:
    """Each trigger on a ``[6, 5]`` and a ``[1, 5]`` ``Shard(0)`` x (rank 1's shard of the
    latter is empty): the single-device value, and no rank raising alone. A trigger torch
    refuses on every rank without an empty shard too (``_foreach_max`` on 2.9, ``amax.out`` on
    2.14+: no strategy, or a broken one) is not judged: the fallback answers it, not this patch."""
    from torch.distributed.tensor import Shard, distribute_tensor

    group = mesh.get_group()
    for label, fn in _TRIGGERS.items():
        for rows in (6, 1):
            full = randn(rows, 5, seed=rows)
            x = distribute_tensor(full, mesh, [Shard(0)])
            got, raised = _errors_on_ranks(fn, x, group)
            if rows == 6 and len(raised) == mesh.size():
                break
            if raised:
                ranks = ", ".join(str(rank) for rank, _ in raised)
                return (
                    f"{label} of a [{rows}, 5] Shard(0): raised on rank(s) {ranks}: {raised[0][1]}"
                )
            problem = compare(got.full_tensor(), fn(full), what=f"{label} of [{rows}, 5]")
            if problem is not None:
                return problem
    return None


PATCH = Patch(
    name="empty_shard_extrema",
    summary="a max/min-type reduction over a sharded dim that leaves a rank's shard empty "
    "gathers that dim first instead of raising on that rank and hanging the others",
    ops=tuple(_DIMS),
    gate=SpecifierSet(">=2.9"),
    overrides_existing=True,
    registrations=_registrations,
    reproduce=reproduce,
    # An empty shard is an uneven one (a dim shorter than the mesh, or than its chunks).
    concerns=uneven_shards,
    communication="an all-gather of the reduced dim where it is shorter than the mesh (or its "
    "last chunk is empty); the rest untouched",
    replicates=True,
)
