"""Cache keys: which non-tensor arguments of an op key DTensor's cached sharding decisions.

torch caches one decision per distinct op schema, hashing the tensor arguments' specs and only
the non-tensor arguments its ``RuntimeSchemaInfo`` names (positional ones from
``static_argnum`` on). An argument left out of the key that changes the output (``topk``'s
``k``, ``histc``'s ``bins``) makes the second call reuse the first call's output spec: a DTensor
whose shape is not its local tensor's. Keyword arguments key it only where ``static_kwargkey``
names them: an ``out=`` tensor left out makes a call writing into an ``out`` of another
placement reuse the first call's decision, which relabels the ``out`` DTensor to the first
call's placement (and, when ``out`` is a view of another DTensor, leaves that base's local
tensors half written). A :class:`CacheKey` moves ``static_argnum`` down, or adds keyword
arguments, so that the argument is hashed; the decision itself is torch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.ledger import EntryKey

__all__ = ["CacheKey", "DecompositionOutKeys"]


@dataclass(frozen=True)
class CacheKey:
    """Key ``op``'s cached decisions by its positional arguments from ``static_argnum`` on
    (``None``: as torch has it), and by the keyword arguments ``keywords`` (an ``out=``
    overload's out tensors), in ``table`` (one of
    :data:`~dtensor_patches._torch.tables.SCHEMA_INFO_TABLES`). Costs one more cache entry per
    distinct value (or spec) of the added arguments, nothing per cached call.

    Raises (at install):
        PatchError: the table or the op's ``RuntimeSchemaInfo`` moved.
    """

    op: str
    static_argnum: int | None
    table: str = torch_tables.SCHEMA_INFO_TABLES[0]
    keywords: tuple[str, ...] = ()
    kind: ClassVar[str] = "cache key"

    @property
    def concerns(self) -> tuple[str, ...]:
        return (self.op,)

    def entries(self) -> Sequence[EntryKey]:
        return [(self.table, resolve_op(self.op))]

    def install(self) -> None:
        op = resolve_op(self.op)
        if self.static_argnum is not None:
            torch_tables.set_static_argnum(self.table, op, self.static_argnum)
        if self.keywords:
            torch_tables.set_static_kwargkey(self.table, op, self.keywords)


@dataclass(frozen=True)
class DecompositionOutKeys:
    """Key the cached decisions of every ``out=`` overload that DTensor propagates through its
    decomposition (no sharding strategy; 2.11+) by its out tensors too. torch infers those ops'
    ``RuntimeSchemaInfo`` on their first call and never names an out tensor in it, so a call
    into an out of another placement reuses the first call's decision (measured with
    ``mv.out`` on 2.12-2.15). Each entry is written now, as torch would infer it plus the out
    tensors (:func:`~dtensor_patches._torch.tables.key_decomposition_outs`), and taken out again
    on revert (torch infers its own on the next call). The ops are the release's, found at
    install (:func:`~dtensor_patches._torch.tables.decomposed_out_ops`): no op list to keep.
    Costs one more cache entry per distinct out placement, nothing per cached call.

    Raises (at install):
        PatchError: ``torch._decomp.decomposition_table``, ``_infer_schema_info_from_op`` or
            ``RuntimeSchemaInfo`` moved.
    """

    table: str = torch_tables.SCHEMA_INFO_TABLES[0]
    kind: ClassVar[str] = "cache key"

    @property
    def concerns(self) -> tuple[str, ...]:
        # Found per release, not declared: no op of a patch's list is claimed.
        return ()

    def entries(self) -> Sequence[EntryKey]:
        return [(self.table, op) for op, _ in torch_tables.decomposed_out_ops()]

    def install(self) -> None:
        for op, outs in torch_tables.decomposed_out_ops():
            torch_tables.key_decomposition_outs(self.table, op, outs)
