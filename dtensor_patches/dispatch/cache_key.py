"""Cache keys: which non-tensor arguments of an op key DTensor's cached sharding decisions.

torch caches one decision per distinct op schema, hashing the tensor arguments' specs and only
the non-tensor arguments its ``RuntimeSchemaInfo`` names (positional ones from
``static_argnum`` on). An argument left out of the key that changes the output (``topk``'s
``k``, ``histc``'s ``bins``) makes the second call reuse the first call's output spec: a DTensor
whose shape is not its local tensor's. A :class:`CacheKey` moves ``static_argnum`` down so that
the argument is hashed; the decision itself is torch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.ledger import EntryKey

__all__ = ["CacheKey"]


@dataclass(frozen=True)
class CacheKey:
    """Key ``op``'s cached decisions by its positional arguments from ``static_argnum`` on, in
    ``table`` (one of :data:`~dtensor_patches._torch.tables.SCHEMA_INFO_TABLES`), where torch
    registered a ``RuntimeSchemaInfo`` with a later ``static_argnum``. Costs one more cache
    entry per distinct value of the added arguments, nothing per cached call.

    Raises (at install):
        PatchError: the table or the op's ``RuntimeSchemaInfo`` moved.
    """

    op: str
    static_argnum: int
    table: str = torch_tables.SCHEMA_INFO_TABLES[0]
    kind: ClassVar[str] = "cache key"

    @property
    def concerns(self) -> tuple[str, ...]:
        return (self.op,)

    def entries(self) -> Sequence[EntryKey]:
        return [(self.table, resolve_op(self.op))]

    def install(self) -> None:
        torch_tables.set_static_argnum(self.table, resolve_op(self.op), self.static_argnum)
