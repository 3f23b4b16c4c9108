"""DTensor's implicit-replication switch, split into what the user asked for and what torch's C++
dispatch reads.

torch keeps one thread-local flag (``torch._C._get/_set_dtensor_allow_implicit_replication``,
2.9 to 2.15), behind the property ``OpDispatcher._allow_implicit_replication`` that
``torch.distributed.tensor.experimental.implicit_replication()`` sets and clears. From 2.10 the
C++ dispatch reads it for every call with a plain tensor beside DTensors: off, it raises
``got mixed torch.Tensor and DTensor`` before any Python runs; on, it asks Python
(``OpDispatcher._try_replicate_spec_for_scalar_tensor``) what the plain tensor means on every
call it cannot finish from its cache (measured on 2.10.0, 2.11.0, 2.13.0, 2.15.0).

The library keeps the C++ flag on (on the thread that applied it, and on every thread that
enters ``implicit_replication()``), so that such calls reach Python where the library decides
them, and moves what the user asked for into :func:`user_asked` (the replaced property), which
torch's own Python reads. Calls without a plain tensor never look at the flag: nothing changes
for them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from dtensor_patches._torch.access import attribute
from dtensor_patches.ledger import MISSING

__all__ = [
    "CPP_FLAG_KEY",
    "CPP_FLAG_TABLE",
    "CppFlagTable",
    "asked_for",
    "intent_property",
    "user_asked",
]

CPP_FLAG_TABLE = "torch._C dtensor_allow_implicit_replication (this thread)"
CPP_FLAG_KEY = "on"

_ASKED = threading.local()


def user_asked() -> bool:
    """Whether the user asked for implicit replication on this thread
    (``implicit_replication()``, or ``DTensor._op_dispatcher._allow_implicit_replication =
    True``) while the library owns the switch."""
    return bool(getattr(_ASKED, "on", False))


@contextlib.contextmanager
def asked_for() -> Iterator[None]:
    """Run the block as if the user had asked for implicit replication (torch's own answer to
    a plain tensor is then ``Replicate()``); restores what was asked before."""
    before = user_asked()
    _ASKED.on = True
    try:
        yield
    finally:
        _ASKED.on = before


def _get_flag() -> bool:
    getter = attribute(
        torch._C,
        "_get_dtensor_allow_implicit_replication",
        "torch._C._get_dtensor_allow_implicit_replication",
    )
    return bool(getter())


def _set_flag(value: bool) -> None:
    setter = attribute(
        torch._C,
        "_set_dtensor_allow_implicit_replication",
        "torch._C._set_dtensor_allow_implicit_replication",
    )
    setter(bool(value))


class CppFlagTable:
    """The C++ flag of the calling thread as a one-entry ledger table (key
    :data:`CPP_FLAG_KEY`), so installing and removing it is the ledger's all-or-nothing."""

    def get(self, key: Any, default: Any = MISSING, /) -> Any:
        return _get_flag() if key == CPP_FLAG_KEY else default

    def __setitem__(self, key: Any, value: Any, /) -> None:
        if key != CPP_FLAG_KEY:
            raise KeyError(key)
        _set_flag(bool(value))

    def pop(self, key: Any, default: Any = None, /) -> Any:
        if key != CPP_FLAG_KEY:
            return default
        before = _get_flag()
        _set_flag(False)
        return before

    def __contains__(self, key: object) -> bool:
        return key == CPP_FLAG_KEY

    def __repr__(self) -> str:
        return f"CppFlagTable({CPP_FLAG_TABLE})"


def intent_property(original: Any) -> property:
    """The replacement of ``OpDispatcher._allow_implicit_replication`` (torch's ``original``
    property): reading gives :func:`user_asked`; setting records what the user asked and keeps
    the C++ flag on for this thread (torch's ``implicit_replication()`` switches it off on
    leaving)."""
    del original  # torch's property is restored by the ledger, never called

    def get(self: Any) -> bool:
        return user_asked()

    def set_(self: Any, value: bool) -> None:
        _ASKED.on = bool(value)
        _set_flag(True)

    return property(get, set_, doc="what the user asked for (dtensor_patches owns the C++ flag)")
