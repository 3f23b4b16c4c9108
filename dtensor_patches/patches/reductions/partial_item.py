"""``.item()`` of a ``Partial`` DTensor returns this rank's share, not the value.

Trigger: ``loss = x.sum()`` with ``x`` sharded is ``Partial(sum)``; ``loss.item()``,
``float(loss)`` or ``int(count)`` (``aten._local_scalar_dense.default``) read the local share,
so every rank logs a different, wrong number (and a data-dependent branch on it desyncs the
ranks). Measured on 2 ranks: wrong on every release 2.9.1 to 2.15.0 (see the gate).

Fix: a miss rule on ``_local_scalar_dense``: a ``Partial`` input is reduced first, then read,
on a side process group with a check that every rank makes the same read
(:mod:`dtensor_patches.dispatch.scalar_reads`), so a read made on one rank only raises
``RankLocalReadError`` instead of pairing with another collective of the other ranks (issue 23,
item 6). Replicated and sharded inputs keep torch's path (decided once per schema).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.dispatch.scalar_reads import read_partial_scalar
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.reproducers import Case, randn


def _read_rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    (value,) = schema.args_schema[:1]
    placements = getattr(value, "placements", ())
    return read_partial_scalar if any(p.is_partial() for p in placements) else None


def _registrations() -> list[MissRule]:
    return [MissRule("aten._local_scalar_dense.default", _read_rule)]


# The Python numbers are returned as tensors so the comparison allows float rounding.
def _item_of_sum(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x.sum().item())


def _int_of_count(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(int((x > 0).sum(0).sum()))


def _item_of_row_sum(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x.sum(0)[1].item())


# The tripwire's cases: ``.item()`` / ``int()`` of Partial sums and counts vs the single-device number.
CASES = [
    Case("x.sum().item() of a Shard(0) x", _item_of_sum, lambda: [randn(4, 3)], ["S0"]),
    Case("int((x > 0).sum()) of a Shard(0) x", _int_of_count, lambda: [randn(5, 3)], ["S0"]),
    Case("x.sum(0)[1].item() of a Shard(0) x", _item_of_row_sum, lambda: [randn(4, 3)], ["S0"]),
]


PATCH = Patch(
    name="partial_item",
    summary=".item()/int()/float() of a Partial DTensor returns this rank's share (reduced first)",
    ops=("aten._local_scalar_dense.default",),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    upstream_issue="https://github.com/pytorch/pytorch/issues/166638",
    upstream_fix="https://github.com/pytorch/pytorch/pull/167598 (not in any release up to 2.15.0, measured)",
    overrides_existing=True,
    communication="one all-gather of two numbers per rank on a side gloo group, `Partial` inputs only",
)
