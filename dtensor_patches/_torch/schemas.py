"""Op overloads and their schemas: names, written arguments, views, ``out=`` variants, argument
binding, and torch's pytree (``torch.utils._pytree``), which walks an op's arguments.

Facts about an op that come from its schema are cached per op (an ``OpOverload`` is a
process-wide singleton, and its schema never changes): the miss rules ask them on every cache
miss, the fallback on every call it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree

from dtensor_patches._torch.access import attribute, moved

if TYPE_CHECKING:
    from torch._ops import OpOverload

__all__ = [
    "all_aten_ops",
    "argument_names",
    "decomposes",
    "dtensor_decomposes",
    "has_decomposition",
    "inplace_overload",
    "is_random",
    "is_view_op",
    "op_arguments",
    "out_argument_names",
    "out_variant",
    "positional_argument_types",
    "resolve_op",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "writes_self",
    "written_positions",
]

tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves


def resolve_op(name: str) -> OpOverload:
    """``"aten.alias.default"`` -> ``torch.ops.aten.alias.default``.

    Raises:
        ValueError: ``name`` is not ``namespace.op.overload``.
        PatchError: the namespace, packet or overload does not exist in this torch.
    """
    parts = name.split(".")
    if len(parts) != 3:
        raise ValueError(f"op name must be 'namespace.op.overload', got {name!r}")
    namespace, packet, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError) as exc:
        raise moved(f"torch.ops.{name}", "no such operator") from exc


def _schema(op: OpOverload) -> Any:
    return attribute(op, "_schema", "OpOverload._schema")


@functools.cache
def written_positions(op: OpOverload) -> tuple[int, ...]:
    """Schema positions of the arguments ``op`` writes: in-place ``self``, ``out=``."""
    return tuple(
        i
        for i, a in enumerate(_schema(op).arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


@functools.cache
def argument_names(op: OpOverload) -> tuple[str, ...]:
    """The names of ``op``'s arguments, in schema order."""
    return tuple(a.name for a in _schema(op).arguments)


@functools.cache
def out_argument_names(op: Any) -> tuple[str, ...]:
    """The names of ``op``'s out tensors (``out``; ``values``, ``indices``, ...), ``()`` for an
    op that is no ``out=`` overload or no ``OpOverload`` at all."""
    if not isinstance(op, torch._ops.OpOverload):
        return ()
    return tuple(argument.name for argument in _schema(op).arguments if argument.is_out)


def positional_argument_types(op: OpOverload) -> tuple[str, ...]:
    """The schema types of ``op``'s arguments that may be passed by position (up to the first
    keyword-only one), as the schema prints them (``"Tensor"``, ``"int"``, ``"SymInt[]"``,
    ``"Optional[int]"``; a ``ScalarType``, ``Layout`` or ``MemoryFormat`` is an ``"int"``)."""
    types = []
    for argument in _schema(op).arguments:
        if argument.kwarg_only:
            break
        types.append(str(argument.type))
    return tuple(types)


@functools.cache
def writes_self(op: OpOverload) -> bool:
    """An in-place op: its first argument is written (``Tensor(a!) self``), not an ``out=``."""
    arguments = _schema(op).arguments
    first = arguments[0].alias_info if arguments else None
    return bool(
        first is not None
        and first.is_write
        and not arguments[0].is_out
        and not any(a.is_out for a in arguments)
    )


@functools.cache
def is_view_op(op: OpOverload) -> bool:
    """A view op: its outputs alias its first argument without writing it. Ops returning a
    list of views (``unbind``, ``split``, ``chunk``: ``Tensor(a -> *) self -> Tensor(a)[]``)
    are view ops too; their list's alias set is empty in the schema, the wildcard after-set of
    ``self`` says that the elements alias it (issue 23, item 4)."""
    schema = _schema(op)
    first = schema.arguments[0].alias_info if schema.arguments else None
    if first is None or first.is_write or not schema.returns:
        return False
    for out in schema.returns:
        alias = out.alias_info
        if alias is None or alias.is_write:
            return False
        if set(alias.before_set) & set(first.before_set):
            continue
        if not (isinstance(out.type, torch.ListType) and "*" in first.after_set):
            return False
    return True


def is_random(op: OpOverload) -> bool:
    """A random op (``Tag.nondeterministic_seeded``): ``dropout``, ``rand_like``, ``normal_``."""
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def inplace_overload(op: OpOverload) -> OpOverload:
    """The in-place overload of the same name: ``index_add.default`` -> ``index_add_.default``.

    Raises:
        PatchError: there is none.
    """
    overload = attribute(op, "_overloadname", "OpOverload._overloadname")
    return resolve_op(f"aten.{op.overloadpacket.__name__}_.{overload}")


def out_variant(name: str) -> str | None:
    """The ``out=`` overload of a functional op, e.g. ``"aten.cumprod.default"`` ->
    ``"aten.cumprod.out"``, ``"aten.kthvalue.default"`` -> ``"aten.kthvalue.values"``.

    An overload qualifies when its non-out arguments match the functional's (names and
    types, in order) and it has exactly one out argument: with several (``kthvalue.values``),
    DTensor was measured to leave the out tensors' placements stale (silently wrong), so those
    are not offered. ``None`` when there is none (or ``name`` is itself in-place or out=).

    Raises:
        PatchError: ``name`` does not exist in this torch.
    """
    schema = _schema(resolve_op(name))
    if any(a.is_out for a in schema.arguments) or any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    ):
        return None
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    namespace, packet, _ = name.split(".")
    packet_obj = getattr(getattr(torch.ops, namespace), packet)
    for overload in packet_obj.overloads():
        candidate = _schema(getattr(packet_obj, overload))
        outs = [a for a in candidate.arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in candidate.arguments if not a.is_out]
        if len(outs) == 1 and rest == wanted:
            return f"{namespace}.{packet}.{overload}"
    return None


def op_arguments(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of ``op``'s schema by name, as called (defaults filled in), in order.

    Handlers use it to read and rewrite arguments such as ``reduction`` whether they were
    passed positionally, by keyword or left at their default.

    Raises:
        PatchError: ``OpOverload._schema`` moved.
        TypeError: a required argument is missing.
    """
    bound: dict[str, Any] = {}
    for i, argument in enumerate(_schema(op).arguments):
        if i < len(args):
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            raise TypeError(f"{op}: missing argument {argument.name!r}")
    return bound


def all_aten_ops() -> list[str]:
    """Every ``aten`` operator overload this torch registers, as ``"aten.op.overload"``
    (``torch._C._dispatch_get_all_op_names``; an overload-less name is ``.default``).

    Raises:
        PatchError: the function moved.
    """
    names: Callable[[], list[str]] = attribute(
        torch._C, "_dispatch_get_all_op_names", "torch._C._dispatch_get_all_op_names"
    )
    out = []
    for name in names():
        namespace, _, rest = name.partition("::")
        if namespace != "aten":
            continue
        packet, _, overload = rest.partition(".")
        out.append(f"aten.{packet}.{overload or 'default'}")
    return sorted(out)


def has_decomposition(op_name: str) -> bool:
    """Whether ``op_name`` (``"aten.op.overload"``) has a CompositeImplicitAutograd kernel:
    DTensor decomposes such an op instead of asking for a strategy when it has none.

    Raises:
        PatchError: the dispatcher query moved.
    """
    namespace, packet, overload = op_name.split(".")
    qualified = f"{namespace}::{packet}" + ("" if overload == "default" else f".{overload}")
    has_kernel = attribute(
        torch._C,
        "_dispatch_has_kernel_for_dispatch_key",
        "torch._C._dispatch_has_kernel_for_dispatch_key",
    )
    return bool(has_kernel(qualified, torch._C.DispatchKey.CompositeImplicitAutograd))


def dtensor_decomposes(op_name: str) -> bool:
    """Whether this release's DTensor runs ``op_name`` (``"aten.op.overload"``), when the op has
    no strategy, by decomposing it: a CompositeImplicitAutograd kernel (every release), or,
    where DTensor propagates placements through decompositions (2.11+, see
    :func:`dtensor_patches._torch.versions.propagates_through_decompositions`), the check
    DTensor itself makes (``DecompShardingStrategy.has_decomp``: a ``torch._decomp`` entry).

    Raises:
        PatchError: the decomposition strategy moved in a release that should have it.
    """
    from dtensor_patches._torch.access import module
    from dtensor_patches._torch.versions import propagates_through_decompositions

    if has_decomposition(op_name):
        return True
    if not propagates_through_decompositions():
        return False
    dotted = "torch.distributed.tensor._decompositions"
    strategy = attribute(
        module(dotted), "DecompShardingStrategy", f"{dotted}.DecompShardingStrategy"
    )
    has_decomp = attribute(strategy, "has_decomp", f"{dotted}.DecompShardingStrategy.has_decomp")
    return bool(has_decomp(resolve_op(op_name)))


def decomposes(op: OpOverload) -> bool:
    """:func:`has_decomposition` for an ``OpOverload``."""
    return has_decomposition(str(op))


def _holds_tensors(type_: Any) -> bool:
    """Whether a schema argument type is ``Tensor`` or a list/optional of tensors."""
    return "Tensor" in str(type_)


@functools.cache
def ops_with_tensors_only_in_lists_or_out() -> tuple[str, ...]:
    """The ``aten`` and ``c10d`` overloads whose every tensor argument sits in a list
    (``Tensor[]``), is keyword-only (``out=``) or optional (``Tensor?``, as ``allreduce_``'s
    ``sparse_indices``): no positional ``Tensor`` argument that must be given. Where such
    an op has no DTensor strategy, torch 2.10's C++ dispatch finds no mesh for it (``found no
    DeviceMesh from dtensor args``). Read from the registered schemas once (about 10 ms).

    Raises:
        PatchError: ``torch._C._jit_get_all_schemas`` moved.
    """
    schemas: Callable[[], list[Any]] = attribute(
        torch._C, "_jit_get_all_schemas", "torch._C._jit_get_all_schemas"
    )
    found = set()
    for schema in schemas():
        namespace, _, packet = schema.name.partition("::")
        if namespace not in ("aten", "c10d"):
            continue
        kinds = [
            a.kwarg_only or a.type.kind() in ("ListType", "OptionalType")
            for a in schema.arguments
            if _holds_tensors(a.type)
        ]
        if kinds and all(kinds):
            found.add(f"{namespace}.{packet}.{schema.overload_name or 'default'}")
    return tuple(sorted(found))
