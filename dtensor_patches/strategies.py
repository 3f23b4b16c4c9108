"""Sharding-strategy builders written for this library (torch's own helpers move between releases).

A strategy function takes an ``OpSchema`` whose tensor arguments are ``OpStrategy`` objects (the
candidate placements of each input) and returns an ``OpStrategy`` listing acceptable
``OpSpec``s: the output placements, the input placements they need, and the cost of moving
each input there. DTensor then redistributes the inputs to the chosen input placements and runs
the op on the local shards.

The builders keep data sharded wherever the math allows and move only what must move:

- an op along dims ``D`` (a reduction, scan, sort, flip…) keeps ``Shard(d)`` for ``d`` not in
  ``D`` with no communication, and gathers (``Replicate()``) only mesh dims sharded on ``D``;
- a ``Partial()`` input is reduced first unless the op is linear in it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch

from dtensor_patches._torch.dtensors import dtensor_types, spec_with_placements
from dtensor_patches.errors import PatchError

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement, Shard

    from dtensor_patches._torch.types import (
        DTensorSpec,
        OpSchema,
        OpStrategy,
        RuntimeSchemaInfo,
        TensorMeta,
    )

__all__ = [
    "PartialRule",
    "PlacementRule",
    "additive_rule",
    "arg",
    "dimwise_strategy",
    "elementwise_strategy",
    "evenly_sharded",
    "follow_input_strategy",
    "is_shard",
    "normalize_dims",
    "redistribute_cost",
    "reduce_op_of",
    "replicate_strategy",
    "rule_strategy",
    "schema_info",
    "tensor_meta",
    "uniform_strategy",
]

# Decides one mesh dim of an elementwise op where some input is ``Partial``: gets
# ``[(position, placement), ...]`` (every tensor argument's current placement on that mesh dim)
# and returns ``(input placements in the same order, output placement)`` to keep a pending
# reduction, or ``None`` to replicate every input on that mesh dim first.
PartialRule = Callable[[list[tuple[int, "Placement"]]], "tuple[list[Placement], Placement] | None"]


def redistribute_cost(src: DTensorSpec, dst: DTensorSpec) -> float:
    """Rough cost of redistributing ``src`` to ``dst`` (both ``DTensorSpec``).

    Per mesh dim: zero where the placement stays, and where ``src`` is ``Replicate()`` (a shard
    or a ``Partial`` share of a replicated tensor is cut locally, as torch counts it), otherwise
    the tensor's size in bytes (an upper bound for one collective over it). Only the ordering
    matters to DTensor's strategy selection; without the zero for a replicated source, a
    pointwise ``Replicate() + Shard(d)`` tied between its candidates and could gather the shard
    (measured on 2.9 with ``partial_add_scalar``'s ``add`` strategy).
    """
    moves = [
        not (a == b or bool(getattr(a, "is_replicate", lambda: False)()))
        for a, b in zip(src.placements, dst.placements, strict=True)
    ]
    if not any(moves):
        return 0.0
    meta = src.tensor_meta
    if meta is None:
        return float(sum(moves))
    numel = 1
    for size in meta.shape:
        numel *= int(size)
    return float(numel * meta.dtype.itemsize * sum(moves))


def tensor_meta(strategy: OpStrategy) -> TensorMeta:
    """The ``TensorMeta`` (shape, stride, dtype) of a tensor argument's ``OpStrategy``."""
    meta = strategy.strategies[0].output_spec.tensor_meta
    if meta is None:
        raise PatchError("a tensor argument's strategy has no tensor meta (shape, dtype)")
    return meta


def normalize_dims(dims: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """``dims`` as non-negative ints; ``None`` or ``[]`` means every dim (as ATen reductions do).

    Raises:
        IndexError: a dim out of range for ``ndim``.
    """
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    if len(dims) == 0:
        return tuple(range(ndim))
    rank = max(ndim, 1)  # 0-d tensors accept dim 0 / -1
    out = []
    for d in dims:
        if not -rank <= d < rank:
            raise IndexError(f"dim {d} out of range for a {ndim}-d tensor")
        out.append(d % rank)
    return tuple(sorted(set(out)))


def _spec(template: DTensorSpec, placements: Sequence[Placement]) -> DTensorSpec:
    """A ``DTensorSpec`` like ``template`` (same mesh and tensor meta) with other placements."""
    return spec_with_placements(template, placements)


def is_shard(placement: Placement) -> TypeGuard[Shard]:
    """Exactly ``Shard(d)``: ``_StridedShard`` (a subclass) encodes an order not reasoned about here."""
    from torch.distributed.tensor import Shard

    return type(placement) is Shard


def _is_partial(placement: Placement) -> bool:
    return bool(getattr(placement, "is_partial", lambda: False)())


def reduce_op_of(placement: Placement) -> str | None:
    """The pending reduction (``"sum"``, ``"avg"``, ``"max"``…) of a ``Partial``, else ``None``."""
    return str(getattr(placement, "reduce_op", "sum")) if _is_partial(placement) else None


def _tensor_args(op_schema: OpSchema) -> list[tuple[int, OpStrategy]]:
    types = dtensor_types()
    return [(i, a) for i, a in enumerate(op_schema.args_schema) if isinstance(a, types.OpStrategy)]


# Maps one input placement (on one mesh dim) to (input placement needed, output placement).
PlacementRule = Callable[["Placement"], "tuple[Placement, Placement]"]


def rule_strategy(
    op_schema: OpSchema,
    rule: PlacementRule,
    *,
    num_outputs: int = 1,
    driver: int = 0,
    follow: Iterable[int] = (),
    tuple_output: bool = False,
) -> OpStrategy:
    """One ``OpSpec`` per candidate placement of the tensor argument at position ``driver``.

    ``rule`` maps each of its placements (one per mesh dim) to the placement the op needs and
    the output placement. Tensor arguments at positions in ``follow`` take the driver's input
    placements (same shape, e.g. ``mse_loss``'s target); every other tensor argument is
    replicated. ``num_outputs`` outputs all get the same placements; ``tuple_output`` for ops
    returning a list (``unbind``), whose output specs are a tuple even of length 0 or 1.

    Raises:
        PatchError: the argument at ``driver`` is not a tensor.
    """
    from torch.distributed.tensor import Replicate

    types = dtensor_types()
    tensors = _tensor_args(op_schema)
    by_position = dict(tensors)
    if driver not in by_position:
        raise PatchError(f"{op_schema.op}: expected a tensor argument at position {driver}")
    follow = set(follow)
    specs = []
    for candidate in (s.output_spec for s in by_position[driver].strategies):
        pairs = [rule(p) for p in candidate.placements]
        in_placements = [p for p, _ in pairs]
        out_placements = [p for _, p in pairs]
        input_specs = []
        costs = []
        for position, strategy in tensors:
            template = strategy.strategies[0].output_spec
            if position == driver or position in follow:
                wanted = _spec(template, in_placements)
            else:
                wanted = _spec(template, [Replicate()] * len(in_placements))
            input_specs.append(wanted)
            costs.append([redistribute_cost(s.output_spec, wanted) for s in strategy.strategies])
        out = _spec(candidate, out_placements)
        output_specs = (
            out
            if num_outputs == 1 and not tuple_output
            else tuple(copy.copy(out) for _ in range(num_outputs))
        )
        specs.append(
            types.OpSpec(
                output_specs=output_specs, input_specs=tuple(input_specs), redistribute_cost=costs
            )
        )
    return types.OpStrategy(specs)


def replicate_strategy(op_schema: OpSchema, *, num_outputs: int = 1, driver: int = 0) -> OpStrategy:
    """Gather every tensor argument; outputs replicated. Only where nothing sharded is correct."""
    from torch.distributed.tensor import Replicate

    return rule_strategy(
        op_schema, lambda p: (Replicate(), Replicate()), num_outputs=num_outputs, driver=driver
    )


def follow_input_strategy(op_schema: OpSchema) -> OpStrategy:
    """Output placements equal input placements, no communication (``alias``-like identities)."""
    return rule_strategy(op_schema, lambda p: (p, p), num_outputs=1)


def dimwise_strategy(
    op_schema: OpSchema,
    *,
    dims: int | Sequence[int] | None,
    keepdim: bool = True,
    num_outputs: int = 1,
    follow: Iterable[int] = (),
    linear: bool = False,
    tuple_output: bool = False,
) -> OpStrategy:
    """An op that works along ``dims`` of its first argument and independently along the rest.

    Covers reductions (``keepdim`` as the op's flag), scans, sorts, order statistics, flips:
    ``Shard(d)`` with ``d`` outside ``dims`` stays sharded (renumbered when reduced dims are
    dropped) with no communication; ``Shard(d)`` with ``d`` in ``dims`` and ``Partial()`` are
    replicated first (``linear=True`` keeps ``Partial()`` for ops linear in the input, such as
    ``flip`` and ``roll``). ``num_outputs`` outputs (values, indices…) all get the same
    placements, as they have the same shape.
    """
    from torch.distributed.tensor import Replicate, Shard

    ndim = len(tensor_meta(cast("OpStrategy", op_schema.args_schema[0])).shape)
    along = normalize_dims(dims, ndim)

    def rule(p: Any) -> tuple[Any, Any]:
        if is_shard(p) and p.dim not in along:
            out_dim = p.dim if keepdim else p.dim - sum(1 for d in along if d < p.dim)
            return p, Shard(out_dim)
        if linear and _is_partial(p):
            return p, p
        return Replicate(), Replicate()

    return rule_strategy(
        op_schema, rule, num_outputs=num_outputs, follow=follow, tuple_output=tuple_output
    )


def uniform_strategy(
    op_schema: OpSchema,
    *,
    num_outputs: int = 1,
    driver: int = 0,
    follow: Iterable[int] = (),
    keep_partial: bool = False,
    shard_dims: Iterable[int] | None = None,
) -> OpStrategy:
    """Elementwise in the ``driver`` argument: ``Shard(d)`` stays, outputs shaped like it.

    ``shard_dims`` limits the dims that may stay sharded (others are gathered), e.g. the batch
    and head dims of attention.

    ``Partial()`` is replicated first unless ``keep_partial`` (ops linear in the input).
    Arguments in ``follow`` are sharded like the first; the others are replicated.
    """
    from torch.distributed.tensor import Replicate

    allowed = None if shard_dims is None else set(shard_dims)

    def rule(p: Any) -> tuple[Any, Any]:
        if is_shard(p) and (allowed is None or p.dim in allowed):
            return p, p
        if keep_partial and _is_partial(p):
            return p, p
        return Replicate(), Replicate()

    return rule_strategy(op_schema, rule, num_outputs=num_outputs, driver=driver, follow=follow)


def arg(op_schema: OpSchema, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of the op, passed positionally at ``index`` or as a keyword."""
    if len(op_schema.args_schema) > index:
        return op_schema.args_schema[index]
    return op_schema.kwargs_schema.get(name, default)


def schema_info(
    static_argnum: int = 100,
    static_kwargkey: Sequence[str] | None = None,
    *,
    needs_pytree: bool = False,
) -> RuntimeSchemaInfo:
    """A ``RuntimeSchemaInfo``: which non-tensor arguments key the propagation cache.

    ``needs_pytree`` for ops taking a list of tensors (``stack``, ``cat``): DTensor then hands
    the strategy one ``TupleStrategy`` holding an ``OpStrategy`` per list element.
    """
    types = dtensor_types()
    return types.RuntimeSchemaInfo(
        static_argnum=static_argnum,
        static_kwargkey=list(static_kwargkey) if static_kwargkey else None,
        needs_pytree=needs_pytree,
    )


def evenly_sharded(spec: DTensorSpec, dim: int) -> bool:
    """Whether every rank holds the same number of elements along tensor ``dim`` under ``spec``.

    True when the product of the mesh sizes that shard ``dim`` divides its size, so that
    per-rank averages along ``dim`` weigh equally.
    """
    ways = 1
    for mesh_dim, p in enumerate(spec.placements):
        if is_shard(p) and p.dim == dim:
            ways *= spec.mesh.size(mesh_dim)
    assert spec.tensor_meta is not None, "a spec without tensor meta"
    return int(spec.tensor_meta.shape[dim]) % ways == 0


def elementwise_strategy(
    op_schema: OpSchema,
    *,
    partial_rule: PartialRule | None = None,
    replicated: Iterable[int] = (),
    driver: int | None = None,
) -> OpStrategy:
    """Elementwise op over its tensor arguments, with broadcasting.

    The output has the broadcast shape of the tensor arguments (python scalars are ignored).
    One candidate per candidate placement of every tensor argument, so a shard of any
    argument can be followed, whichever is larger:

    - ``Shard(d)`` of an argument on a non-broadcast dim stays sharded: the output is sharded
      on the matching dim and every other argument is sharded alike where it has that dim,
      replicated where it broadcasts along it (size 1 or missing). Any ``Shard`` subclass
      (``_StridedShard``) is kept as is when no argument broadcasts;
    - a mesh dim where some argument is ``Partial()`` asks ``partial_rule`` (keep the pending
      reduction when the op is linear in those arguments); without one, or when it declines,
      every argument is replicated on that mesh dim first (correct for any function);
    - anything else is replicated.

    Tensor arguments at positions in ``replicated`` take no part in the broadcast and are
    always replicated (an empty workspace argument, as ``log_sigmoid_backward``'s buffer on
    accelerators). DTensor picks the candidate that moves the least data.

    ``driver``: follow only the placements of the tensor argument at that position, for
    in-place ops (``masked_fill_``, ``clamp_min_``), whose output must keep ``self``'s
    placements and shape.

    Raises:
        PatchError: no tensor argument, or none at ``driver``.
    """
    from torch.distributed.tensor import Replicate, Shard

    types = dtensor_types()
    aside = set(replicated)
    everything = _tensor_args(op_schema)
    tensors = [(pos, st) for pos, st in everything if pos not in aside]
    if not tensors:
        raise PatchError(f"{op_schema.op}: expected a tensor argument")
    shapes = {pos: tuple(int(n) for n in tensor_meta(st).shape) for pos, st in tensors}
    out_shape = tuple(int(n) for n in torch.broadcast_shapes(*shapes.values()))
    out_ndim = len(out_shape)
    no_broadcast = all(shape == out_shape for shape in shapes.values())
    current = {pos: st.strategies[0].output_spec.placements for pos, st in tensors}
    mesh = tensors[0][1].strategies[0].output_spec.mesh

    def source_dim(pos: int, out_dim: int) -> int | None:
        shape = shapes[pos]
        d = out_dim - (out_ndim - len(shape))
        if d < 0 or shape[d] != out_shape[out_dim]:
            return None  # broadcast along out_dim
        return d

    followed = tensors if driver is None else [(p, st) for p, st in tensors if p == driver]
    if not followed:
        raise PatchError(f"{op_schema.op}: expected a tensor argument at position {driver}")
    seen: set[str] = set()
    specs = []
    for leader, strategy in followed:
        offset = out_ndim - len(shapes[leader])
        for candidate in strategy.strategies:
            out_placements: list[Any] = []
            in_placements: dict[int, list[Any]] = {pos: [] for pos in shapes}
            for mesh_dim, p in enumerate(candidate.output_spec.placements):
                if isinstance(p, Shard) and no_broadcast:
                    out_placements.append(p)
                    for pos in shapes:
                        in_placements[pos].append(p)
                    continue
                if is_shard(p) and source_dim(leader, p.dim + offset) is not None:
                    out_dim = p.dim + offset
                    out_placements.append(Shard(out_dim))
                    for pos in shapes:
                        d = source_dim(pos, out_dim)
                        in_placements[pos].append(Replicate() if d is None else Shard(d))
                    continue
                column = [(pos, p if pos == leader else current[pos][mesh_dim]) for pos in shapes]
                decision = None
                if partial_rule is not None and any(_is_partial(q) for _, q in column):
                    decision = partial_rule(column)
                if decision is None:
                    out_placements.append(Replicate())
                    for pos in shapes:
                        in_placements[pos].append(Replicate())
                else:
                    wanted, out = decision
                    out_placements.append(out)
                    for pos, q in zip(shapes, wanted, strict=True):
                        in_placements[pos].append(q)
            key = repr((out_placements, in_placements))
            if key in seen:
                continue
            seen.add(key)
            input_specs, costs = [], []
            for pos, st in everything:
                template = st.strategies[0].output_spec
                wanted_spec = _spec(
                    template, in_placements.get(pos, [Replicate()] * len(out_placements))
                )
                input_specs.append(wanted_spec)
                costs.append([redistribute_cost(s.output_spec, wanted_spec) for s in st.strategies])
            specs.append(
                types.OpSpec(
                    output_specs=types.DTensorSpec(mesh=mesh, placements=tuple(out_placements)),
                    input_specs=tuple(input_specs),
                    redistribute_cost=costs,
                )
            )
    return types.OpStrategy(specs)


def _is_replicate(placement: Placement) -> bool:
    return bool(getattr(placement, "is_replicate", lambda: False)())


def additive_rule(column: list[tuple[int, Placement]]) -> tuple[list[Placement], Placement] | None:
    """A :data:`PartialRule` for ``a + alpha * b`` (``add``, ``sub``, ``rsub``).

    ``sum(a_i) + r``: ``r`` is turned into a ``Partial(sum)`` share (on one rank, zeros on the
    others), so the output is ``Partial(sum)`` with no communication. ``avg(a_i) + r =
    avg(a_i + r)``. A python scalar (one tensor argument) is added on every rank, so only
    ``avg`` survives it. ``max``/``min``, mixed kinds and shards are reduced first.
    """
    from torch.distributed.tensor import Partial

    placements = [p for _, p in column]
    kinds = [reduce_op_of(p) for p in placements]
    if len(placements) == 1:
        return (placements, placements[0]) if kinds[0] == "avg" else None
    pending = {k for k in kinds if k is not None}
    if pending not in ({"sum"}, {"avg"}):
        return None
    if not all(k is not None or _is_replicate(p) for k, p in zip(kinds, placements, strict=True)):
        return None  # a shard on this mesh dim: another candidate follows it
    if pending == {"avg"}:
        return placements, Partial("avg")
    return [Partial("sum")] * len(placements), Partial("sum")
