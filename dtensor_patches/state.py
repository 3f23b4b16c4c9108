"""The library's process-wide state, in one place. No torch import.

DTensor's tables are process-wide, so what the library changed in them is process-wide too;
everything that must outlive a call lives here, and nowhere else at module level:

- :data:`LOCK`: held around every change to torch's tables (apply, revert, the fallback's
  install, the dispatch hook), by every thread. Re-entrant: a patch's apply installs the hook.
- :data:`LEDGER`: which owner (a patch, the fallback, the dispatch hook) changed which table
  entry over what, and which owners are applied, in order (:mod:`dtensor_patches.ledger`).
- :data:`MISS_RULES`: the library's own table of miss rules, read by the dispatch hook on every
  sharding-propagation cache miss (:mod:`dtensor_patches.dispatch.miss_rules`).
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
]

LOCK = threading.RLock()
LEDGER = Ledger()

MISS_RULES_TABLE = "dtensor_patches.miss_rules"
MISS_RULES: dict[Hashable, Callable[..., Any]] = {}

FALLBACK_TABLE = "dtensor_patches.fallback"
FALLBACK: dict[str, Any] = {}

FALLBACK_CHOICE: dict[str, str] = {}
