"""``a / b`` with ``b`` a pending sum (``Partial``) of more dims than ``a`` divides by each
rank's share on torch 2.11.

Trigger (measured on 2.11.0, stock and with every other patch; 2.9, 2.10 and 2.12 to 2.15
right): ``b = x.sum(0)`` or ``x.sum([0, 1], keepdim=True)`` of a sharded ``x`` (pending as
``Partial(sum)``), then ``torch.tensor(3.0) / b`` or ``r / b`` with ``r`` replicated and of
fewer dims: torch 2.11's pointwise strategy follows the operand with more dims, and
``div.Tensor`` is marked linear there (right for the numerator only), so the divisor's
``Partial(sum)`` is kept and the result is ``sum_r a / b_r`` instead of ``a / sum_r b_r``,
silently. Autograd makes this call itself: the gradient of ``x.amax()`` over every dim divides
a 0-d gradient by the ``[1, ..., 1]`` tie count (pending), so with ties split across ranks the
gradient was wrong even after ``empty_dims_reduce_all``.

Fix (a miss rule for ``div.Tensor``, consulted only on a cache miss): a call whose divisor is
``Partial(sum)``/``Partial(avg)`` and whose numerator is not pending runs with the divisor
reduced first (one all-reduce of the divisor: what torch does on the releases that get it
right). Every other division keeps torch's cached decision.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import Call
from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches._builders import run_partials_reduced
from dtensor_patches.reproducers import Case, randn


def _pending(spec: Any) -> bool:
    placements = getattr(spec, "placements", None) or ()
    return any(p.is_partial() for p in placements)


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    args = schema.args_schema
    if len(args) < 2 or not _pending(args[1]) or _pending(args[0]):
        return None  # a pending numerator over a replicated divisor is linear: torch's
    # The numerator is not pending, so reducing every pending input reduces the divisor.
    return run_partials_reduced


def _concerns(call: Call) -> bool | None:
    """A pending divisor beside a numerator that is not pending may be the case (the dims,
    which decide it, are not recorded)."""
    if len(call.inputs) < 2 or not call.inputs[1].startswith("P") or call.inputs[0].startswith("P"):
        return False
    return None


def _registrations() -> list[MissRule]:
    return [MissRule("aten.div.Tensor", _rule)]


# The divisor: a pending sum of a sharded x, of more dims than the numerator.
CASES = [
    Case(
        "3 / x.sum([0, 1], keepdim=True), 0-d numerator",
        lambda r, x: r / x.sum([0, 1], keepdim=True),
        lambda: [torch.tensor(3.0), randn(4, 3)],
        ["R", "S0"],
    ),
    Case(
        "r / x.sum(0)",
        lambda r, x: r / x.sum(0),
        lambda: [torch.tensor(2.0), randn(4, 3, seed=1)],
        ["R", "S0"],
    ),
    Case(
        "x.sum(0) / r (linear: stays pending)",
        lambda r, x: x.sum(0) / r,
        lambda: [torch.tensor([2.0, 4.0, 8.0]), randn(4, 3, seed=2)],
        ["R", "S0"],
    ),
]


PATCH = Patch(
    name="partial_divisor",
    summary="a / b with b pending (Partial) and of more dims than a reduces b first instead of "
    "dividing by each rank's share (2.11)",
    ops=("aten.div.Tensor",),
    gate=SpecifierSet(">=2.11,<2.12"),
    overrides_existing=True,
    registrations=_registrations,
    concerns=_concerns,
    cases=CASES,
    communication="one all-reduce of the divisor (the lower bound: a / b needs the whole b)",
)
