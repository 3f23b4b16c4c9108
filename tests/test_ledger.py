"""The ownership ledger on plain dicts and attribute-like tables: no torch, no process group."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from dtensor_patches.ledger import MISSING, Ledger


class Owner:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class Attributes:
    """A table over an object's attributes (as the library's attribute tables are)."""

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def get(self, key: str, default: Any = MISSING) -> Any:
        return vars(self.obj).get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self.obj, key, value)

    def pop(self, key: str, default: Any = None) -> Any:
        if key not in vars(self.obj):
            return default
        value = vars(self.obj)[key]
        delattr(self.obj, key)
        return value


def _set(table: dict[Any, Any], key: Any, value: Any) -> Any:
    def change() -> None:
        table[key] = value

    return change


def test_layers_fall_back_in_any_order() -> None:
    table = {"op": "torch"}
    tables = {"t": table}
    ledger = Ledger()
    a, b = Owner("a"), Owner("b")
    assert ledger.record(a, tables, [("t", "op")], _set(table, "op", "A")) == [("t", "op")]
    ledger.record(b, tables, [("t", "op")], _set(table, "op", "B"))
    assert table["op"] == "B"
    assert ledger.owner_of(tables, ("t", "op")) is b
    # Removing the lower owner first leaves the upper one in effect.
    assert ledger.remove(a, tables) == []
    assert table["op"] == "B"
    assert ledger.remove(b, tables) == [("t", "op")]
    assert table == {"op": "torch"}
    assert ledger.entries() == []


def test_an_added_entry_is_removed_again() -> None:
    table: dict[str, str] = {}
    tables = {"t": table}
    ledger = Ledger()
    a = Owner("a")
    ledger.record(a, tables, [("t", "new")], _set(table, "new", "A"))
    assert ledger.added(("t", "new"))
    ledger.remove(a, tables)
    assert "new" not in table


def test_only_declared_entries_are_recorded_and_unchanged_ones_are_not() -> None:
    table = {"x": 1, "y": 2}
    tables = {"t": table}
    ledger = Ledger()
    a = Owner("a")

    def change() -> None:
        table["x"] = 1  # the same object: no change
        table["y"] = 3

    assert ledger.record(a, tables, [("t", "x"), ("t", "y")], change) == [("t", "y")]
    assert ledger.owned(a) == {("t", "y"): 3}


def test_a_failed_change_is_recorded_up_to_the_failure() -> None:
    table = {"x": 1, "y": 2}
    tables = {"t": table}
    ledger = Ledger()
    a = Owner("a")

    def change() -> None:
        table["x"] = 10
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ledger.record(a, tables, [("t", "x"), ("t", "y")], change)
    assert ledger.owned(a) == {("t", "x"): 10}
    ledger.remove(a, tables)
    assert table == {"x": 1, "y": 2}


def test_lost_and_reassert() -> None:
    table = {"op": "torch"}
    tables = {"t": table}
    ledger = Ledger()
    a = Owner("a")
    ledger.record(a, tables, [("t", "op")], _set(table, "op", "A"))
    del table["op"]  # someone outside the library
    assert ledger.lost(a, tables) == [("t", "op")]
    assert ledger.owner_of(tables, ("t", "op")) is None
    assert ledger.reassert(tables, [("t", "op"), ("t", "other")]) == [("t", "op")]
    assert table["op"] == "A" and ledger.lost(a, tables) == []


def test_applied_is_one_ordered_record() -> None:
    ledger = Ledger()
    a, b = Owner("a"), Owner("b")
    ledger.mark_applied(a, [])
    ledger.mark_applied(b, [])
    assert ledger.applied() == [a, b] and ledger.is_applied(a)
    ledger.remove(a, {})
    assert ledger.applied() == [b] and not ledger.is_applied(a)


def test_attribute_tables_restore_inherited_methods() -> None:
    class Base:
        def f(self) -> str:
            return "base"

    obj = Base()
    tables = {"attrs": Attributes(obj)}
    ledger = Ledger()
    a = Owner("a")

    def change() -> None:
        obj.f = lambda: "wrapped"  # type: ignore[method-assign]

    ledger.record(a, tables, [("attrs", "f")], change)
    assert obj.f() == "wrapped"
    assert ledger.original(("attrs", "f"), None) is MISSING
    ledger.remove(a, tables)
    assert "f" not in vars(obj) and obj.f() == "base"


def test_the_ledger_imports_no_torch() -> None:
    code = (
        "import sys, dtensor_patches.ledger, dtensor_patches.state;sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
