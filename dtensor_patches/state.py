"""The library's process-wide state, in one place. No torch import.

DTensor's tables are process-wide, so what the library changed in them is process-wide too;
everything that must outlive a call lives here, and nowhere else at module level:

- :data:`LOCK`: held around every change to torch's tables (apply, revert, the fallback's
  install, the dispatch hook), by every thread. Re-entrant: a patch's apply installs the hook.
- :data:`LEDGER`: which owner (a patch, the fallback, the dispatch hook) changed which table
  entry over what, and which owners are applied, in order (:mod:`dtensor_patches.ledger`).
- :data:`MISS_RULES`: the library's own table of miss rules, read by the dispatch hook on every
  sharding-propagation cache miss (:mod:`dtensor_patches.dispatch.miss_rules`); a
  :class:`RuleTable`, whose snapshot of the rules for every op readers iterate.
- :data:`FALLBACK`: the library's own table holding the call fallback (key ``"call"``) and its
  mode (key ``"mode"``), read by the dispatch hook when torch refuses a call.
- :data:`FALLBACK_CHOICE`: the fallback mode the last ``apply_all()`` installed (key
  ``"mode"``), kept by a later argument-less ``apply_all()``; ``revert_all()`` forgets it.

Per-thread state (the op a 2.9 dispatch is running, a ``verify()`` block's log, a tracked view
being made) is thread-local by nature and stays in the module that uses it, named there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from dtensor_patches.ledger import Ledger

__all__ = [
    "FALLBACK",
    "FALLBACK_CHOICE",
    "FALLBACK_TABLE",
    "LEDGER",
    "LOCK",
    "MISS_RULES",
    "MISS_RULES_TABLE",
    "RuleTable",
]

LOCK = threading.RLock()
LEDGER = Ledger()

MISS_RULES_TABLE = "dtensor_patches.miss_rules"

_RuleFn = Callable[..., Any]

ANY_OP_FIRST = "*first"
"""The op of a miss rule consulted for every op before the op's own rule."""


class RuleTable(dict[Hashable, _RuleFn]):
    """The miss-rule table: a ``dict`` (the ledger writes it like any other table) that keeps,
    after every change, :attr:`any_op`: its rules for every op (the tuple keys), in the order
    they were added, as one tuple swapped in by a single assignment.

    The dispatch hook reads :attr:`any_op` on a miss instead of iterating the dict, so a thread
    that applies or reverts patches never changes what another thread is iterating (iterating
    the dict itself failed on torch 2.9.1 with ``dictionary changed size during iteration``,
    surfacing as "Sharding propagation failed" in an ordinary ``x[1:3]``; issue 23, item 11).
    Writers hold :data:`LOCK`; readers take no lock.
    """

    any_op: tuple[tuple[Hashable, _RuleFn], ...] = ()
    first: tuple[tuple[Hashable, _RuleFn], ...] = ()
    """The rules for every op that come before an op's own rule (keys ``(ANY_OP_FIRST,
    name)``): the validator's routed cells, which every other rule gets wrong."""

    def _refresh(self) -> None:
        every = [(k, v) for k, v in dict.items(self) if isinstance(k, tuple)]
        self.first = tuple((k, v) for k, v in every if k[0] == ANY_OP_FIRST)
        self.any_op = tuple((k, v) for k, v in every if k[0] != ANY_OP_FIRST)

    def __setitem__(self, key: Hashable, value: _RuleFn) -> None:
        dict.__setitem__(self, key, value)
        self._refresh()

    def __delitem__(self, key: Hashable) -> None:
        dict.__delitem__(self, key)
        self._refresh()

    def pop(self, key: Hashable, *default: Any) -> Any:
        value = dict.pop(self, key, *default)
        self._refresh()
        return value

    def popitem(self) -> tuple[Hashable, _RuleFn]:
        item = dict.popitem(self)
        self._refresh()
        return item

    def clear(self) -> None:
        dict.clear(self)
        self._refresh()

    def setdefault(self, key: Hashable, default: Any = None) -> Any:
        value = dict.setdefault(self, key, default)
        self._refresh()
        return value

    def update(self, *args: Any, **kwargs: Any) -> None:
        dict.update(self, *args, **kwargs)
        self._refresh()

    def __ior__(self, other: Any) -> RuleTable:  # type: ignore[override,misc]
        dict.update(self, other)
        self._refresh()
        return self


MISS_RULES = RuleTable()

FALLBACK_TABLE = "dtensor_patches.fallback"
FALLBACK: dict[str, Any] = {}

FALLBACK_CHOICE: dict[str, str] = {}
