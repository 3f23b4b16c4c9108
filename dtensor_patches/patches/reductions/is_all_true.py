"""``aten._is_all_true.default`` has no sharding strategy on any release 2.9 to 2.15.

Trigger: ``torch._is_all_true(mask)`` of a DTensor: the "is everything true" check behind
finite-value guards (``torch._assert_async(torch._is_all_true(torch.isfinite(grad)))``,
``torch.testing``-style checks of sharded tensors). Through the fallback every rank would gather
the whole mask (issue 20; the AND twin of ``is_any_true``).

Fix: each rank checks its shard and the 0-dim result is ``Partial("min")`` over the sharded
mesh dims (the minimum of bools is their AND); reading it reduces one bool. A ``Partial`` input
is reduced first (``all`` of shares is not ``all`` of their sum); a replicated input gives a
replicated answer with no communication.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn, randn_nan_last
from dtensor_patches.strategies import is_shard, rule_strategy, schema_info


def _is_all_true(op_schema: Any) -> Any:
    from torch.distributed.tensor import Partial, Replicate

    def rule(p: Any) -> tuple[Any, Any]:
        if is_shard(p):
            return p, Partial("min")
        return Replicate(), Replicate()

    return rule_strategy(op_schema, rule)


def _registrations() -> list[Strategy]:
    return [Strategy("aten._is_all_true.default", _is_all_true, schema_info(1))]


def _all_true(mask: torch.Tensor) -> torch.Tensor:
    """``torch._is_all_true(mask)``, through the op (its Python name is private)."""
    return resolve_op("aten._is_all_true.default")(mask)


# The tripwire's cases: a NaN on one rank's shard (False), none (True), and a replicated mask.
CASES = [
    Case(
        "_is_all_true(isfinite(x))",
        lambda x: _all_true(torch.isfinite(x)),
        lambda: [randn_nan_last(5, 3)],
        ["S0"],
    ),
    Case(
        "_is_all_true(x > -10)",
        lambda x: _all_true(x > -10),
        lambda: [randn(4, 6)],
        ["S1"],
    ),
    Case(
        "_is_all_true(isfinite(x))",
        lambda x: _all_true(torch.isfinite(x)),
        lambda: [randn_nan_last(3, 2)],
        ["R"],
    ),
]


PATCH = Patch(
    name="is_all_true",
    summary="strategy for aten._is_all_true: each shard checked, Partial(min) result (finite-value guards)",
    ops=("aten._is_all_true.default",),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="none in any release up to 2.15.0 (measured)",
    communication="none (one bool when the result is read)",
)
