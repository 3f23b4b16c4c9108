"""Custom handlers: a function that runs an op on DTensors instead of sharding propagation.

DTensor consults its handler table (``OpDispatcher._custom_op_handlers``) before anything else,
on every call of the op, so a handler puts Python on every call: for ops that no strategy can
serve (data-dependent output shapes, writes whose result depends on other shards, losses whose
reduction needs a global count), never for a rare case of a common op (use a miss rule).

``loss_parallel()`` keeps a handler table of its own that it installs on entering its block:
:class:`LossParallelHandler` replaces an entry of that table, so only calls inside the block
change. ``context_parallel()`` does the same with its ring-attention handlers:
:class:`ContextParallelHandler` adds an entry there, so only calls inside its block change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from dtensor_patches._torch import context_parallel
from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.access import moved
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.ledger import EntryKey

__all__ = ["ContextParallelHandler", "Handler", "HandlerFn", "LossParallelHandler"]

HandlerFn = Callable[[Any, tuple[Any, ...], dict[str, Any]], object]
"""``handler(op_call, args, kwargs) -> output``."""


@dataclass(frozen=True)
class Handler:
    """Route ``op`` on DTensors to ``fn(op_call, args, kwargs)``, before sharding propagation.

    ``around``: instead of ``fn``, build the handler from torch's own handler for ``op`` (or
    ``None`` where torch has none), to keep it for the calls it gets right.
    """

    op: str
    fn: HandlerFn | None = None
    around: Callable[[HandlerFn | None], HandlerFn] | None = None
    kind: ClassVar[str] = "handler"

    def __post_init__(self) -> None:
        if (self.fn is None) == (self.around is None):
            raise ValueError(f"Handler({self.op!r}) takes exactly one of fn= and around=")

    @property
    def concerns(self) -> tuple[str, ...]:
        return (self.op,)

    def entries(self) -> Sequence[EntryKey]:
        return [(torch_tables.HANDLERS, resolve_op(self.op))]

    def install(self) -> None:
        op = resolve_op(self.op)
        if self.around is not None:
            fn = self.around(torch_tables.custom_op_handlers().get(op))
        else:
            assert self.fn is not None
            fn = self.fn
        torch_tables.register_custom_handler(op, fn)


@dataclass(frozen=True)
class LossParallelHandler:
    """Replace ``loss_parallel()``'s own handler for ``op`` with ``make(torch_handler)``.

    Raises (at install):
        PatchError: ``loss_parallel()`` has no handler for ``op`` in this release.
    """

    op: str
    make: Callable[[HandlerFn], HandlerFn]
    kind: ClassVar[str] = "loss_parallel() handler"

    @property
    def concerns(self) -> tuple[str, ...]:
        return (self.op,)

    def entries(self) -> Sequence[EntryKey]:
        return [(torch_tables.LOSS_PARALLEL_HANDLERS, resolve_op(self.op))]

    def install(self) -> None:
        table = torch_tables.tables()[torch_tables.LOSS_PARALLEL_HANDLERS]
        op = resolve_op(self.op)
        current = table.get(op, None)
        if current is None:
            raise moved(
                "torch.distributed.tensor.parallel.loss.customized_loss_ops",
                f"loss_parallel() has no handler for {self.op}",
            )
        table[op] = self.make(current)


@dataclass(frozen=True)
class ContextParallelHandler:
    """Add ``fn`` as ``context_parallel()``'s handler for ``op``: DTensor routes ``op`` to it
    only inside a ``context_parallel()`` block (entered after the install), at no cost outside.

    Raises (at install):
        PatchError: torch's context parallelism moved, or it already has a handler for ``op``
            (then torch serves the op itself and the patch is not needed).
    """

    op: str
    fn: HandlerFn
    kind: ClassVar[str] = "context_parallel() handler"

    @property
    def concerns(self) -> tuple[str, ...]:
        return (self.op,)

    def entries(self) -> Sequence[EntryKey]:
        return [(context_parallel.CONTEXT_PARALLEL_HANDLERS, resolve_op(self.op))]

    def install(self) -> None:
        context_parallel.check()
        table = torch_tables.tables()[context_parallel.CONTEXT_PARALLEL_HANDLERS]
        op = resolve_op(self.op)
        if table.get(op) is not None:
            raise moved(
                f"{context_parallel.attention_module().__name__}.custom_ops",
                f"context_parallel() already has a handler for {self.op}",
            )
        table[op] = self.fn
