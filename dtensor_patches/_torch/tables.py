"""DTensor's tables, the caches of the decisions made from them, and the directory of every
table the library may change (:func:`tables`).

Stable from 2.9 to 2.15 (``docs/design.md`` §2): ``DTensor._op_dispatcher.sharding_propagator``
with ``register_op_strategy``, ``op_strategy_funcs``, ``op_to_schema_info``, ``op_to_rules``,
and ``DTensor._op_dispatcher._custom_op_handlers``. From 2.11 there is a second strategy table,
``op_single_dim_strategy_funcs``, whose entries win over ``op_strategy_funcs``. The Python
propagation cache is a thread-local LRU; from 2.10 a C++ fast path keeps its own cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from dtensor_patches import state
from dtensor_patches._torch import attributes, context_parallel, implicit_replication
from dtensor_patches._torch.access import ABSENT, attribute, internal, module, moved
from dtensor_patches._torch.dtensors import dtensor_class
from dtensor_patches._torch.versions import dispatches_in_cpp
from dtensor_patches.ledger import Table

if TYPE_CHECKING:
    from torch._ops import OpOverload

__all__ = [
    "HANDLERS",
    "LOSS_PARALLEL_HANDLERS",
    "OP_TABLES",
    "SCHEMA_INFO_TABLES",
    "SCHEMA_INFO_TABLE_OF",
    "STRATEGY_TABLES",
    "Tables",
    "clear_sharding_caches",
    "context_parallel_block_guard",
    "counting_strategy_calls",
    "custom_op_handlers",
    "has_native_handler",
    "has_native_strategy",
    "has_single_dim_strategy",
    "implicit_replication_on",
    "native_registry",
    "op_dispatcher",
    "register_custom_handler",
    "register_strategy",
    "registry_state",
    "schema_infos",
    "set_static_argnum",
    "set_static_kwargkey",
    "sharding_generation",
    "sharding_propagator",
    "table_names",
    "tables",
]

# The propagator/dispatcher dicts whose entries for an op decide how DTensor runs it.
# (owner, attribute, required): tables that not every supported release has are optional.
OP_TABLES: tuple[tuple[str, str, bool], ...] = (
    ("propagator", "op_strategy_funcs", True),
    ("propagator", "op_to_schema_info", True),
    ("propagator", "op_to_rules", True),
    ("propagator", "op_single_dim_strategy_funcs", False),  # 2.11+
    ("propagator", "op_to_schema_info_for_single_dim_strategy", False),  # 2.11+
    ("dispatcher", "_custom_op_handlers", True),
)
STRATEGY_TABLES = (
    "propagator.op_strategy_funcs",
    "propagator.op_to_rules",
    "propagator.op_single_dim_strategy_funcs",
)
HANDLERS = "dispatcher._custom_op_handlers"
SCHEMA_INFO_TABLES = (
    "propagator.op_to_schema_info",
    "propagator.op_to_schema_info_for_single_dim_strategy",  # 2.11+
)
"""op -> ``RuntimeSchemaInfo``: which non-tensor arguments key the propagation cache."""
SCHEMA_INFO_TABLE_OF = {
    "propagator.op_strategy_funcs": "propagator.op_to_schema_info",
    "propagator.op_to_rules": "propagator.op_to_schema_info",
    "propagator.op_single_dim_strategy_funcs": (
        "propagator.op_to_schema_info_for_single_dim_strategy"
    ),
}
"""Strategy table -> the schema-info table torch reads for the ops registered in it."""
LOSS_PARALLEL_HANDLERS = "loss_parallel.customized_loss_ops"
"""``loss_parallel()``'s op -> handler dict (installed into the handler table on entering the
block and popped on leaving it, 2.9 to 2.15)."""
DISPATCHER_ATTRIBUTES = "attributes of DTensor._op_dispatcher"
PROPAGATOR_ATTRIBUTES = "attributes of DTensor._op_dispatcher.sharding_propagator"


def op_dispatcher() -> Any:
    """``DTensor._op_dispatcher``, the process-wide DTensor op dispatcher."""
    return attribute(dtensor_class(), "_op_dispatcher", "DTensor._op_dispatcher")


def sharding_propagator() -> Any:
    """``DTensor._op_dispatcher.sharding_propagator``."""
    return attribute(
        op_dispatcher(), "sharding_propagator", "DTensor._op_dispatcher.sharding_propagator"
    )


def implicit_replication_on() -> bool:
    """Whether ``torch.distributed.tensor.experimental.implicit_replication()`` is in effect
    (``DTensor._op_dispatcher._allow_implicit_replication``, 2.9 to 2.15): plain tensors beside
    DTensors are then taken as ``Replicate()``. ``False`` if the flag moved."""
    return bool(getattr(op_dispatcher(), "_allow_implicit_replication", False))


def custom_op_handlers() -> dict[OpOverload, Callable[..., object]]:
    """``DTensor._op_dispatcher._custom_op_handlers``: op -> handler, consulted before propagation."""
    return attribute(
        op_dispatcher(), "_custom_op_handlers", "DTensor._op_dispatcher._custom_op_handlers"
    )


@contextmanager
def context_parallel_block_guard() -> Iterator[None]:
    """Undo what a ``context_parallel()`` block left behind when it raised.

    Before 2.12 the block has no ``try/finally``: an exception inside it leaves
    ``F.scaled_dot_product_attention`` replaced by its ring wrapper and DTensor's handler table
    (:func:`custom_op_handlers`) replaced by the block's, for the rest of the process. This
    puts both back as they were on entering.

    Raises:
        PatchError: ``DTensor._op_dispatcher._custom_op_handlers`` moved.
    """
    import torch.nn.functional as F

    dispatcher = op_dispatcher()
    sdpa = F.scaled_dot_product_attention
    handlers = custom_op_handlers()
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        dispatcher._custom_op_handlers = handlers


def _op_table(name: str) -> Any:
    owner_name, _, attr = name.partition(".")
    for owner_key, table_attr, required in OP_TABLES:
        if owner_key == owner_name and table_attr == attr:
            owner = sharding_propagator() if owner_key == "propagator" else op_dispatcher()
            table = getattr(owner, attr, ABSENT)
            if table is ABSENT:
                if required:
                    raise moved(name)
                return None
            return table
    return ABSENT


def _loss_parallel_handlers() -> Any:
    loss = module("torch.distributed.tensor.parallel.loss")
    handlers = getattr(loss, "customized_loss_ops", None)
    if not isinstance(handlers, dict):
        raise moved("torch.distributed.tensor.parallel.loss.customized_loss_ops")
    return handlers


_OWN_TABLES: dict[str, Any] = {
    state.MISS_RULES_TABLE: state.MISS_RULES,
    state.FALLBACK_TABLE: state.FALLBACK,
}


class Tables(Mapping[str, Table]):
    """Every table the library may change, by name, resolved when looked up (so a release that
    moved one fails where it is used, naming it):

    - ``"propagator.<attr>"`` / ``"dispatcher.<attr>"``: DTensor's op tables (:data:`OP_TABLES`);
    - :data:`LOSS_PARALLEL_HANDLERS`;
    - ``context_parallel()``'s handler dict
      (:data:`~dtensor_patches._torch.context_parallel.CONTEXT_PARALLEL_HANDLERS`);
    - the C++ implicit-replication flag of the calling thread
      (:data:`~dtensor_patches._torch.implicit_replication.CPP_FLAG_TABLE`);
    - ``"attributes of <module>"``, ``"attributes of <module>:<Class>"``: an object's own
      attributes (:mod:`.attributes`), and the dispatcher's and propagator's instance
      attributes (:data:`DISPATCHER_ATTRIBUTES`, :data:`PROPAGATOR_ATTRIBUTES`);
    - the library's own tables of miss rules and the fallback (:mod:`dtensor_patches.state`).
    """

    def __getitem__(self, name: str) -> Table:
        own = _OWN_TABLES.get(name)
        if own is not None:
            return own
        if name == LOSS_PARALLEL_HANDLERS:
            return _loss_parallel_handlers()
        if name == context_parallel.CONTEXT_PARALLEL_HANDLERS:
            handlers: Any = context_parallel.handler_table()  # a plain dict: a Table
            return handlers
        if name == implicit_replication.CPP_FLAG_TABLE:
            return implicit_replication.CppFlagTable()
        if name == DISPATCHER_ATTRIBUTES:
            return attributes.AttributeTable(op_dispatcher(), "DTensor._op_dispatcher")
        if name == PROPAGATOR_ATTRIBUTES:
            return attributes.AttributeTable(sharding_propagator(), "sharding_propagator")
        if attributes.is_attribute_table(name):
            return attributes.attribute_table(name)
        table = _op_table(name)
        if table is ABSENT:
            raise KeyError(name)
        if table is None:
            raise moved(name, "this release has no such table")
        return table

    def __iter__(self) -> Iterator[str]:
        return iter(table_names())

    def __len__(self) -> int:
        return len(table_names())


def tables() -> Tables:
    """The directory of every table (see :class:`Tables`)."""
    return Tables()


# The op-keyed tables a dispatcher object has never change: asked once per dispatcher (every
# registration asks while ``apply_all()`` runs).
_NAMES_OF: dict[int, tuple[object, list[str]]] = {}


def table_names() -> list[str]:
    """The names of the op-keyed tables this release has (DTensor's, ``loss_parallel()``'s and
    the library's own), without copying them.

    Raises:
        PatchError: a required table moved.
    """
    dispatcher, propagator = op_dispatcher(), sharding_propagator()
    known = _NAMES_OF.get(id(propagator))
    if known is not None and known[0] is propagator and dispatcher is op_dispatcher():
        return list(known[1])
    names = _table_names()
    _NAMES_OF.clear()
    _NAMES_OF[id(propagator)] = (propagator, names)
    return list(names)


def _table_names() -> list[str]:
    names = []
    for owner, attr, _required in OP_TABLES:
        if _op_table(f"{owner}.{attr}") is not None:
            names.append(f"{owner}.{attr}")
    names += list(_OWN_TABLES)
    try:
        _loss_parallel_handlers()
    except Exception:  # noqa: BLE001 - a release without loss_parallel() has no such table
        pass
    else:
        names.append(LOSS_PARALLEL_HANDLERS)
    try:
        context_parallel.handler_table()
    except Exception:  # noqa: BLE001 - a release without context_parallel() has no such table
        pass
    else:
        names.append(context_parallel.CONTEXT_PARALLEL_HANDLERS)
    return names


def registry_state() -> dict[str, dict[Any, Any]]:
    """A shallow copy of every op-keyed table (see :func:`table_names`) and of the module
    attributes the library may replace, for comparing before/after (tests, doctor)."""
    directory = tables()
    out: dict[str, dict[Any, Any]] = {name: dict(directory[name]) for name in table_names()}  # type: ignore[call-overload]
    for function, owners in attributes.FUNCTION_SITES.items():
        for owner in owners:
            name = attributes.table_name(owner)
            try:
                value = attributes.attribute_table(name).get(function)
            except Exception:  # noqa: BLE001 - a site this release lacks is reported where used
                continue
            out.setdefault(name, {})[function] = value
    return out


def has_native_strategy(op: OpOverload) -> bool:
    """Whether DTensor has a sharding strategy or rule for ``op`` (any kind, any source)."""
    directory = tables()
    present = set(table_names())
    return any(op in directory[name] for name in STRATEGY_TABLES if name in present)  # type: ignore[operator]


def has_single_dim_strategy(op: OpOverload) -> bool:
    """Whether ``op`` has a single-dim strategy (2.11+), which shadows ``op_strategy_funcs``."""
    return op in getattr(sharding_propagator(), "op_single_dim_strategy_funcs", {})


def has_native_handler(op: OpOverload) -> bool:
    """Whether DTensor routes ``op`` to a custom handler."""
    return op in custom_op_handlers()


def register_strategy(
    op: OpOverload, strategy: Callable[[Any], Any], schema_info: Any = None
) -> None:
    """Register ``strategy(op_schema) -> OpStrategy | TupleStrategy`` for ``op``.

    Uses ``ShardingPropagator.register_op_strategy``, stable from 2.4 through 2.15. Where a
    single-dim strategy exists for ``op`` (2.11+), DTensor would silently prefer it, so that
    case is refused.

    Raises:
        PatchError: the registration API is missing, or a single-dim strategy would shadow ours.
    """
    propagator = sharding_propagator()
    if op in getattr(propagator, "op_single_dim_strategy_funcs", {}):
        raise moved(
            "ShardingPropagator.op_single_dim_strategy_funcs",
            f"{op} has a single-dim strategy, which a strategy registered through "
            "op_strategy_funcs would never override",
        )
    register = attribute(
        propagator, "register_op_strategy", "ShardingPropagator.register_op_strategy"
    )
    register(op, strategy, schema_info)


def register_custom_handler(op: OpOverload, handler: Callable[..., object]) -> None:
    """Route ``op`` on DTensors to ``handler(op_call, args, kwargs)`` before sharding propagation."""
    custom_op_handlers()[op] = handler


_GENERATION = [0]


def sharding_generation() -> int:
    """How many times :func:`clear_sharding_caches` has run: a cache of decisions kept outside
    torch's (keyed by something else) is stale once this number changes."""
    return _GENERATION[0]


@contextmanager
def counting_strategy_calls(op: OpOverload) -> Iterator[list[int]]:
    """Count, in the yielded list's length, how often torch runs ``op``'s sharding strategy
    (each run is one propagation: the work a cached decision saves) inside the block. The
    table entry is wrapped for the block and put back exactly as it was.

    Raises:
        PatchError: ``op`` has no strategy in this release's tables.
    """
    directory = tables()
    present = set(table_names())
    for name in STRATEGY_TABLES:
        if name in present and op in directory[name]:  # type: ignore[operator]
            table = directory[name]
            break
    else:
        raise moved(f"the sharding strategy of {op}")
    strategy = table[op]  # type: ignore[index]
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return strategy(*args, **kwargs)

    table[op] = counted
    try:
        yield calls
    finally:
        table[op] = strategy


def clear_sharding_caches() -> None:
    """Clear every cache of sharding decisions, in every thread, and the redistribution plans
    that were built from them.

    - The Python propagation cache is a ``threading.local`` LRU: clearing it clears only the
      calling thread's. It is replaced by a fresh instance over the propagator's
      ``propagate_op_sharding_non_cached`` (torch's, or the dispatch hook's wrapper of it on
      2.9), so every thread starts empty.
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
    _GENERATION[0] += 1
    propagator = sharding_propagator()
    cached = attribute(
        propagator, "propagate_op_sharding", "ShardingPropagator.propagate_op_sharding"
    )
    attribute(cached, "cache", "ShardingPropagator.propagate_op_sharding.cache")
    function = attribute(
        propagator,
        "propagate_op_sharding_non_cached",
        "ShardingPropagator.propagate_op_sharding_non_cached",
    )
    propagator.propagate_op_sharding = type(cached)(function)
    if dispatches_in_cpp():
        attribute(
            torch._C,
            "_clear_DTensor_sharding_propagator_cache",
            "torch._C._clear_DTensor_sharding_propagator_cache",
        )()
    plans = internal("torch.distributed.tensor._redistribute", "_gen_transform_infos")
    attribute(plans, "cache_clear", "_redistribute._gen_transform_infos.cache_clear")()


def native_registry(added: Callable[[str, Any], bool]) -> dict[str, list[str]]:
    """What stock torch registers for DTensor, as sorted op names per kind:

    - ``strategies``: ``op_strategy_funcs`` and ``op_to_rules``;
    - ``single_dim``: ``op_single_dim_strategy_funcs`` (2.11+; empty before);
    - ``handlers``: ``OpDispatcher._custom_op_handlers``.

    ``added(table, op)`` says whether an entry exists only because the library added it (left
    out), so the answer is torch's own registry whether or not patches are applied.

    Raises:
        PatchError: a registry table moved.
    """
    directory = tables()
    present = set(table_names())
    kinds = {
        "strategies": ("propagator.op_strategy_funcs", "propagator.op_to_rules"),
        "single_dim": ("propagator.op_single_dim_strategy_funcs",),
        "handlers": (HANDLERS,),
    }
    out: dict[str, list[str]] = {}
    for kind, names in kinds.items():
        ops: set[str] = set()
        for name in names:
            if name not in present:
                continue
            for op in directory[name]:  # type: ignore[attr-defined]
                if not added(name, op):
                    ops.add(str(op))
        out[kind] = sorted(ops)
    return out


def schema_infos() -> dict[str, dict[OpOverload, Any]]:
    """Each of :data:`SCHEMA_INFO_TABLES` this release has, by name: op ->
    ``RuntimeSchemaInfo`` (``static_argnum``: every positional argument from this index on
    keys the propagation cache, besides the tensors; ``static_kwargkey``: the keyword
    arguments that do). The live dicts.

    Raises:
        PatchError: ``op_to_schema_info`` moved.
    """
    directory = tables()
    present = set(table_names())
    return {name: directory[name] for name in SCHEMA_INFO_TABLES if name in present}  # type: ignore[misc]


# Every RuntimeSchemaInfo this module ever put into a table stays alive for the process, and
# the same one is put back on the next apply: once torch's dispatch has read an entry, it is
# not ours to free (revert_all() restores torch's own object, which the ledger kept alive), and
# a process that applies and reverts many times makes one copy per op, not one per apply.
# (table, op, change) -> (the entry it was made from, the entry made).
_SCHEMA_INFOS_MADE: dict[tuple[str, Any, tuple[Any, ...]], tuple[Any, Any]] = {}
_SCHEMA_INFOS_KEPT: list[Any] = []


def _replace_schema_info(
    table: str, op: OpOverload, change: tuple[Any, ...], make: Callable[[Any], Any]
) -> None:
    """Put ``make(entry)`` in place of ``op``'s entry of ``table`` (``None`` where it has
    none), or the copy made before from the same entry for the same ``change``."""
    infos = schema_infos().get(table)
    if infos is None:
        raise moved(table, "no schema info table to re-key")
    info: Any = infos.get(op)
    kept = _SCHEMA_INFOS_MADE.get((table, op, change))
    if kept is not None and kept[0] is info:
        infos[op] = kept[1]
        return
    made = make(info)
    _SCHEMA_INFOS_MADE[(table, op, change)] = (info, made)
    _SCHEMA_INFOS_KEPT.append(made)
    infos[op] = made


def set_static_argnum(table: str, op: OpOverload, static_argnum: int) -> None:
    """Key ``op``'s cached decisions by its positional arguments from ``static_argnum`` on: its
    ``RuntimeSchemaInfo`` in ``table`` (one of :data:`SCHEMA_INFO_TABLES`) replaced by a copy
    with that ``static_argnum``, every other field kept.

    Raises:
        PatchError: ``table`` has no entry for ``op``, or the entry has no ``static_argnum``
            (``RuntimeSchemaInfo`` moved).
    """
    import dataclasses

    def make(info: Any) -> Any:
        if info is None or isinstance(info, type) or not dataclasses.is_dataclass(info):
            raise moved(f"{table}[{op}].static_argnum", "no RuntimeSchemaInfo to re-key")
        if not hasattr(info, "static_argnum"):
            raise moved(f"{table}[{op}].static_argnum", "RuntimeSchemaInfo has no static_argnum")
        return dataclasses.replace(info, static_argnum=static_argnum)  # type: ignore[type-var]

    _replace_schema_info(table, op, ("static_argnum", static_argnum), make)


def set_static_kwargkey(table: str, op: OpOverload, keys: tuple[str, ...]) -> None:
    """Key ``op``'s cached decisions also by its keyword arguments ``keys`` (an ``out=``
    overload's out tensors: their specs, like a positional tensor's): its
    ``RuntimeSchemaInfo`` in ``table`` replaced by a copy whose ``static_kwargkey`` holds them,
    or, where torch registered none (which keys no keyword argument), a default one with just
    them.

    Raises:
        PatchError: the entry is not a ``RuntimeSchemaInfo`` with a ``static_kwargkey``
            (``RuntimeSchemaInfo`` moved).
    """
    import dataclasses

    from dtensor_patches._torch.dtensors import dtensor_types

    def make(info: Any) -> Any:
        if info is None:
            return dtensor_types().RuntimeSchemaInfo(static_kwargkey=list(keys))
        if not (dataclasses.is_dataclass(info) and hasattr(info, "static_kwargkey")):
            raise moved(
                f"{table}[{op}].static_kwargkey", "RuntimeSchemaInfo has no static_kwargkey"
            )
        present = list(info.static_kwargkey or [])
        return dataclasses.replace(  # type: ignore[type-var]
            info, static_kwargkey=present + [k for k in keys if k not in present]
        )

    _replace_schema_info(table, op, ("static_kwargkey", keys), make)


_DECOMPOSITIONS = "torch.distributed.tensor._decompositions"


def decomposed_out_ops() -> list[tuple[OpOverload, tuple[str, ...]]]:
    """``(op, its out argument names)`` for every ``out=`` overload with a decomposition in
    ``torch._decomp.decomposition_table`` and no sharding strategy in this release's tables:
    the ops DTensor propagates through their decomposition (2.11+, ``DecompShardingStrategy``),
    keyed by the ``RuntimeSchemaInfo`` torch infers for them on their first call.

    Raises:
        PatchError: ``torch._decomp.decomposition_table`` moved.
    """
    from dtensor_patches._torch.schemas import out_argument_names

    table = internal("torch._decomp", "decomposition_table")
    directory = tables()
    present = [directory[name] for name in STRATEGY_TABLES if name in set(table_names())]
    found = []
    for op in list(table):
        outs = out_argument_names(op)
        if outs and not any(op in strategies for strategies in present):  # type: ignore[operator]
            found.append((op, outs))
    return found


def decomposition_schema_info(op: OpOverload) -> Any:
    """The ``RuntimeSchemaInfo`` torch gives a decomposition op on its first call
    (``_infer_schema_info_from_op``: the non-tensor positional arguments from the first one on,
    and the non-tensor keyword-only ones; never an out tensor).

    Raises:
        PatchError: the function moved (before 2.11 there is none).
    """
    return internal(_DECOMPOSITIONS, "_infer_schema_info_from_op")(op)


def key_decomposition_outs(table: str, op: OpOverload, keys: tuple[str, ...]) -> None:
    """Key ``op``'s cached decisions by its out tensors ``keys`` too: its entry of ``table`` (or,
    where torch has not inferred one yet, the one it would infer) with them added to
    ``static_kwargkey``.

    Raises:
        PatchError: ``_infer_schema_info_from_op`` or ``RuntimeSchemaInfo`` moved.
    """
    infos = schema_infos().get(table)
    if infos is None:
        raise moved(table, "no schema info table to re-key")
    if infos.get(op) is None:
        # torch's own inference first, so the entry keys exactly what torch's would, plus outs.
        _replace_schema_info(table, op, ("inferred",), lambda _none: decomposition_schema_info(op))
    set_static_kwargkey(table, op, keys)
