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

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import torch
from packaging.version import Version

from dtensor_patches.errors import PatchError

__all__ = [
    "ANY_OP",
    "FALLBACK_DECISION",
    "LOSS_PARALLEL_HANDLERS",
    "LOSS_PARALLEL_MODULE",
    "MODULE_FUNCTION_SITES",
    "PARALLEL_STYLE_MODULE",
    "REGISTRY_TABLES",
    "CallFallback",
    "DivertedCall",
    "MissRule",
    "NativeDecision",
    "all_aten_ops",
    "any_op_key",
    "check_call_time_internals",
    "clear_sharding_caches",
    "current_autograd_node",
    "custom_op_handlers",
    "dispatch_mode_class",
    "dtensor_class",
    "dtensor_types",
    "entry_in_effect",
    "entry_owner",
    "full_value",
    "has_decomposition",
    "has_native_handler",
    "has_native_strategy",
    "has_single_dim_strategy",
    "install_miss_hook",
    "install_owned",
    "is_applied",
    "local_shape_and_offset",
    "local_shape_and_offset_function",
    "local_tensor",
    "loss_parallel_internals",
    "lost_entries",
    "make_dtensor",
    "mark_applied",
    "miss_hook_installed",
    "miss_rules_table",
    "module_function",
    "module_functions_replaced",
    "native_registry",
    "op_arguments",
    "out_variant",
    "owned_entries",
    "parallel_style_internals",
    "reassert_owned",
    "register_custom_handler",
    "register_miss_rule",
    "register_strategy",
    "registry_state",
    "remove_miss_hook_if_unused",
    "remove_owner",
    "replace_module_functions",
    "resolve_op",
    "restore_module_functions",
    "set_call_fallback",
    "set_placements",
    "sharding_propagator",
    "shares_storage",
    "spec_shape",
    "spec_with_placements",
    "table_names",
    "torch_release",
    "torch_version",
    "view_geometry_is_global",
    "watch_decisions",
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


def dtensor_class() -> type:
    """``torch.distributed.tensor.DTensor``."""
    return _dtensor_class()


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
_MISS_RULES_TABLE = "dtensor_patches.miss_rules"


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
    tables[_MISS_RULES_TABLE] = _MISS_RULES
    tables.update(_loss_parallel_tables())
    tables.update(_parallel_style_tables())
    return tables


PARALLEL_STYLE_MODULE = "parallel_style.module"
"""Table name of ``torch.distributed.tensor.parallel.style``'s globals: the parallel styles
look ``distribute_module`` up there when they run (a patch may wrap it)."""


def _parallel_style_tables() -> dict[str, dict[Any, Any]]:
    try:
        from torch.distributed.tensor.parallel import style
    except ImportError:
        return {}
    if not callable(vars(style).get("distribute_module")):
        return {}
    return {PARALLEL_STYLE_MODULE: vars(style)}


def parallel_style_internals() -> SimpleNamespace:
    """``torch.distributed.tensor.parallel.style`` and the ``distribute_module`` its styles
    (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``…) call, 2.9 to 2.15.

    Raises:
        PatchError: either moved.
    """
    try:
        from torch.distributed.tensor.parallel import style
    except ImportError as exc:
        raise PatchError(
            f"torch {torch.__version__} has no torch.distributed.tensor.parallel.style",
            internal="torch.distributed.tensor.parallel.style",
        ) from exc
    return SimpleNamespace(
        module=style,
        distribute_module=_attr(
            style,
            "distribute_module",
            "torch.distributed.tensor.parallel.style.distribute_module",
        ),
    )


LOSS_PARALLEL_HANDLERS = "loss_parallel.customized_loss_ops"
"""Table name of ``loss_parallel()``'s op -> handler dict (what it installs on entering)."""
LOSS_PARALLEL_MODULE = "loss_parallel.module"
"""Table name of ``torch.distributed.tensor.parallel.loss``'s globals, whose functions
``loss_parallel()`` looks up when it runs (a patch may wrap ``_disable_custom_loss_ops``)."""


def _loss_parallel_tables() -> dict[str, dict[Any, Any]]:
    try:
        from torch.distributed.tensor.parallel import loss
    except ImportError:
        return {}
    handlers = getattr(loss, "customized_loss_ops", None)
    if not isinstance(handlers, dict):
        return {}
    return {LOSS_PARALLEL_HANDLERS: handlers, LOSS_PARALLEL_MODULE: vars(loss)}


def table_names() -> list[str]:
    """The names of every registry table (see :func:`registry_state`), without copying them."""
    return list(_tables())


# --- Ownership of registry entries -------------------------------------------------------
#
# Patches may change the same entry (two patches on ``argmax`` on 2.9) and may be reverted in
# any order (two ``patched()`` blocks in two threads). Each changed entry keeps a stack of
# (owner, value) layers over the value torch had before the first change; the table holds the
# top layer. Reverting an owner removes its layers only: the entry falls back to the layer
# below, or to torch's original once no layer is left. All calls hold REGISTRY_LOCK
# (dtensor_patches.patch), so these dicts need no lock of their own.

_LAYERS: dict[tuple[str, Any], list[tuple[object, Any]]] = {}
_ORIGINALS: dict[tuple[str, Any], Any] = {}
_APPLIED_OWNERS: dict[object, tuple[Any, ...]] = {}


def install_owned(owner: object, ops: Iterable[Any], change: Callable[[], None]) -> list[Any]:
    """Run ``change()`` (which registers entries for ``ops`` through torch's own APIs) and
    record every table entry of ``ops`` it changed as a layer of ``owner``.

    Returns the ops whose entries changed. On an exception inside ``change()`` the entries
    it changed so far are recorded too, so :func:`remove_owner` undoes them.
    """
    ops = list(ops)
    tables = _tables()
    before = {(name, op): table.get(op, _MISSING) for name, table in tables.items() for op in ops}
    try:
        change()
    finally:
        changed = []
        for (name, op), old in before.items():
            new = tables[name].get(op, _MISSING)
            if new is old:
                continue
            key = (name, op)
            if key not in _LAYERS:
                _ORIGINALS[key] = old
                _LAYERS[key] = []
            _LAYERS[key].append((owner, new))
            changed.append(op)
    return list(dict.fromkeys(changed))


def remove_owner(owner: object) -> list[Any]:
    """Remove every layer of ``owner``; entries fall back to the layer below or to torch's
    original. Returns the ops whose effective entry changed (their caches are stale)."""
    tables = _tables()
    stale = []
    for key in [k for k, layers in _LAYERS.items() if any(o is owner for o, _ in layers)]:
        name, op = key
        layers = _LAYERS[key]
        on_top = layers[-1][0] is owner
        layers[:] = [(o, v) for o, v in layers if o is not owner]
        if not on_top:
            continue
        value = layers[-1][1] if layers else _ORIGINALS[key]
        if value is _MISSING:
            tables[name].pop(op, None)
        else:
            tables[name][op] = value
        if not layers:
            del _LAYERS[key], _ORIGINALS[key]
        stale.append(op)
    _APPLIED_OWNERS.pop(owner, None)
    remove_miss_hook_if_unused()
    return list(dict.fromkeys(stale))


def mark_applied(owner: object, ops: Iterable[Any]) -> None:
    """Record ``owner`` as applied (the single source of truth for ``Patch.is_applied``)."""
    _APPLIED_OWNERS[owner] = tuple(ops)


def is_applied(owner: object) -> bool:
    """Whether ``owner`` was applied and not removed since."""
    return owner in _APPLIED_OWNERS


def owned_entries(owner: object) -> dict[tuple[str, Any], Any]:
    """The entries ``owner`` installed: ``(table, op) -> value`` (for status checks)."""
    out = {}
    for key, layers in _LAYERS.items():
        for o, value in layers:
            if o is owner:
                out[key] = value
    return out


def reassert_owned(table: str, ops: Iterable[Any]) -> list[Any]:
    """Put the top ownership layer of ``table``'s entry for each of ``ops`` back where
    something outside this library (a torch context manager) replaced or removed it.

    Returns the ops whose entry was put back (their cached decisions are stale: the caller
    clears the caches). Entries no patch owns are left as they are.
    """
    tables = _tables()
    restored = []
    for op in ops:
        layers = _LAYERS.get((table, op))
        if not layers:
            continue
        value = layers[-1][1]
        if tables[table].get(op, _MISSING) is not value:
            tables[table][op] = value
            restored.append(op)
    return restored


def lost_entries(owner: object) -> list[tuple[str, Any]]:
    """The ``(table, op)`` entries ``owner`` installed that torch's tables no longer hold:
    the table holds neither ``owner``'s value nor that of a layer stacked over it (something
    outside this library replaced or removed it)."""
    tables = _tables()
    lost = []
    for key, layers in _LAYERS.items():
        if not any(o is owner for o, _ in layers):
            continue
        name, op = key
        if tables[name].get(op, _MISSING) is not layers[-1][1]:
            lost.append(key)
    return lost


def entry_in_effect(table: str, op: Any) -> Any:
    """What ``table`` holds for ``op`` right now (``None`` when absent)."""
    return _tables()[table].get(op)


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
    """Clear every cache of sharding decisions, in every thread, and the redistribution plans
    that were built from them.

    - The Python propagation cache is a ``threading.local`` LRU: clearing it clears only the
      calling thread's. It is replaced by a fresh instance over the same function instead, so
      every thread starts empty (a thread-local object keeps one dict per thread).
    - From 2.10 the C++ fast path keeps its own cache, cleared with
      ``torch._C._clear_DTensor_sharding_propagator_cache``.
    - The redistribution planner ``_redistribute._gen_transform_infos`` caches transform steps
      keyed by specs *by value* and keeps the placement objects of the first call. A
      ``_MaskPartial`` placement (vocab-parallel embedding) carries its mask buffer on the
      object, so clearing only the sharding cache makes a fresh embedding decision meet stale
      transform steps whose buffer was already released: on 2.9.1 the next forward of a
      TP + SP model raises ``AssertionError`` in ``_MaskPartial._reduce_shard_value``
      (measured). The two caches are therefore cleared together.

    Raises:
        PatchError: a cache that this release must have is missing.
    """
    propagator = sharding_propagator()
    cached = _attr(propagator, "propagate_op_sharding", "ShardingPropagator.propagate_op_sharding")
    inner = _attr(cached, "cache", "ShardingPropagator.propagate_op_sharding.cache")
    function = _attr(inner, "__wrapped__", "ShardingPropagator.propagate_op_sharding.cache")
    propagator.propagate_op_sharding = type(cached)(function)
    if torch_release() >= Version("2.10"):
        _attr(
            torch._C,
            "_clear_DTensor_sharding_propagator_cache",
            "torch._C._clear_DTensor_sharding_propagator_cache",
        )()
    try:
        from torch.distributed.tensor import _redistribute
    except ImportError as exc:
        raise PatchError(
            f"torch {torch.__version__} has no torch.distributed.tensor._redistribute",
            internal="torch.distributed.tensor._redistribute",
        ) from exc
    plans = _attr(
        _redistribute,
        "_gen_transform_infos",
        "torch.distributed.tensor._redistribute._gen_transform_infos",
    )
    _attr(plans, "cache_clear", "_redistribute._gen_transform_infos.cache_clear")()


def local_tensor(dtensor: Any) -> torch.Tensor:
    """The DTensor's local shard itself (``DTensor._local_tensor``), not a copy.

    In-place handlers write into it so that the caller's object changes in place; the public
    ``to_local()`` goes through autograd and is not meant for writing.

    Raises:
        PatchError: the attribute moved.
    """
    return _attr(dtensor, "_local_tensor", "DTensor._local_tensor")


# --- The miss hook ---------------------------------------------------------------------
#
# DTensor decides how to run a call (its ``OutputSharding``) once per distinct op schema and
# caches the decision; cached calls never reach Python on 2.10+ (C++ fast path) and reach
# only a cache lookup on 2.9. The rare cases this library must act on (a ``Partial`` target
# of an in-place op, a view op that has to redistribute its input, a call torch refuses) are
# all visible in the op schema, so they are decided where a schema meets propagation without
# a cached decision: a *miss*. A miss rule sees the schema and, on demand, torch's own
# decision; it returns ``None`` (torch's decision stands, and is cached as usual) or a
# function that runs the call instead. A diverted call is never cached, so the next call with
# the same schema comes back to its rule; every other call keeps torch's fast path.
#
# Where the hook sits, by release (read from the wheels):
# - 2.10+: ``OpDispatcher._propagate_op_sharding_dispatch_slow_path(op_call, args, kwargs,
#   op_info, try_cache)``, called by the C++ dispatcher on a cache miss; a result that is not
#   an ``OutputSharding`` is returned to the caller as the op's output (torch itself does this
#   for CompositeImplicitAutograd decompositions), and is not cached.
# - 2.9: ``OpDispatcher.dispatch`` is Python. The hook replaces the propagator's per-thread
#   cache with one over a wrapped ``propagate_op_sharding_non_cached``; a diverting rule raises
#   :class:`_Divert` (a ``BaseException``, so torch's ``except Exception`` re-wrapping lets it
#   through) and a thin wrapper around ``dispatch`` catches it and runs the call.

# A function that runs a diverted call: (op_call, args, kwargs) -> output.
DivertedCall = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


class NativeDecision:
    """torch's own decision for the call at hand, computed at most once and only if asked."""

    __slots__ = ("_compute", "_done", "_error", "_result")

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute = compute
        self._done = False
        self._result: Any = None
        self._error: Exception | None = None

    def _run(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._result = self._compute()
            except Exception as exc:  # noqa: BLE001 - re-raised by get(); rules inspect it
                self._error = exc

    def get(self) -> Any:
        """torch's result: an ``OutputSharding`` (or, 2.10+, an already computed output).

        Raises:
            Whatever torch's propagation raised for this call.
        """
        self._run()
        if self._error is not None:
            raise self._error
        return self._result

    def error(self) -> Exception | None:
        """The exception torch's propagation raised for this call, or ``None``."""
        self._run()
        return self._error

    def sharding(self) -> Any:
        """torch's ``OutputSharding``, or ``None`` when propagation raised or torch already
        produced the output itself (a CompositeImplicitAutograd decomposition, 2.10+)."""
        self._run()
        if self._error is not None or not _is_output_sharding(self._result):
            return None
        return self._result


# rule(op_schema, native) -> DivertedCall | None; one per op (patches that share an op are
# layered by the registry's ownership stacks).
MissRule = Callable[[Any, NativeDecision], "DivertedCall | None"]
_MISS_RULES: dict[Any, MissRule] = {}

ANY_OP = "*"
"""Key of a miss rule consulted for every op (after the op's own rule), for fixes that concern
a kind of call rather than an op: an in-place write into a ``Partial`` target, a view op that
must redistribute."""

# Called for a call whose propagation torch refused: (op_call, args, kwargs, error) -> output
# or raise. ``None``: torch's error stands.
CallFallback = Callable[[Any, tuple[Any, ...], dict[str, Any], Exception], Any]
_FALLBACK: list[CallFallback | None] = [None]


def _is_output_sharding(value: Any) -> bool:
    from torch.distributed.tensor._op_schema import OutputSharding

    return isinstance(value, OutputSharding)


class _Divert(BaseException):
    """2.9 only: carries a diverted call from propagation up to the dispatch wrapper."""

    def __init__(self, op: Any, run: DivertedCall) -> None:
        super().__init__(str(op))
        self.op = op
        self.run = run


_HOOK_TLS = threading.local()
_HOOK_LOCK = threading.Lock()
_HOOK_ORIGINALS: dict[str, Any] = {}


def any_op_key(rule: MissRule) -> tuple[str, str]:
    """The table key of a rule for every op: ``(ANY_OP, "module.qualname")``, so that several
    patches can each hold one."""
    return (ANY_OP, f"{rule.__module__}.{rule.__qualname__}")


def _decide(op: Any, schema: Any, native: NativeDecision) -> DivertedCall | None:
    keys = [op, *(key for key in _MISS_RULES if isinstance(key, tuple))]
    for key in keys:
        rule = _MISS_RULES.get(key)
        if rule is not None:
            run = rule(schema, native)
            if run is not None:
                _note_decision(op, key)
                return run
    fallback = _FALLBACK[0]
    if fallback is not None:
        error = native.error()
        if error is not None and not _decomposes_itself(op, error):
            _note_decision(op, FALLBACK_DECISION)
            return lambda op_call, args, kwargs: fallback(op_call, args, kwargs, error)
    return None


# Diverted decisions, noted only while a thread watches them (verify()); misses only.
_DECISIONS_TLS = threading.local()
FALLBACK_DECISION = "fallback"
"""What :func:`watch_decisions` notes for a call the call fallback ran."""


def _note_decision(op: Any, key: Any) -> None:
    log = getattr(_DECISIONS_TLS, "log", None)
    if log is not None:
        log.append((op, key))


def _decomposes_itself(op: Any, error: Exception) -> bool:
    """torch answers a missing strategy of a CompositeImplicitAutograd op by decomposing it
    (2.9 in ``dispatch``); that is not a refusal."""
    return isinstance(
        error, NotImplementedError
    ) and torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), torch._C.DispatchKey.CompositeImplicitAutograd
    )


def _install_slow_path_hook(dispatcher: Any) -> None:
    """2.10+: wrap the slow path the C++ dispatcher calls on a cache miss."""
    name = "_propagate_op_sharding_dispatch_slow_path"
    original = _attr(dispatcher, name, f"OpDispatcher.{name}")

    def slow_path(op_call: Any, args: Any, kwargs: Any, op_info: Any, try_cache: bool) -> Any:
        if not _MISS_RULES and _FALLBACK[0] is None:
            return original(op_call, args, kwargs, op_info, try_cache)
        native = NativeDecision(lambda: original(op_call, args, kwargs, op_info, try_cache))
        run = _decide(op_call, op_info.schema, native)
        if run is not None:
            return run(op_call, args, kwargs)
        return native.get()

    _HOOK_ORIGINALS[name] = dispatcher.__dict__.get(name, _MISSING)
    setattr(dispatcher, name, slow_path)


def _install_python_dispatch_hook(dispatcher: Any) -> None:
    """2.9: wrap ``dispatch`` and the propagator's cached propagation (see above)."""
    propagator = sharding_propagator()
    dispatch = _attr(dispatcher, "dispatch", "OpDispatcher.dispatch")
    non_cached = _attr(
        propagator,
        "propagate_op_sharding_non_cached",
        "ShardingPropagator.propagate_op_sharding_non_cached",
    )
    cached = _attr(propagator, "propagate_op_sharding", "ShardingPropagator.propagate_op_sharding")
    cache_class = type(cached)

    def propagate(op_schema: Any) -> Any:
        op = op_schema.op
        if getattr(_HOOK_TLS, "op", None) is not op or (not _MISS_RULES and _FALLBACK[0] is None):
            return non_cached(op_schema)
        native = NativeDecision(lambda: non_cached(op_schema))
        run = _decide(op, op_schema, native)
        if run is not None:
            raise _Divert(op, run)
        return native.get()

    def hooked_dispatch(op_call: Any, args: Any, kwargs: Any) -> Any:
        outer = getattr(_HOOK_TLS, "op", None)
        _HOOK_TLS.op = op_call
        try:
            return dispatch(op_call, args, kwargs)
        except _Divert as divert:
            if divert.op is not op_call:
                raise
            _HOOK_TLS.op = outer
            return divert.run(op_call, args, kwargs)
        except AssertionError as error:
            # 2.9 flattens list arguments only for ops with a strategy, so an op without one
            # whose DTensors all sit in a list (``block_diag``, ``_chunk_cat``) is refused
            # before propagation: a refusal the fallback takes like any other.
            fallback = _FALLBACK[0]
            if fallback is None or "found no DeviceMesh from dtensor args" not in str(error):
                raise
            _HOOK_TLS.op = outer
            _note_decision(op_call, FALLBACK_DECISION)
            return fallback(op_call, args, kwargs, error)
        finally:
            _HOOK_TLS.op = outer

    _HOOK_ORIGINALS["dispatch"] = dispatcher.__dict__.get("dispatch", _MISSING)
    # Restored as a fresh cache over torch's own function (decisions made under the hook
    # must not outlive it).
    _HOOK_ORIGINALS["propagate_op_sharding"] = (cache_class, non_cached)
    _HOOK_ORIGINALS["propagate_op_sharding_non_cached"] = propagator.__dict__.get(
        "propagate_op_sharding_non_cached", _MISSING
    )
    propagator.propagate_op_sharding = cache_class(propagate)
    propagator.propagate_op_sharding_non_cached = propagate
    dispatcher.dispatch = hooked_dispatch


def _uses_cpp_dispatch() -> bool:
    """From 2.10 DTensor's dispatch entry point is C++ (pytorch/pytorch#167051): wrapping the
    Python ``dispatch`` there would silently never run, so the release decides, not the
    presence of an attribute (a moved slow path then fails loudly)."""
    return torch_release() >= Version("2.10")


def install_miss_hook() -> bool:
    """Install the miss hook (idempotent). Returns ``True`` if this call installed it.

    Raises:
        PatchError: an internal the hook wraps is missing (nothing is changed then).
    """
    with _HOOK_LOCK:
        if _HOOK_ORIGINALS:
            return False
        dispatcher = op_dispatcher()
        try:
            if _uses_cpp_dispatch():
                _install_slow_path_hook(dispatcher)
            else:
                _install_python_dispatch_hook(dispatcher)
        except BaseException:
            _remove_hook_locked()
            raise
        return True


def _restore_attr(owner: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        owner.__dict__.pop(name, None)
    else:
        setattr(owner, name, value)


def _remove_hook_locked() -> None:
    dispatcher, propagator = op_dispatcher(), sharding_propagator()
    for name, value in _HOOK_ORIGINALS.items():
        if name == "propagate_op_sharding":
            cache_class, function = value
            propagator.propagate_op_sharding = cache_class(function)
        elif name == "propagate_op_sharding_non_cached":
            _restore_attr(propagator, name, value)
        else:
            _restore_attr(dispatcher, name, value)
    _HOOK_ORIGINALS.clear()


def remove_miss_hook_if_unused() -> bool:
    """Take the hook out again once no miss rule and no fallback is left (torch exactly as
    before). Returns ``True`` if it was removed."""
    with _HOOK_LOCK:
        if not _HOOK_ORIGINALS or _MISS_RULES or _FALLBACK[0] is not None:
            return False
        _remove_hook_locked()
        return True


def miss_hook_installed() -> bool:
    """Whether the miss hook is in place."""
    return bool(_HOOK_ORIGINALS)


def register_miss_rule(op: Any, rule: MissRule) -> None:
    """Consult ``rule(op_schema, native)`` for ``op`` (an ``OpOverload``, or the key
    :func:`any_op_key` gives a rule for every op) on every propagation cache miss.

    Installs the miss hook on first use.

    Raises:
        PatchError: the hook cannot be installed on this release.
    """
    install_miss_hook()
    _MISS_RULES[op] = rule


def set_call_fallback(fallback: CallFallback | None) -> None:
    """Route calls whose propagation torch refuses to ``fallback`` (``None``: torch's error)."""
    if fallback is not None:
        install_miss_hook()
    _FALLBACK[0] = fallback
    if fallback is None:
        remove_miss_hook_if_unused()


def spec_with_placements(spec: Any, placements: Iterable[Any]) -> Any:
    """A copy of the ``DTensorSpec`` ``spec`` with other placements and every other field kept.

    Copied with ``dataclasses.replace`` so that fields newer releases add (``shard_order`` in
    2.13) survive; where such a field is derived from the placements, it is dropped and left
    for ``DTensorSpec.__post_init__`` to derive again.

    Raises:
        PatchError: ``DTensorSpec`` is no longer a dataclass.
    """
    if not dataclasses.is_dataclass(spec):
        raise PatchError(
            f"torch {torch.__version__}: DTensorSpec is no longer a dataclass",
            internal="torch.distributed.tensor._dtensor_spec.DTensorSpec",
        )
    changes: dict[str, Any] = {"placements": tuple(placements)}
    names = {f.name for f in dataclasses.fields(spec) if f.init}
    if "shard_order" in names:
        # Derived from the placements when not given (2.13); the old order would not match.
        changes["shard_order"] = None
    return dataclasses.replace(spec, **changes)


def set_placements(dtensor: Any, placements: Iterable[Any]) -> None:
    """Relabel ``dtensor`` in place with ``placements`` (same mesh, same global shape).

    Only for relabels that keep the local tensor's shape. Writes ``DTensor._spec``.

    Raises:
        PatchError: ``DTensor._spec`` or ``DTensorSpec`` moved.
    """
    spec = _attr(dtensor, "_spec", "DTensor._spec")
    dtensor._spec = spec_with_placements(spec, placements)


def check_call_time_internals() -> None:
    """Check every private internal that handlers and miss rules use while a call runs.

    Called when a patch with handlers or miss rules is applied, so a release that moved one
    makes the patch fail cleanly at apply time (torch untouched), never mid-training.

    Raises:
        PatchError: naming the first missing internal.
    """
    _attr(torch._C, "_is_alias_of", "torch._C._is_alias_of")
    dtensor = _dtensor_class()
    annotations: dict[str, Any] = {}
    for klass in reversed(dtensor.__mro__):
        annotations.update(getattr(klass, "__annotations__", {}))
    for name in ("_local_tensor", "_spec"):
        if name not in annotations:
            raise PatchError(
                f"torch {torch.__version__}: DTensor no longer declares {name}",
                internal=f"DTensor.{name}",
            )
    types = dtensor_types()
    if not dataclasses.is_dataclass(types.DTensorSpec):
        raise PatchError(
            f"torch {torch.__version__}: DTensorSpec is no longer a dataclass",
            internal="torch.distributed.tensor._dtensor_spec.DTensorSpec",
        )
    fields = {f.name for f in dataclasses.fields(types.DTensorSpec)}
    for name in ("mesh", "placements", "tensor_meta"):
        if name not in fields:
            raise PatchError(
                f"torch {torch.__version__}: DTensorSpec has no field {name}",
                internal=f"DTensorSpec.{name}",
            )
    for name in ("op", "args_schema", "kwargs_schema"):
        if name not in {f.name for f in dataclasses.fields(types.OpSchema)}:
            raise PatchError(
                f"torch {torch.__version__}: OpSchema has no field {name}",
                internal=f"OpSchema.{name}",
            )
    try:
        from torch.distributed.tensor._op_schema import OutputSharding
    except ImportError as exc:
        raise PatchError(
            f"torch {torch.__version__} has no _op_schema.OutputSharding",
            internal="torch.distributed.tensor._op_schema.OutputSharding",
        ) from exc
    for name in ("output_spec", "redistribute_schema", "needs_redistribute"):
        if name not in {f.name for f in dataclasses.fields(OutputSharding)}:
            raise PatchError(
                f"torch {torch.__version__}: OutputSharding has no field {name}",
                internal=f"OutputSharding.{name}",
            )
    local_shape_and_offset_function()


def make_dtensor(local: torch.Tensor, spec: Any, *, cls: Any = None) -> Any:
    """A DTensor (or an instance of the DTensor subclass ``cls``) over ``local`` with ``spec``,
    without communication or checks: ``DTensor(local, spec, requires_grad=False)``, the
    constructor DTensor's own dispatch wraps results with (same signature 2.9 to 2.15).

    For use inside dispatch (below autograd), where results carry no autograd history.
    """
    klass = _dtensor_class() if cls is None else cls
    return klass(local, spec, requires_grad=False)


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


def local_shape_and_offset_function() -> Callable[..., Any]:
    """``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``.

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
    return _attr(
        _utils,
        "compute_local_shape_and_global_offset",
        "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
    )


def local_shape_and_offset(
    global_shape: Iterable[int], mesh: Any, placements: Iterable[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and the global offset of its block, per tensor dim.

    Wraps ``compute_local_shape_and_global_offset`` (same signature 2.9 to 2.15; 2.10 adds an
    optional ``skip_offset``), which cuts shards exactly as DTensor does (uneven and empty last
    shards, several mesh dims sharding one tensor dim).

    Raises:
        PatchError: the helper moved.
    """
    compute = local_shape_and_offset_function()
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


# --- Stock registry facts and call recording (scan) --------------------------------------


def _op_name(op: Any) -> str:
    """``"aten.alias.default"`` for an ``OpOverload`` (the form patches list ops in)."""
    return str(op)


def native_registry() -> dict[str, list[str]]:
    """What stock torch registers for DTensor, as sorted op names per kind:

    - ``strategies``: ``op_strategy_funcs`` and ``op_to_rules``;
    - ``single_dim``: ``op_single_dim_strategy_funcs`` (2.11+; empty before);
    - ``handlers``: ``OpDispatcher._custom_op_handlers``.

    Entries that patches installed are left out and entries they replaced are counted, so the
    answer is torch's own registry whether or not patches are applied.

    Raises:
        PatchError: a registry table moved.
    """
    tables = _tables()
    kinds = {
        "strategies": ("propagator.op_strategy_funcs", "propagator.op_to_rules"),
        "single_dim": ("propagator.op_single_dim_strategy_funcs",),
        "handlers": ("dispatcher._custom_op_handlers",),
    }
    out: dict[str, list[str]] = {}
    for kind, names in kinds.items():
        ops: set[str] = set()
        for name in names:
            for op in tables.get(name, {}):
                if (name, op) in _ORIGINALS and _ORIGINALS[(name, op)] is _MISSING:
                    continue  # installed by a patch, not torch's
                ops.add(_op_name(op))
        out[kind] = sorted(ops)
    return out


def all_aten_ops() -> list[str]:
    """Every ``aten`` operator overload this torch registers, as ``"aten.op.overload"``
    (``torch._C._dispatch_get_all_op_names``; an overload-less name is ``.default``)."""
    names = _attr(torch._C, "_dispatch_get_all_op_names", "torch._C._dispatch_get_all_op_names")()
    out = []
    for name in names:
        namespace, _, rest = name.partition("::")
        if namespace != "aten":
            continue
        packet, _, overload = rest.partition(".")
        out.append(f"aten.{packet}.{overload or 'default'}")
    return sorted(out)


def has_decomposition(op_name: str) -> bool:
    """Whether ``op_name`` (``"aten.op.overload"``) has a CompositeImplicitAutograd kernel:
    DTensor decomposes such an op instead of asking for a strategy when it has none."""
    namespace, packet, overload = op_name.split(".")
    qualified = f"{namespace}::{packet}" + ("" if overload == "default" else f".{overload}")
    has_kernel = _attr(
        torch._C,
        "_dispatch_has_kernel_for_dispatch_key",
        "torch._C._dispatch_has_kernel_for_dispatch_key",
    )
    return bool(has_kernel(qualified, torch._C.DispatchKey.CompositeImplicitAutograd))


def dispatch_mode_class() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``: a mode sees every op call at the
    Python dispatch key, before DTensor's own dispatch (the C++ fast path on 2.10+ included).

    Raises:
        PatchError: the class moved.
    """
    try:
        from torch.utils import _python_dispatch
    except ImportError as exc:
        raise PatchError(
            f"torch {torch.__version__} has no torch.utils._python_dispatch",
            internal="torch.utils._python_dispatch",
        ) from exc
    return _attr(
        _python_dispatch,
        "TorchDispatchMode",
        "torch.utils._python_dispatch.TorchDispatchMode",
    )


# --- Seeing DTensor calls (verify) ---------------------------------------------------------
#
# ``dtensor_patches.verify`` is an opt-in debugging tool: a ``TorchDispatchMode`` sees every
# DTensor call at the top of dispatch (forward and backward), gathers its inputs and runs the
# same op on full tensors. The private pieces it needs are here.


def current_autograd_node() -> Any:
    """The autograd node whose backward is running on this thread, or ``None`` outside
    backward (``torch._C._current_autograd_node``).

    Raises:
        PatchError: the function moved.
    """
    return _attr(torch._C, "_current_autograd_node", "torch._C._current_autograd_node")()


class watch_decisions:
    """Note, on this thread, every call that a miss rule or the call fallback ran instead of
    torch: a list of ``(op, key)``, ``key`` being the rule's op, :data:`ANY_OP` or
    :data:`FALLBACK_DECISION`. Nests (the inner block sees only its own calls)."""

    def __enter__(self) -> list[tuple[Any, Any]]:
        self._outer = getattr(_DECISIONS_TLS, "log", None)
        self.log: list[tuple[Any, Any]] = []
        _DECISIONS_TLS.log = self.log
        return self.log

    def __exit__(self, *exc: object) -> None:
        _DECISIONS_TLS.log = self._outer


def entry_owner(table: str, op: Any) -> object | None:
    """The owner (a patch) of the entry ``table`` holds for ``op`` now, ``None`` when it is
    torch's own (or someone else's): the top ownership layer, if it is still in effect."""
    layers = _LAYERS.get((table, op))
    if not layers:
        return None
    owner, value = layers[-1]
    return owner if _tables()[table].get(op, _MISSING) is value else None


def miss_rules_table() -> str:
    """The name under which miss rules appear in :func:`registry_state` and ownership keys."""
    return _MISS_RULES_TABLE


def full_value(dtensor: Any) -> torch.Tensor:
    """The full (global, reduced) value of ``dtensor`` as a plain tensor, without autograd
    history and without consuming state that a later redistribution needs.

    ``_MaskPartial`` (vocab-parallel embedding) keeps its mask on the placement object and
    releases it when reduced (a refcount); gathering such a tensor for a check would make the model's own
    reduction fail later, so the mask is put back.

    Raises:
        PatchError: ``DTensor.full_tensor`` moved.
    """
    buffers = []
    for placement in dtensor.placements:
        buffer = getattr(placement, "mask_buffer", None)
        if buffer is not None:
            buffers.append((buffer, dict(vars(buffer))))  # data and refcount
    try:
        from torch.distributed.tensor import Replicate, _redistribute
    except ImportError as exc:
        raise PatchError(
            f"torch {torch.__version__} has no torch.distributed.tensor._redistribute",
            internal="torch.distributed.tensor._redistribute",
        ) from exc
    redistribute = _attr(
        _redistribute,
        "redistribute_local_tensor",
        "torch.distributed.tensor._redistribute.redistribute_local_tensor",
    )
    spec = _attr(dtensor, "_spec", "DTensor._spec")
    target = spec_with_placements(spec, [Replicate()] * len(spec.placements))
    try:
        # Below autograd on purpose: an autograd.Function inside a dispatch mode is refused
        # on 2.9 (``detach_`` has no strategy).
        with torch.no_grad():
            out = redistribute(local_tensor(dtensor), spec, target)
            wait = getattr(out, "wait", None)
            if type(out) is not torch.Tensor and callable(wait):
                out = wait()  # AsyncCollectiveTensor
            return out.clone()
    finally:
        for buffer, state in buffers:
            vars(buffer).update(state)


def spec_shape(dtensor: Any) -> tuple[int, ...] | None:
    """The global shape ``dtensor``'s spec records (``_spec.tensor_meta.shape``), which DTensor
    propagates from; ``None`` when the spec has no tensor meta."""
    meta = getattr(_attr(dtensor, "_spec", "DTensor._spec"), "tensor_meta", None)
    return None if meta is None else tuple(meta.shape)


def loss_parallel_internals() -> SimpleNamespace:
    """``torch.distributed.tensor.parallel.loss``: the module, its ``customized_loss_ops``
    table (op -> handler, installed into ``_custom_op_handlers`` on entering
    ``loss_parallel()`` and *popped* on leaving it, in 2.9 to 2.15) and its
    ``_disable_custom_loss_ops``.

    Raises:
        PatchError: one of them moved.
    """
    try:
        from torch.distributed.tensor.parallel import loss
    except ImportError as exc:
        raise PatchError(
            f"torch {torch.__version__} has no torch.distributed.tensor.parallel.loss",
            internal="torch.distributed.tensor.parallel.loss",
        ) from exc
    prefix = "torch.distributed.tensor.parallel.loss."
    return SimpleNamespace(
        module=loss,
        ops=_attr(loss, "customized_loss_ops", prefix + "customized_loss_ops"),
        disable=_attr(loss, "_disable_custom_loss_ops", prefix + "_disable_custom_loss_ops"),
    )


# --- Module functions replaced by the fallback's mixed-kind fixes --------------------------
#
# torch.optim and torch.nn.utils.clip_grad group tensors with the private
# ``torch.utils._foreach_utils._group_tensors_by_device_and_dtype`` (imported by name into each
# module, so each module's global is replaced); clip_grad_norm_ calls the module globals
# ``_get_total_norm`` and ``_clip_grads_with_norm_``. Same names 2.9 to 2.15.

MODULE_FUNCTION_SITES: dict[str, tuple[str, ...]] = {
    "_group_tensors_by_device_and_dtype": (
        "torch.utils._foreach_utils",
        "torch.optim.optimizer",
        "torch.nn.utils.clip_grad",
    ),
    "_get_total_norm": ("torch.nn.utils.clip_grad",),
    "get_total_norm": ("torch.nn.utils",),
    "_clip_grads_with_norm_": ("torch.nn.utils.clip_grad",),
    "clip_grads_with_norm_": ("torch.nn.utils",),
}
_MODULE_ORIGINALS: dict[tuple[str, str], Any] = {}


def module_function(name: str) -> Callable[..., Any]:
    """torch's own ``name`` (one of :data:`MODULE_FUNCTION_SITES`), as its first site holds
    it before any replacement.

    Raises:
        PatchError: a site module or the function moved.
    """
    import importlib

    site = MODULE_FUNCTION_SITES[name][0]
    if (site, name) in _MODULE_ORIGINALS:
        return _MODULE_ORIGINALS[(site, name)]
    try:
        module = importlib.import_module(site)
    except ImportError as exc:
        raise PatchError(f"torch {torch.__version__} has no {site}", internal=site) from exc
    return _attr(module, name, f"{site}.{name}")


def replace_module_functions(replacements: dict[str, Callable[..., Any]]) -> None:
    """Set every site's global ``name`` to ``replacements[name]`` (idempotent); all or nothing.

    Raises:
        PatchError: a site module or function moved (nothing is replaced then).
    """
    import importlib

    planned = []
    for name, value in replacements.items():
        original = module_function(name)
        for site in MODULE_FUNCTION_SITES[name]:
            try:
                module = importlib.import_module(site)
            except ImportError as exc:
                raise PatchError(f"torch {torch.__version__} has no {site}", internal=site) from exc
            current = _attr(module, name, f"{site}.{name}")
            if (site, name) not in _MODULE_ORIGINALS and current is not original:
                raise PatchError(
                    f"{site}.{name} is not torch's {MODULE_FUNCTION_SITES[name][0]}.{name} "
                    "(someone else replaced it); not touching it",
                    internal=f"{site}.{name}",
                )
            planned.append((module, site, name, current, value))
    for module, site, name, current, value in planned:
        _MODULE_ORIGINALS.setdefault((site, name), current)
        setattr(module, name, value)


def restore_module_functions() -> None:
    """Put back every function :func:`replace_module_functions` replaced."""
    import importlib

    for (site, name), original in list(_MODULE_ORIGINALS.items()):
        setattr(importlib.import_module(site), name, original)
        del _MODULE_ORIGINALS[(site, name)]


def module_functions_replaced() -> bool:
    """Whether :func:`replace_module_functions` replaced anything that is still in place."""
    return bool(_MODULE_ORIGINALS)


# The mixed plain-tensor/DTensor check. DTensor asks ``OpDispatcher.
# _try_replicate_spec_for_scalar_tensor`` what a plain tensor argument means, only for calls
# that have one (never on the all-DTensor path): wrapping it costs nothing elsewhere. From 2.10
# the C++ dispatch path makes the same check itself for most ops without calling it, so there
# torch's own message stands; the Python path (2.9, and ops the C++ path hands back, such as
# list arguments) gets the wrapped one.
_SCALAR_CHECK = "_try_replicate_spec_for_scalar_tensor"
_SCALAR_CHECK_ORIGINAL: list[Any] = []


def wrap_mixed_tensor_check(
    on_refusal: Callable[[Any, torch.Tensor, Any, RuntimeError], BaseException],
) -> None:
    """Route DTensor's refusal of a plain tensor argument (``got mixed torch.Tensor and
    DTensor``) through ``on_refusal(op, plain_tensor, mesh, error)``, which returns the error
    to raise instead. Idempotent; :func:`unwrap_mixed_tensor_check` undoes it.

    Raises:
        PatchError: ``OpDispatcher._try_replicate_spec_for_scalar_tensor`` moved.
    """
    from torch.distributed.tensor._dispatch import OpDispatcher

    current = _attr(OpDispatcher, _SCALAR_CHECK, f"OpDispatcher.{_SCALAR_CHECK}")
    if _SCALAR_CHECK_ORIGINAL:
        return
    original = current

    def checked(self: Any, op_call: Any, tensor_arg: torch.Tensor, compute_mesh: Any) -> Any:
        try:
            return original(self, op_call, tensor_arg, compute_mesh)
        except RuntimeError as error:
            if "mixed torch.Tensor and DTensor" not in str(error):
                raise
            raise on_refusal(op_call, tensor_arg, compute_mesh, error) from error

    _SCALAR_CHECK_ORIGINAL.append(original)
    setattr(OpDispatcher, _SCALAR_CHECK, checked)


def unwrap_mixed_tensor_check() -> None:
    """Put torch's own check back (no-op when not wrapped)."""
    from torch.distributed.tensor._dispatch import OpDispatcher

    if _SCALAR_CHECK_ORIGINAL:
        setattr(OpDispatcher, _SCALAR_CHECK, _SCALAR_CHECK_ORIGINAL.pop())


def finish_inplace_view(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, spec: Any
) -> Any:
    """Give ``target`` (a DTensor an in-place view op such as ``squeeze_`` just changed, its
    local tensor already changed) the output ``spec`` and make its outer size and strides match
    (``torch.utils._python_dispatch.return_and_correct_aliasing``, which re-runs the op on the
    wrapper's metadata only). Returns ``target``.

    Raises:
        PatchError: ``DTensor._spec`` or ``return_and_correct_aliasing`` moved.
    """
    try:
        from torch.utils._python_dispatch import return_and_correct_aliasing
    except ImportError as exc:
        raise PatchError(
            f"torch {torch.__version__} has no torch.utils._python_dispatch."
            "return_and_correct_aliasing",
            internal="torch.utils._python_dispatch.return_and_correct_aliasing",
        ) from exc
    _attr(target, "_spec", "DTensor._spec")
    target._spec = spec
    return return_and_correct_aliasing(op, args, kwargs, target)
