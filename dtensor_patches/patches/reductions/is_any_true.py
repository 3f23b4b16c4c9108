"""``aten._is_any_true.default`` has no sharding strategy on any release 2.9 to 2.15.

Trigger: ``torch._is_any_true(mask)`` of a DTensor: the "is anything true" check behind
NaN/inf guards on sharded tensors (``torch._assert_async`` of a sharded mask, anomaly-style
checks of gradients), which stacks such as torchtitan turn off under DTensor (issue 20).
Through the fallback every rank would gather the whole mask.

Fix: a strategy like torch's own ``aten.any.default``: each rank checks its shard and the 0-dim
result is ``Partial(sum)`` over the sharded mesh dims (a sum of bools is their OR); reading it
reduces one bool. A ``Partial`` input is reduced first (``any`` of shares is not ``any`` of
their sum); a replicated input gives a replicated answer with no communication.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn, randn_nan_last
from dtensor_patches.strategies import is_shard, rule_strategy, schema_info


def _is_any_true(op_schema: Any) -> Any:
    from torch.distributed.tensor import Partial, Replicate

    def rule(p: Any) -> tuple[Any, Any]:
        if is_shard(p):
            return p, Partial("sum")
        return Replicate(), Replicate()

    return rule_strategy(op_schema, rule)


def _registrations() -> list[Strategy]:
    return [Strategy("aten._is_any_true.default", _is_any_true, schema_info(1))]


def _any_true(mask: torch.Tensor) -> torch.Tensor:
    """``torch._is_any_true(mask)``, through the op (its Python name is private)."""
    return resolve_op("aten._is_any_true.default")(mask)


def _none_true(*shape: int) -> torch.Tensor:
    return randn(*shape).abs() + 1.0


# The tripwire's cases: the check of a NaN on one rank's shard, and of none, vs the single device.
CASES = [
    Case(
        "_is_any_true(isnan(x))",
        lambda x: _any_true(torch.isnan(x)),
        lambda: [randn_nan_last(5, 3)],
        ["S0"],
    ),
    Case(
        "_is_any_true(x < 0)",
        lambda x: _any_true(x < 0),
        lambda: [_none_true(4, 6)],
        ["S1"],
    ),
    Case(
        "_is_any_true(isnan(x))",
        lambda x: _any_true(torch.isnan(x)),
        lambda: [randn_nan_last(3, 2)],
        ["R"],
    ),
]


PATCH = Patch(
    name="is_any_true",
    summary="strategy for aten._is_any_true: each shard checked, Partial(sum) result (NaN guards)",
    ops=("aten._is_any_true.default",),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="none in any release up to 2.15.0 (measured)",
    communication="none (one bool when the result is read)",
)
