"""Casting a ``Partial()`` DTensor to an integer or bool dtype truncates each rank's share.

Trigger: ``y = x.sum(0)`` with ``x`` sharded on dim 0 is ``Partial()``; ``y.long()``,
``y.to(torch.int32)`` or ``y.bool()`` (``aten._to_copy.default``) keep it ``Partial()`` on torch
2.9 to 2.11, so each rank truncates its own share and the truncated shares are summed:
``int(0.6) + int(0.6) = 0`` instead of ``int(1.2) = 1``. Token counts and bucket ids computed
from partial sums hit this.

Fix (replacing torch's strategy for ``_to_copy``): ``strategies.elementwise_strategy``; a
pending sum or average stays pending only between floating (or complex) dtypes, where the cast
commutes with the reduction; before a cast to an integer or bool dtype it is reduced first. A
pending max or min stays pending except before a cast to bool (every other cast is
non-decreasing).
Shards stay sharded. Measured correct from torch 2.12.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import partial_inputs_only
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import (
    PartialRule,
    elementwise_strategy,
    reduce_op_of,
    schema_info,
    tensor_meta,
)


def _cast_rule(op_schema: Any) -> PartialRule:
    src = tensor_meta(op_schema.args_schema[0]).dtype
    dst = op_schema.kwargs_schema.get("dtype") or src

    def rule(column: list[tuple[int, Any]]) -> tuple[list[Any], Any] | None:
        ((_, p),) = column
        kind = reduce_op_of(p)
        floating = (src.is_floating_point or src.is_complex) and (
            dst.is_floating_point or dst.is_complex
        )
        # A sum or average commutes with a cast between floating dtypes only; every real cast
        # but to bool is non-decreasing, so it commutes with a max or min.
        ordered = dst != torch.bool and not dst.is_complex
        if (kind in ("sum", "avg") and floating) or (kind in ("max", "min") and ordered):
            return [p], p
        return None

    return rule


def _to_copy_strategy(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema, partial_rule=_cast_rule(op_schema))


def _registrations() -> list[Strategy]:
    return [
        Strategy(
            "aten._to_copy.default", _to_copy_strategy, schema_info(static_kwargkey=("dtype",))
        )
    ]


# The tripwire's cases: Pending sums cast to integer dtypes vs single-device.
CASES = [
    Case("(3 * P).long()", lambda x: (3 * x).long(), lambda: [randn(5, 6)], ["P"]),
    Case("x.sum(0).int()", lambda x: (x * 2).sum(0).int(), lambda: [randn(5, 6)], ["S0"]),
]


PATCH = Patch(
    name="partial_int_cast",
    summary="reduce Partial() before a cast to an integer or bool dtype (torch 2.9 to 2.11)",
    ops=("aten._to_copy.default",),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    concerns=partial_inputs_only,
    upstream_fix="correct from torch 2.12 (measured): dtype-aware _to_copy strategy",
    overrides_existing=True,
    communication="none, except integer casts of `Partial`",
)
