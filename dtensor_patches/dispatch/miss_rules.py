"""Miss rules: decisions made where a call meets sharding propagation without a cached decision.

The rare cases the library must act on (a ``Partial`` target of an in-place op, a view op that
has to redistribute its input, a call torch refuses) are all visible in the op schema, so they
are decided on a *miss*: the first call with a given schema, before torch caches its decision.
A rule sees the schema and, on demand, torch's own decision (:class:`NativeDecision`); it
returns ``None`` (torch's decision stands and is cached: later calls with that schema stay on
torch's fast path) or a function that runs the call instead (never cached, so the next such
call comes back to the rule). Every other call keeps torch's fast path and pays nothing.

Order on a miss: the rules for all ops that go first (:data:`ANY_OP_FIRST`: the validator's
routed cells), the op's own rule, then every rule for all ops (:data:`ANY_OP`) in the order
they were registered, then the call fallback if torch's propagation raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from dtensor_patches import state
from dtensor_patches._torch.dispatch_hook import DivertedCall, NativeDecision
from dtensor_patches._torch.schemas import decomposes, resolve_op
from dtensor_patches.dispatch import hook
from dtensor_patches.ledger import EntryKey

if TYPE_CHECKING:
    from dtensor_patches._torch.types import OpOverload, OpSchema

__all__ = [
    "ANY_OP",
    "ANY_OP_FIRST",
    "FALLBACK_DECISION",
    "DivertedCall",
    "MissRule",
    "NativeDecision",
    "Rule",
    "any_op_key",
    "decide",
    "ensure_hook",
    "note_decision",
    "take_refusal",
    "watch_decisions",
]

ANY_OP = "*"
"""The op of a rule consulted for every op (after the op's own rule), for fixes that concern a
kind of call rather than an op: an in-place write into a ``Partial`` target, a view op that
must redistribute."""

ANY_OP_FIRST = state.ANY_OP_FIRST
"""The op of a rule consulted for every op before the op's own rule and the other any-op
rules: for cells measured wrong under every other rule (``wrong_cells_<family>``)."""

FALLBACK_DECISION = "fallback"
"""What :func:`watch_decisions` notes for a call the call fallback ran."""

Rule = Callable[["OpSchema", NativeDecision], "DivertedCall | None"]
"""``rule(op_schema, native) -> DivertedCall | None``."""


def any_op_key(rule: Rule, op: str = ANY_OP) -> tuple[str, str]:
    """The table key of a rule for every op: ``(ANY_OP, "module.qualname")`` (or
    ``ANY_OP_FIRST``), so that several patches can each hold one."""
    return (op, f"{rule.__module__}.{rule.__qualname__}")


@dataclass(frozen=True)
class MissRule:
    """Consult ``fn(op_schema, native)`` when a call of ``op`` meets sharding propagation
    without a cached decision.

    ``op``: ``"namespace.op.overload"``, or :data:`ANY_OP` for a rule that sees every op.
    ``native`` is torch's own decision (computed on demand). ``fn`` returns ``None`` to keep
    it (cached as usual) or a function ``(op_call, args, kwargs) -> output`` that runs the call
    instead (never cached). For fixes that only some calls of a common op need: the condition
    is checked once per distinct schema, not on every call.
    """

    op: str
    fn: Rule
    kind: ClassVar[str] = "miss rule"

    @property
    def concerns(self) -> tuple[str, ...]:
        return () if self.op in (ANY_OP, ANY_OP_FIRST) else (self.op,)

    def key(self) -> Hashable:
        """The miss-rule table key: the op, or :func:`any_op_key` for every op."""
        if self.op in (ANY_OP, ANY_OP_FIRST):
            return any_op_key(self.fn, self.op)
        return resolve_op(self.op)

    def entries(self) -> Sequence[EntryKey]:
        return [(state.MISS_RULES_TABLE, self.key())]

    def install(self) -> None:
        ensure_hook()
        state.MISS_RULES[self.key()] = self.fn


# Diverted decisions, noted only while a thread watches them (verify()); misses only.
_WATCHED = threading.local()


class watch_decisions:
    """Note, on this thread, every call that a miss rule or the call fallback ran instead of
    torch: a list of ``(op, key)``, ``key`` being the rule's table key or
    :data:`FALLBACK_DECISION`. Nests (the inner block sees only its own calls)."""

    def __enter__(self) -> list[tuple[Any, Any]]:
        self._outer = getattr(_WATCHED, "log", None)
        self.log: list[tuple[Any, Any]] = []
        _WATCHED.log = self.log
        return self.log

    def __exit__(self, *exc: object) -> None:
        _WATCHED.log = self._outer


def note_decision(op: Any, key: Any) -> None:
    """Tell a :func:`watch_decisions` block on this thread that ``key`` ran ``op``."""
    log = getattr(_WATCHED, "log", None)
    if log is not None:
        log.append((op, key))


def _decomposes_itself(op: OpOverload, error: Exception) -> bool:
    """torch answers a missing strategy of a CompositeImplicitAutograd op by decomposing it
    (2.9 in ``dispatch``); that is not a refusal."""
    return isinstance(error, NotImplementedError) and decomposes(op)


def decide(op: OpOverload, schema: OpSchema, native: NativeDecision) -> DivertedCall | None:
    """The decision on a miss (see the module doc): a rule's diversion, the fallback's, or
    ``None`` for torch's own."""
    # Never iterate the live table: another thread may apply or revert patches meanwhile
    # (issue 23, item 11). ``get`` and the snapshot ``any_op`` are each read in one step.
    rules = state.MISS_RULES
    own = rules.get(op)
    candidates = rules.any_op if own is None else ((op, own), *rules.any_op)
    if rules.first:
        candidates = (*rules.first, *candidates)
    for key, rule in candidates:
        run = rule(schema, native)
        if run is not None:
            note_decision(op, key)
            return run
    fallback = state.FALLBACK.get("call")
    if fallback is not None:
        error = native.error()
        if error is not None and not _decomposes_itself(op, error):
            note_decision(op, FALLBACK_DECISION)
            return lambda op_call, args, kwargs: fallback(op_call, args, kwargs, error)
    return None


def take_refusal(
    op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any], error: BaseException
) -> Any:
    """A refusal torch makes before propagation on 2.9: a list-only op (the fallback's, if on)."""
    fallback = state.FALLBACK.get("call")
    if fallback is None:
        raise error
    note_decision(op_call, FALLBACK_DECISION)
    return fallback(op_call, args, kwargs, error)


def ensure_hook() -> None:
    """Put the dispatch hook in place for :func:`decide` (idempotent).

    Raises:
        PatchError: an internal the hook wraps is missing.
    """
    hook.ensure(decide, take_refusal)
