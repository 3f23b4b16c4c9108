"""``dtensor_patches.health()``: what torch's tables hold now, against what was applied.

``apply_all()``'s report says what it did at the time. Code outside this library can change
the same tables afterwards (``loss_parallel()`` pops its handlers on leaving, a user's own
``register_op_strategy``), so the report can go stale; ``health()`` checks every entry an
applied patch installed against the table itself. (It was called ``status()`` before the redesign, a
name one letter's case away from the ``Status`` of an apply outcome; the old names warn.)
"""

from __future__ import annotations

from dataclasses import dataclass

from dtensor_patches import state
from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.versions import torch_version
from dtensor_patches.registry import all_patches

__all__ = ["PatchHealth", "RegistryHealth", "health"]


@dataclass(frozen=True)
class PatchHealth:
    """One applied patch: its entries, and those torch's tables no longer hold."""

    name: str
    entries: int
    lost: tuple[str, ...]

    @property
    def intact(self) -> bool:
        return not self.lost


@dataclass(frozen=True)
class RegistryHealth:
    """Every applied patch's state, in registry order."""

    torch_version: str
    patches: tuple[PatchHealth, ...]

    @property
    def intact(self) -> bool:
        """Every entry of every applied patch is in effect."""
        return all(p.intact for p in self.patches)

    @property
    def lost(self) -> list[str]:
        """Names of the applied patches with entries torch's tables no longer hold."""
        return [p.name for p in self.patches if not p.intact]

    def __str__(self) -> str:
        if not self.patches:
            return f"dtensor_patches on torch {self.torch_version}: no patch applied"
        head = f"dtensor_patches on torch {self.torch_version}: {len(self.patches)} patch(es) " + (
            "applied, every entry in effect" if self.intact else "applied, ENTRIES LOST:"
        )
        lines = [head]
        for p in self.patches:
            if p.lost:
                lines.append(f"  {p.name}: lost {', '.join(p.lost)} (re-apply: revert + apply)")
        return "\n".join(lines)


def health() -> RegistryHealth:
    """Compare what the applied patches installed with what torch's tables hold now.

    Returns:
        A :class:`RegistryHealth`; ``.intact`` is ``False`` when an entry was replaced or
        removed behind the library's back (each lost entry is named ``table[op]``).

    Raises:
        PatchError: a registry internal moved.
    """
    with state.LOCK:
        directory = torch_tables.tables()
        states = []
        for patch in all_patches():
            if not patch.is_applied:
                continue
            lost = tuple(f"{table}[{op}]" for table, op in state.LEDGER.lost(patch, directory))
            states.append(PatchHealth(patch.name, len(state.LEDGER.owned(patch)), lost))
    return RegistryHealth(str(torch_version()), tuple(states))
