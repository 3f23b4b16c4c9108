"""Sharding strategies: how DTensor's propagation places an op's inputs and outputs.

A strategy function takes an ``OpSchema`` whose tensor arguments are ``OpStrategy`` objects and
returns an ``OpStrategy`` of acceptable ``OpSpec``s; torch picks the cheapest, redistributes
the inputs and runs the local op. Its decision is cached per distinct schema. The builders
patches write strategies with are in :mod:`dtensor_patches.strategies`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.schemas import out_variant, resolve_op
from dtensor_patches.dispatch.registration import entry_keys
from dtensor_patches.ledger import EntryKey

if TYPE_CHECKING:
    from dtensor_patches._torch.types import OpSchema, RuntimeSchemaInfo

__all__ = ["Strategy"]


@dataclass(frozen=True)
class Strategy:
    """Register ``fn(op_schema) -> OpStrategy | TupleStrategy`` as ``op``'s sharding strategy.

    ``schema_info`` is a ``RuntimeSchemaInfo`` naming the non-tensor arguments that change the
    decision (dims, flags); without it the propagation cache reuses one decision for all of them.
    """

    op: str
    fn: Callable[[OpSchema], Any]
    schema_info: RuntimeSchemaInfo | None = None
    kind: ClassVar[str] = "strategy"

    @property
    def concerns(self) -> tuple[str, ...]:
        return (self.op,)

    def entries(self) -> Sequence[EntryKey]:
        # register_op_strategy writes more than one table (the strategy and its schema info);
        # every op-keyed table is watched so that none of its writes goes unrecorded.
        names = [
            n for n in torch_tables.table_names() if n.startswith(("propagator.", "dispatcher."))
        ]
        return entry_keys(names, [resolve_op(self.op)])

    def install(self) -> None:
        torch_tables.register_strategy(resolve_op(self.op), self.fn, self.schema_info)

    def out_variant(self, *, overriding: bool) -> Strategy | None:
        """The same strategy for this op's single-out ``out=`` overload (``cumprod.out``), where
        DTensor would use it: ``None`` when there is no such overload, when it has a single-dim
        strategy (2.11+, which would shadow ours), or when torch has a strategy for it and
        ``overriding`` is false."""
        name = out_variant(self.op)
        if name is None:
            return None
        op = resolve_op(name)
        if torch_tables.has_single_dim_strategy(op):
            return None
        if torch_tables.has_native_strategy(op) and not overriding:
            return None
        return Strategy(name, self.fn, self.schema_info)
