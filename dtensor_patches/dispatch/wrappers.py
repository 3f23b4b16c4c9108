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


def original_function(name: str) -> Callable[..., Any]:
    """torch's own ``name`` (a key of ``FUNCTION_SITES``), as its first site holds it before
    any replacement by the library.

    Raises:
        PatchError: the site or the function moved.
    """
    directory = torch_tables.tables()
    table_name = attributes.site_table_names(name)[0]
    current = directory[table_name].get(name)
    value = state.LEDGER.original((table_name, name), current)
    if value is MISSING:
        raise moved(f"{attributes.FUNCTION_SITES[name][0]}.{name}")
    return value


@dataclass(frozen=True)
class WrappedFunction:
    """Replace torch's ``name`` (a key of ``FUNCTION_SITES``) at every site with
    ``make(torch_function)``; all sites or none.

    Raises (at install):
        PatchError: a site or the function moved, or a site holds something other than torch's
            function that the library did not put there (someone else replaced it).
    """

    name: str
    make: Callable[[Any], Any]  # torch's function (or property) -> its replacement
    kind: ClassVar[str] = "wrapped function"

    @property
    def concerns(self) -> tuple[str, ...]:
        return ()

    def entries(self) -> Sequence[EntryKey]:
        return [(table, self.name) for table in attributes.site_table_names(self.name)]

    def install(self) -> None:
        directory = torch_tables.tables()
        original = original_function(self.name)
        planned = []
        for table_name in attributes.site_table_names(self.name):
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
