"""``.item()`` of a ``Partial`` DTensor returns this rank's share, not the value.

Trigger: ``loss = x.sum()`` with ``x`` sharded is ``Partial(sum)``; ``loss.item()``,
``float(loss)`` or ``int(count)`` (``aten._local_scalar_dense.default``) read the local share,
so every rank logs a different, wrong number (and a data-dependent branch on it desyncs the
ranks). Measured on 2 ranks: wrong on every release 2.9.1 to 2.15.0 (see the gate).

Fix: a miss rule on ``_local_scalar_dense``: a ``Partial`` input is reduced first (one scalar
all-reduce), then read. Replicated and sharded inputs keep torch's path.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches._builders import reduce_partial_first
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[MissRule]:
    return [reduce_partial_first("aten._local_scalar_dense.default")]


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
    communication="one scalar all-reduce, `Partial` inputs only",
)
