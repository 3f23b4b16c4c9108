"""A recorded DTensor call (:class:`Call`) and the predicates a patch uses to say which calls
it concerns (``Patch.concerns``), so that ``scan()`` asks the patch instead of naming it.

A predicate answers ``True`` (the call is the case the patch fixes), ``False`` (it is not), or
``None`` (the recorded placements cannot tell: a dim, a dtype, ties). No torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Call",
    "CallPredicate",
    "mixed_and_sharded",
    "needs_sharded_inputs",
    "partial_inputs_only",
    "partial_or_sharded_target",
    "partial_plus_scalar",
    "undecidable",
    "uneven_or_sharded",
    "uneven_shards",
]


@dataclass
class Call:
    """One distinct ``(op, input placements)`` a step used.

    Attributes:
        op: ``"aten.op.overload"``.
        inputs: one entry per tensor argument in call order (lists flattened, then keyword
            arguments): a DTensor's placements, e.g. ``"S(1)"`` or ``"S(0)R"`` on a 2-D mesh,
            ``"P(sum)"``, or ``"tensor"`` for a plain ``torch.Tensor`` (0-dim ones included).
        count: how many calls had this key.
        uneven: some call had a sharded dim whose size the mesh dim does not divide.
        ran: how many calls returned without computing on gathered inputs (a strategy, a
            handler or a decomposition ran them).
        gathered: how many were computed on gathered inputs (the fallback took a refusal,
            or a patch that gathers by nature ran them).
        raised: the first line of the first error a call raised, ``""`` if none did.
        cells: the cells (:func:`dtensor_patches.cells.cell_key`: op and input layouts, uneven
            dims marked) the calls of this key were, in first-use order.
    """

    op: str
    inputs: tuple[str, ...]
    count: int = 0
    uneven: bool = False
    ran: int = 0
    gathered: int = 0
    raised: str = ""
    cells: list[str] = field(default_factory=list)

    @property
    def partial_inputs(self) -> bool:
        return any(i.startswith("P") or "P(" in i for i in self.inputs)

    @property
    def sharded_inputs(self) -> bool:
        return any(("S(" in i) or ("P(" in i) for i in self.inputs)

    @property
    def mixed(self) -> bool:
        return "tensor" in self.inputs

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "inputs": list(self.inputs),
            "count": self.count,
            "uneven": self.uneven,
            "ran": self.ran,
            "gathered": self.gathered,
            "raised": self.raised,
            "cells": list(self.cells),
        }


CallPredicate = Callable[[Call], "bool | None"]
"""Whether a recorded call is the case a patch fixes: ``True``, ``False`` or ``None`` (may be)."""


def needs_sharded_inputs(call: Call) -> bool | None:
    """The default: a measured bug needs sharded (or ``Partial``) data, since on ``Replicate()``
    inputs DTensor runs the op on the whole tensor; whether this call is the case depends on
    more than the placements."""
    return None if call.sharded_inputs else False


def undecidable(call: Call) -> bool | None:
    """The placements never decide it (a spec corrupted unless sharded on the selected dim)."""
    return None


def partial_or_sharded_target(call: Call) -> bool | None:
    """Written targets that need a placement change: a ``Partial`` target (certain); a sharded
    target the op may have to gather (may)."""
    if call.inputs and call.inputs[0].startswith("P"):
        return True
    return None if call.sharded_inputs else False


def partial_plus_scalar(call: Call) -> bool | None:
    """``Partial`` + a Python number: the number was added on every rank."""
    if not call.partial_inputs:
        return False
    return True if call.inputs == ("P(sum)",) else None


def partial_inputs_only(call: Call) -> bool | None:
    """A ``Partial`` input may be the case (a dtype the placements do not show)."""
    return None if call.partial_inputs else False


def uneven_shards(call: Call) -> bool | None:
    """Uneven shards are the case (even ones are measured right)."""
    return call.uneven


def uneven_or_sharded(call: Call) -> bool | None:
    """Uneven shards are the measured case; even ones may be (a global-count backward,
    ``ignore_index`` or weights, which placements do not show)."""
    return True if call.uneven else (None if call.sharded_inputs else False)


def mixed_and_sharded(call: Call) -> bool | None:
    """A plain tensor beside a sharded DTensor is the case; sharded alone may be."""
    if call.mixed and call.sharded_inputs:
        return True
    return None if call.sharded_inputs else False
