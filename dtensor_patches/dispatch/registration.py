"""What every way of changing torch has in common: the :class:`Registration` protocol, and the
one all-or-nothing apply and exact revert of an owner's registrations.

A registration is one named kind of change (a sharding strategy, a custom handler, a miss rule,
tracked views, a wrapped torch function, a replaced ``loss_parallel()`` handler). It declares
the table entries it may write (:meth:`Registration.entries`) and writes them in
:meth:`Registration.install`, through torch's own APIs where there are any; the ledger
(:mod:`dtensor_patches.ledger`) records what changed, so removing the owner restores exactly
what was there before, whatever order owners are removed in.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from dtensor_patches import state
from dtensor_patches._torch import tables as torch_tables
from dtensor_patches.dispatch import hook
from dtensor_patches.ledger import EntryKey

__all__ = ["Registration", "entry_keys", "install", "owner_of", "remove"]


@runtime_checkable
class Registration(Protocol):
    """One change to torch, made by a patch (or by the fallback)."""

    @property
    def kind(self) -> str:
        """What kind of change: ``"strategy"``, ``"handler"``, ``"miss rule"``…"""
        ...

    @property
    def concerns(self) -> tuple[str, ...]:
        """The ops (``"aten.op.overload"``) this registration is about: a patch lists every one
        in its ``ops``. Empty for a change that is not about one op (a rule for every op, a
        wrapped torch function)."""
        ...

    def entries(self) -> Sequence[EntryKey]:
        """Every ``(table name, key)`` :meth:`install` may write."""
        ...

    def install(self) -> None:
        """Write the entries (the ledger records them; nothing else may be kept)."""
        ...


def install(owner: object, registrations: Iterable[Registration]) -> list[EntryKey]:
    """Install ``registrations`` as ``owner``'s and mark it applied; all or nothing.

    On any failure every entry written so far is restored (other owners' entries stay) and the
    caches are cleared; the exception propagates as it is.

    Returns:
        The entries that changed.
    """
    with state.LOCK:
        directory = torch_tables.tables()
        changed: list[EntryKey] = []
        try:
            for registration in registrations:
                changed += state.LEDGER.record(
                    owner, directory, registration.entries(), registration.install
                )
            torch_tables.clear_sharding_caches()
            state.LEDGER.mark_applied(owner, changed)
        except BaseException:
            remove(owner)
            raise
        return changed


def remove(owner: object) -> list[EntryKey]:
    """Take every entry of ``owner`` out again and forget it as applied: each entry falls back
    to the owner below or to torch's original. The dispatch hook goes once nothing needs it.
    Caches are cleared last.

    Returns:
        The entries whose value in effect changed.

    Raises:
        PatchError: a propagation cache moved (the entries are restored regardless).
    """
    with state.LOCK:
        stale = state.LEDGER.remove(owner, torch_tables.tables())
        hook.remove_if_unused()
        torch_tables.clear_sharding_caches()
        return stale


def entry_keys(tables: Iterable[str], keys: Iterable[Hashable]) -> list[EntryKey]:
    """Every ``(table, key)`` pair of ``tables`` x ``keys`` (the tables this release has)."""
    present = set(torch_tables.table_names())
    keys = list(keys)
    optional = ("propagator.", "dispatcher.")
    return [(t, k) for t in tables if t in present or not t.startswith(optional) for k in keys]


def owner_of(table: str, key: Hashable) -> object | None:
    """The owner of the entry of ``table`` for ``key`` now, ``None`` when it is torch's."""
    return state.LEDGER.owner_of(torch_tables.tables(), (table, key))
