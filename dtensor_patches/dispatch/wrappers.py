"""Wrapped torch functions: a function torch looks up by name when it runs (a module global or a
class method), replaced at every place torch looks it up by a wrapper built around torch's own.

For fixes outside DTensor's dispatch: the optimizers' grouping of tensors, gradient-norm
clipping, the parallel styles' ``distribute_module``, what ``loss_parallel()`` does on leaving,
DTensor's check of a plain tensor argument. The places each function is looked up are
:data:`dtensor_patches._torch.attributes.FUNCTION_SITES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from dtensor_patches import state
from dtensor_patches._torch import attributes
from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.access import moved
from dtensor_patches.errors import PatchError
from dtensor_patches.ledger import MISSING, EntryKey

__all__ = ["WrappedFunction", "original_function"]


def original_function(name: str, owner: str | None = None) -> Callable[..., Any]:
    """torch's own ``name`` (a key of ``FUNCTION_SITES``, or an attribute of ``owner``:
    ``module`` or ``module:Class``), as its first site holds it before any replacement by the
    library.

    Raises:
        PatchError: the site or the function moved.
    """
    directory = torch_tables.tables()
    table_name = _site_tables(name, owner)[0]
    current = directory[table_name].get(name)
    value = state.LEDGER.original((table_name, name), current)
    if value is MISSING:
        raise moved(f"{table_name.removeprefix(attributes.PREFIX)}.{name}")
    return value


def _site_tables(name: str, owner: str | None) -> list[str]:
    return [attributes.table_name(owner)] if owner else attributes.site_table_names(name)


@dataclass(frozen=True)
class WrappedFunction:
    """Replace torch's ``name`` at every site with ``make(torch_function)``; all sites or none.
    The sites: ``FUNCTION_SITES[name]``, or the one ``owner`` (``module`` or
    ``module:Class``) for a method that each class defines for itself (the parallel styles'
    ``_prepare_input_fn``).

    Raises (at install):
        PatchError: a site or the function moved, or a site holds something other than torch's
            function that the library did not put there (someone else replaced it).
    """

    name: str
    make: Callable[[Any], Any]  # torch's function (or property) -> its replacement
    owner: str | None = None
    kind: ClassVar[str] = "wrapped function"

    @property
    def concerns(self) -> tuple[str, ...]:
        return ()

    def entries(self) -> Sequence[EntryKey]:
        return [(table, self.name) for table in _site_tables(self.name, self.owner)]

    def install(self) -> None:
        directory = torch_tables.tables()
        original = original_function(self.name, self.owner)
        planned = []
        for table_name in _site_tables(self.name, self.owner):
            table = directory[table_name]
            current = table.get(self.name)
            if current is MISSING:
                raise moved(f"{table_name.removeprefix(attributes.PREFIX)}.{self.name}")
            owned = state.LEDGER.owner_of(directory, (table_name, self.name)) is not None
            if current is not original and not owned:
                raise PatchError(
                    f"{table_name.removeprefix(attributes.PREFIX)}.{self.name} is not torch's "
                    "own (someone else replaced it); not touching it",
                    internal=f"{table_name.removeprefix(attributes.PREFIX)}.{self.name}",
                )
            planned.append(table)
        wrapper = self.make(original)
        for table in planned:
            table[self.name] = wrapper
