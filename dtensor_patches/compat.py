"""The one place that touches private torch DTensor APIs.

Everything that reaches into ``torch.distributed.tensor._*`` or ``torch._C`` for DTensor lives
here, so that a torch release that moves an internal breaks exactly one module, loudly. Every
accessor raises :class:`~dtensor_patches.errors.PatchError` naming the missing internal; the
caller reports the patch as failed and leaves torch as it was.

How these internals moved between releases is recorded in ``shared/design.md`` §2 of the
project; the supported range here is torch 2.9 to 2.15:

- strategy functions take ``(op_schema)`` (2.7+); the output spec class is ``OpSpec`` (2.8+);
- ``ShardingPropagator.register_op_strategy``, ``op_strategy_funcs``, ``op_to_schema_info``
  and ``OpDispatcher._custom_op_handlers`` are stable across the range;
- single-dim strategies (``op_single_dim_strategy_funcs``) exist from 2.11 and take priority
  over ``op_strategy_funcs``;
- the Python propagation cache is a thread-local LRU (``propagate_op_sharding.cache_clear``);
  from 2.10 a C++ fast path keeps its own cache
  (``torch._C._clear_DTensor_sharding_propagator_cache``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from packaging.version import Version

from dtensor_patches.errors import PatchError

__all__ = [
    "REGISTRY_TABLES",
    "RegistrySnapshot",
    "clear_sharding_caches",
    "custom_op_handlers",
    "dispatch_natively",
    "dtensor_types",
    "has_native_handler",
    "has_native_strategy",
    "has_single_dim_strategy",
    "local_shape_and_offset",
    "local_tensor",
    "merge_snapshots",
    "op_arguments",
    "out_variant",
    "register_custom_handler",
    "register_strategy",
    "registry_state",
    "resolve_op",
    "restore",
    "set_placements",
    "sharding_propagator",
    "shares_storage",
    "snapshot",
    "torch_release",
    "torch_version",
    "view_geometry_is_global",
]

_MISSING = object()


def torch_version() -> Version:
    """The running torch version as a :class:`packaging.version.Version` (local label kept)."""
    return Version(torch.__version__)


def torch_release() -> Version:
    """The release the running torch is, or leads up to: pre-release, dev and local labels dropped.

    ``2.9.0a0+gitabc`` -> ``2.9.0``; ``2.14.1+cu130`` -> ``2.14.1``. Gates compare against this,
    because a nightly of 2.10 carries the 2.10 code base, not the 2.9 one.
    """
    return Version(torch_version().base_version)


def _attr(obj: Any, name: str, dotted: str) -> Any:
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise PatchError(
            f"torch {torch.__version__} has no {dotted}: this private DTensor API moved; "
            "dtensor_patches.compat needs updating for this release",
            internal=dotted,
        )
    return value


def _dtensor_class() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError as exc:  # pragma: no cover - torch < 2.5 is outside our range
        raise PatchError(
            f"torch {torch.__version__} has no torch.distributed.tensor.DTensor",
            internal="torch.distributed.tensor.DTensor",
        ) from exc
    return DTensor


def op_dispatcher() -> Any:
    """``DTensor._op_dispatcher``, the process-wide DTensor op dispatcher."""
    return _attr(_dtensor_class(), "_op_dispatcher", "DTensor._op_dispatcher")


def sharding_propagator() -> Any:
    """``DTensor._op_dispatcher.sharding_propagator``."""
    return _attr(
        op_dispatcher(), "sharding_propagator", "DTensor._op_dispatcher.sharding_propagator"
    )


def custom_op_handlers() -> dict[Any, Callable[..., object]]:
    """``DTensor._op_dispatcher._custom_op_handlers``: op -> handler, consulted before propagation."""
    return _attr(
        op_dispatcher(), "_custom_op_handlers", "DTensor._op_dispatcher._custom_op_handlers"
    )


@functools.cache
def dtensor_types() -> SimpleNamespace:
    """The private classes a strategy function builds with, resolved for the running release.

    Returns a namespace with ``OpSpec``, ``OpStrategy``, ``TupleStrategy``, ``OpSchema``,
    ``RuntimeSchemaInfo``, ``DTensorSpec`` and ``TensorMeta``.

    Raises:
        PatchError: one of them is missing (named in the error).
    """
    try:
        from torch.distributed.tensor import _dtensor_spec, _op_schema
    except ImportError as exc:
        raise PatchError(
            f"torch {torch.__version__} has no torch.distributed.tensor._op_schema / _dtensor_spec",
            internal="torch.distributed.tensor._op_schema",
        ) from exc
    prefix = "torch.distributed.tensor._op_schema."
    return SimpleNamespace(
        OpSpec=_attr(_op_schema, "OpSpec", prefix + "OpSpec"),
        OpStrategy=_attr(_op_schema, "OpStrategy", prefix + "OpStrategy"),
        TupleStrategy=_attr(_op_schema, "TupleStrategy", prefix + "TupleStrategy"),
        OpSchema=_attr(_op_schema, "OpSchema", prefix + "OpSchema"),
        RuntimeSchemaInfo=_attr(_op_schema, "RuntimeSchemaInfo", prefix + "RuntimeSchemaInfo"),
        DTensorSpec=_attr(
            _dtensor_spec, "DTensorSpec", "torch.distributed.tensor._dtensor_spec.DTensorSpec"
        ),
        TensorMeta=_attr(
            _dtensor_spec, "TensorMeta", "torch.distributed.tensor._dtensor_spec.TensorMeta"
        ),
    )


def resolve_op(name: str) -> torch._ops.OpOverload:
    """``"aten.alias.default"`` -> ``torch.ops.aten.alias.default``.

    Raises:
        PatchError: the namespace, packet or overload does not exist in this torch.
    """
    parts = name.split(".")
    if len(parts) != 3:
        raise ValueError(f"op name must be 'namespace.op.overload', got {name!r}")
    namespace, packet, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError) as exc:
        raise PatchError(
            f"torch {torch.__version__} has no operator {name}", internal=f"torch.ops.{name}"
        ) from exc


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
    op = resolve_op(name)
    schema = op._schema
    if any(a.is_out for a in schema.arguments) or any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    ):
        return None
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    namespace, packet, _ = name.split(".")
    packet_obj = getattr(getattr(torch.ops, namespace), packet)
    for overload in packet_obj.overloads():
        candidate = getattr(packet_obj, overload)._schema
        outs = [a for a in candidate.arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in candidate.arguments if not a.is_out]
        if len(outs) == 1 and rest == wanted:
            return f"{namespace}.{packet}.{overload}"
    return None


# The propagator/dispatcher dicts whose entries for an op decide how DTensor runs it.
# (owner, attribute, required): tables that not every supported release has are optional.
REGISTRY_TABLES: tuple[tuple[str, str, bool], ...] = (
    ("propagator", "op_strategy_funcs", True),
    ("propagator", "op_to_schema_info", True),
    ("propagator", "op_to_rules", True),
    ("propagator", "op_single_dim_strategy_funcs", False),  # 2.11+
    ("propagator", "op_to_schema_info_for_single_dim_strategy", False),  # 2.11+
    ("dispatcher", "_custom_op_handlers", True),
)


def _tables() -> dict[str, dict[Any, Any]]:
    owners = {"propagator": sharding_propagator(), "dispatcher": op_dispatcher()}
    tables: dict[str, dict[Any, Any]] = {}
    for owner, attr, required in REGISTRY_TABLES:
        dotted = f"{owner}.{attr}"
        table = getattr(owners[owner], attr, _MISSING)
        if table is _MISSING:
            if required:
                _attr(owners[owner], attr, dotted)  # raises PatchError naming it
            continue
        tables[dotted] = table
    return tables


@dataclass(frozen=True)
class RegistrySnapshot:
    """The registry entries of some ops, as they were when taken (absent keys recorded too)."""

    entries: dict[tuple[str, Any], Any] = field(default_factory=dict)


def snapshot(ops: Iterable[Any]) -> RegistrySnapshot:
    """Record every registry entry of ``ops`` (including their absence) for :func:`restore`."""
    tables = _tables()
    entries: dict[tuple[str, Any], Any] = {}
    for op in ops:
        for name, table in tables.items():
            entries[(name, op)] = table.get(op, _MISSING)
    return RegistrySnapshot(entries)


def restore(snap: RegistrySnapshot) -> None:
    """Put the recorded entries back exactly: re-insert old values, delete keys that were absent.

    Caches are not cleared here; call :func:`clear_sharding_caches` afterwards.
    """
    tables = _tables()
    for (name, op), value in snap.entries.items():
        table = tables[name]
        if value is _MISSING:
            table.pop(op, None)
        else:
            table[op] = value


def registry_state() -> dict[str, dict[Any, Any]]:
    """A shallow copy of every registry table, for comparing before/after (tests, doctor)."""
    return {name: dict(table) for name, table in _tables().items()}


def has_native_strategy(op: Any) -> bool:
    """Whether DTensor already has a sharding strategy or rule for ``op`` (any kind, any source)."""
    tables = _tables()
    return any(
        op in tables[name]
        for name in (
            "propagator.op_strategy_funcs",
            "propagator.op_to_rules",
            "propagator.op_single_dim_strategy_funcs",
        )
        if name in tables
    )


def has_single_dim_strategy(op: Any) -> bool:
    """Whether ``op`` has a single-dim strategy (2.11+), which shadows ``op_strategy_funcs``."""
    return op in getattr(sharding_propagator(), "op_single_dim_strategy_funcs", {})


def merge_snapshots(first: RegistrySnapshot, second: RegistrySnapshot) -> RegistrySnapshot:
    """One snapshot holding both; where both recorded an entry, ``first``'s (older) wins."""
    return RegistrySnapshot({**second.entries, **first.entries})


def has_native_handler(op: Any) -> bool:
    """Whether DTensor already routes ``op`` to a custom handler."""
    return op in custom_op_handlers()


def register_strategy(op: Any, strategy: Callable[[Any], Any], schema_info: Any = None) -> None:
    """Register ``strategy(op_schema) -> OpStrategy | TupleStrategy`` for ``op``.

    Uses ``ShardingPropagator.register_op_strategy``, stable from 2.4 through 2.15. Where a
    single-dim strategy exists for ``op`` (2.11+), DTensor would silently prefer it, so that
    case is refused.

    Raises:
        PatchError: the registration API is missing, or a single-dim strategy would shadow ours.
    """
    propagator = sharding_propagator()
    single_dim = getattr(propagator, "op_single_dim_strategy_funcs", {})
    if op in single_dim:
        raise PatchError(
            f"{op} has a single-dim strategy in torch {torch.__version__}; a strategy "
            "registered through op_strategy_funcs would be ignored",
            internal="ShardingPropagator.op_single_dim_strategy_funcs",
        )
    register = _attr(propagator, "register_op_strategy", "ShardingPropagator.register_op_strategy")
    register(op, strategy, schema_info)


def register_custom_handler(op: Any, handler: Callable[..., object]) -> None:
    """Route ``op`` on DTensors to ``handler(op_call, args, kwargs)`` before sharding propagation."""
    custom_op_handlers()[op] = handler


def clear_sharding_caches() -> None:
    """Clear every sharding-propagation cache of the running release.

    The Python cache is per thread (a ``threading.local`` LRU): this clears the calling
    thread's; other threads that already propagated the changed ops keep theirs, so apply
    patches before starting worker threads. From 2.10 the C++ fast path cache is cleared too.

    Raises:
        PatchError: a cache that this release must have is missing.
    """
    propagator = sharding_propagator()
    cached = _attr(propagator, "propagate_op_sharding", "ShardingPropagator.propagate_op_sharding")
    # 2.5-2.9 expose only the inner lru_cache (``.cache``); later releases add ``cache_clear``.
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()
    else:
        inner = _attr(cached, "cache", "ShardingPropagator.propagate_op_sharding.cache")
        _attr(inner, "cache_clear", "ShardingPropagator.propagate_op_sharding.cache.cache_clear")()
    if torch_release() >= Version("2.10"):
        _attr(
            torch._C,
            "_clear_DTensor_sharding_propagator_cache",
            "torch._C._clear_DTensor_sharding_propagator_cache",
        )()


def local_tensor(dtensor: Any) -> torch.Tensor:
    """The DTensor's local shard itself (``DTensor._local_tensor``), not a copy.

    In-place handlers write into it so that the caller's object changes in place; the public
    ``to_local()`` goes through autograd and is not meant for writing.

    Raises:
        PatchError: the attribute moved.
    """
    return _attr(dtensor, "_local_tensor", "DTensor._local_tensor")


# Serialises dispatch_natively: while one thread has an op's handler lifted, no other thread
# lifts or restores that table entry.
_NATIVE_DISPATCH_LOCK = threading.RLock()


def dispatch_natively(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Run ``op_call`` through DTensor's own dispatch, bypassing its custom handler.

    torch has no public way for a custom handler to hand a call back to normal sharding
    propagation, so the handler is lifted from ``OpDispatcher._custom_op_handlers`` for the
    duration of the call and put back afterwards (under a lock). A call of the same op from
    *another* thread inside that window also takes the native path; handlers that use this
    must therefore only add checks on top of correct native behaviour, never be required for
    correctness of ordinary calls.

    Raises:
        PatchError: the handler table moved.
        Whatever the native dispatch raises.
    """
    table = custom_op_handlers()
    with _NATIVE_DISPATCH_LOCK:
        handler = table.pop(op_call, _MISSING)
        try:
            return op_call(*args, **kwargs)
        finally:
            if handler is not _MISSING:
                table[op_call] = handler


def set_placements(dtensor: Any, placements: Iterable[Any]) -> None:
    """Relabel ``dtensor`` in place with ``placements`` (same mesh, same global shape).

    Only for relabels that keep the local tensor's shape (``Partial`` -> ``Replicate`` once
    the local tensor holds the reduced value). Writes ``DTensor._spec``.

    Raises:
        PatchError: ``DTensor._spec`` or ``DTensorSpec`` moved.
    """
    spec = _attr(dtensor, "_spec", "DTensor._spec")
    spec_class = dtensor_types().DTensorSpec
    dtensor._spec = spec_class(
        spec.mesh,
        tuple(placements),
        tensor_meta=_attr(spec, "tensor_meta", "DTensorSpec.tensor_meta"),
    )


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two plain tensors are views of one storage (identity, so empty tensors too)."""
    is_alias_of = _attr(torch._C, "_is_alias_of", "torch._C._is_alias_of")
    return bool(is_alias_of(a, b))


def view_geometry_is_global() -> bool:
    """Whether a DTensor view's ``stride()``/``storage_offset()`` describe its place in the
    global base tensor.

    Measured: from 2.10 the wrapper carries the global offset (``x[1:3]`` of a 4x6 base has
    offset 6); on 2.9 every DTensor view reports offset 0.
    """
    return torch_release() >= Version("2.10")


def local_shape_and_offset(
    global_shape: Iterable[int], mesh: Any, placements: Iterable[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and the global offset of its block, per tensor dim.

    Wraps ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` (same
    signature 2.9 to 2.15; 2.10 adds an optional ``skip_offset``), which cuts shards exactly as
    DTensor does (uneven and empty last shards, several mesh dims sharding one tensor dim).

    Raises:
        PatchError: the helper moved.
    """
    try:
        from torch.distributed.tensor import _utils
    except ImportError as exc:
        raise PatchError(
            f"torch {torch.__version__} has no torch.distributed.tensor._utils",
            internal="torch.distributed.tensor._utils",
        ) from exc
    compute = _attr(
        _utils,
        "compute_local_shape_and_global_offset",
        "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
    )
    shape, offset = compute(tuple(global_shape), mesh, tuple(placements))
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def op_arguments(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of ``op``'s schema by name, as called (defaults filled in), in order.

    Handlers use it to read and rewrite arguments such as ``reduction`` whether they were
    passed positionally, by keyword or left at their default.

    Raises:
        PatchError: ``OpOverload._schema`` moved.
        TypeError: a required argument is missing.
    """
    schema = _attr(op, "_schema", "OpOverload._schema")
    bound: dict[str, Any] = {}
    for i, argument in enumerate(schema.arguments):
        if i < len(args):
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            raise TypeError(f"{op}: missing argument {argument.name!r}")
    return bound
