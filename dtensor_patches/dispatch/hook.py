"""The dispatch hook: in place while the library has a miss rule or the fallback, and gone
(torch exactly as before) once it has neither.

The hook is an owner in the ledger like a patch: the attributes it replaces
(:func:`dtensor_patches._torch.dispatch_hook.replacements`) are layered and restored by the one
mechanism every other change uses.
"""

from __future__ import annotations

from dtensor_patches import state
from dtensor_patches._torch import dispatch_hook
from dtensor_patches._torch import tables as torch_tables

__all__ = ["HOOK", "ensure", "installed", "remove_if_unused"]


class _Hook:
    """The ledger owner of the hook's attributes."""

    name = "dispatch hook"

    def __repr__(self) -> str:
        return "<dtensor_patches dispatch hook>"


HOOK = _Hook()


def installed() -> bool:
    """Whether the hook is in place."""
    return state.LEDGER.is_applied(HOOK)


def ensure(decide: dispatch_hook.Decide, take_refusal: dispatch_hook.TakeRefusal) -> bool:
    """Put the hook in place (idempotent). Returns ``True`` if this call installed it.

    Raises:
        PatchError: an internal the hook wraps is missing (nothing is changed then).
    """
    with state.LOCK:
        if installed():
            return False
        directory = torch_tables.tables()
        replaced = dispatch_hook.replacements(decide, take_refusal)
        entries = [(table, name) for table, name, _ in replaced]

        def change() -> None:
            for table, name, value in replaced:
                directory[table][name] = value

        try:
            state.LEDGER.record(HOOK, directory, entries, change)
            state.LEDGER.mark_applied(HOOK, entries)
            torch_tables.clear_sharding_caches()
        except BaseException:
            state.LEDGER.remove(HOOK, directory)
            raise
        return True


def remove_if_unused() -> bool:
    """Take the hook out once no miss rule and no fallback is left. Returns ``True`` if it was
    removed (the caller clears the caches)."""
    with state.LOCK:
        if not installed() or state.MISS_RULES or state.FALLBACK.get("call") is not None:
            return False
        state.LEDGER.remove(HOOK, torch_tables.tables())
        return True
