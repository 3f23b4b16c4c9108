"""Who changed which table entry, over what: the ownership ledger of every change the library
makes to torch. Pure bookkeeping: no torch import, tested on plain dicts.

Everything the library changes in torch is an *entry* of a *table*: a key of a dict that torch
reads (``op_strategy_funcs[op]``, ``_custom_op_handlers[op]``) or an attribute of a module,
class or object (``style.distribute_module``), seen through a small adapter with the same
three methods (:class:`Table`). Several owners (patches, the fallback, the dispatch hook) may
change one entry (two patches on ``argmax`` on 2.9) and be removed in any order (two
``patched()`` blocks in two threads). Each changed entry keeps a stack of ``(owner, value)``
layers over the value it had before the first change; the table holds the top layer. Removing
an owner removes its layers only: the entry falls back to the layer below, or to the original
once no layer is left.

The ledger is also the one record of what is applied (:meth:`Ledger.mark_applied`), in the order
it was applied. Callers hold one lock around every call (``dtensor_patches.state.LOCK``); the
ledger has none of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Protocol

__all__ = ["MISSING", "EntryKey", "Ledger", "Table"]


class _Missing:
    """The value of an entry a table does not hold."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
"""What :meth:`Table.get` returns for an absent entry, and what the ledger records as the
original of an entry that did not exist before a change."""

EntryKey = tuple[str, Hashable]
"""``(table name, key)``: one entry."""


class Table(Protocol):
    """A mapping the ledger can read and restore: a ``dict``, or an attribute adapter."""

    def get(self, key: Any, default: Any = ..., /) -> Any: ...

    def __setitem__(self, key: Any, value: Any, /) -> None: ...

    def pop(self, key: Any, default: Any = ..., /) -> Any: ...


def _read(table: Table, key: Hashable) -> Any:
    return table.get(key, MISSING)


def _write(table: Table, key: Hashable, value: Any) -> None:
    if value is MISSING:
        table.pop(key, None)
    else:
        table[key] = value


class Ledger:
    """The layers of every changed entry, and which owners are applied (in order).

    ``tables`` arguments map a table name to the :class:`Table` itself; only the names an
    operation needs are looked up, so a mapping that resolves tables on demand works too.
    """

    def __init__(self) -> None:
        self._layers: dict[EntryKey, list[tuple[object, Any]]] = {}
        self._originals: dict[EntryKey, Any] = {}
        self._applied: dict[object, tuple[EntryKey, ...]] = {}

    # --- changing entries -------------------------------------------------------------

    def record(
        self,
        owner: object,
        tables: Mapping[str, Table],
        entries: Iterable[EntryKey],
        change: Callable[[], None],
    ) -> list[EntryKey]:
        """Run ``change()`` (which writes some of ``entries``) and record every entry of
        ``entries`` it changed as a layer of ``owner``.

        Returns the entries that changed. Entries changed before an exception in ``change()``
        are recorded too, so :meth:`remove` undoes them.
        """
        wanted = list(dict.fromkeys(entries))
        before = {entry: _read(tables[entry[0]], entry[1]) for entry in wanted}
        changed: list[EntryKey] = []
        try:
            change()
        finally:
            for entry, old in before.items():
                new = _read(tables[entry[0]], entry[1])
                if new is old:
                    continue
                if entry not in self._layers:
                    self._originals[entry] = old
                    self._layers[entry] = []
                self._layers[entry].append((owner, new))
                changed.append(entry)
        return changed

    def remove(self, owner: object, tables: Mapping[str, Table]) -> list[EntryKey]:
        """Remove every layer of ``owner`` and forget it as applied; each entry it held on top
        falls back to the layer below or to the original. Returns the entries whose value in
        effect changed."""
        stale: list[EntryKey] = []
        for entry in [e for e, layers in self._layers.items() if _has(layers, owner)]:
            layers = self._layers[entry]
            on_top = layers[-1][0] is owner
            layers[:] = [(o, v) for o, v in layers if o is not owner]
            if not on_top:
                continue
            value = layers[-1][1] if layers else self._originals[entry]
            _write(tables[entry[0]], entry[1], value)
            if not layers:
                del self._layers[entry], self._originals[entry]
            stale.append(entry)
        self._applied.pop(owner, None)
        return stale

    def reassert(self, tables: Mapping[str, Table], entries: Iterable[EntryKey]) -> list[EntryKey]:
        """Write the top layer back into each of ``entries`` whose table no longer holds it
        (something outside the library replaced or removed it). Entries no owner holds are
        left alone. Returns the entries written."""
        restored = []
        for entry in entries:
            layers = self._layers.get(entry)
            if not layers:
                continue
            value = layers[-1][1]
            if _read(tables[entry[0]], entry[1]) is not value:
                _write(tables[entry[0]], entry[1], value)
                restored.append(entry)
        return restored

    # --- what is applied ---------------------------------------------------------------

    def mark_applied(self, owner: object, entries: Iterable[EntryKey]) -> None:
        """Record ``owner`` as applied, holding ``entries`` (after its last :meth:`record`)."""
        self._applied.pop(owner, None)  # re-marking moves it to the end of the order
        self._applied[owner] = tuple(entries)

    def is_applied(self, owner: object) -> bool:
        return owner in self._applied

    def applied(self) -> list[object]:
        """Applied owners, oldest first."""
        return list(self._applied)

    # --- reading ------------------------------------------------------------------------

    def owned(self, owner: object) -> dict[EntryKey, Any]:
        """Every entry ``owner`` has a layer in, with the value of its layer."""
        return {
            entry: value
            for entry, layers in self._layers.items()
            for o, value in layers
            if o is owner
        }

    def lost(self, owner: object, tables: Mapping[str, Table]) -> list[EntryKey]:
        """Entries ``owner`` has a layer in whose table no longer holds the top layer."""
        return [
            entry
            for entry, layers in self._layers.items()
            if _has(layers, owner) and _read(tables[entry[0]], entry[1]) is not layers[-1][1]
        ]

    def owner_of(self, tables: Mapping[str, Table], entry: EntryKey) -> object | None:
        """The owner of the top layer of ``entry`` if its value is still in effect, else
        ``None`` (torch's own entry, or someone else's)."""
        layers = self._layers.get(entry)
        if not layers:
            return None
        owner, value = layers[-1]
        return owner if _read(tables[entry[0]], entry[1]) is value else None

    def original(self, entry: EntryKey, current: Any) -> Any:
        """The value ``entry`` had before any owner changed it: ``current`` if none did."""
        return self._originals.get(entry, current)

    def added(self, entry: EntryKey) -> bool:
        """Whether ``entry`` exists only because an owner added it (its original is missing)."""
        return self._originals.get(entry, None) is MISSING

    def entries(self) -> list[EntryKey]:
        """Every entry some owner holds a layer in."""
        return list(self._layers)


def _has(layers: list[tuple[object, Any]], owner: object) -> bool:
    return any(o is owner for o, _ in layers)
