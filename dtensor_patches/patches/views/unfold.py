"""``aten.unfold`` has no sharding strategy on torch 2.9 to 2.15.

Trigger: ``x.unfold(d, size, step)`` on a DTensor (sliding windows over a sequence, n-gram
features, chunked losses).

Fix: windows along ``d`` only read along ``d``: shards on other dims stay sharded (the window
dim is appended last, so dim numbers are unchanged), a shard on ``d`` is gathered first.
``Partial`` stays ``Partial`` (unfold is a linear view). No upstream strategy as of 2.15.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    return [dimwise("aten.unfold.default", dims=dims_arg(1, "dimension"), linear=True)]


# The tripwire's cases: ``unfold`` along sharded and unsharded dims, and of a ``Partial``, vs single-device.
CASES = [
    Case("x.unfold(1, 2, 1)", lambda x: x.unfold(1, 2, 1), lambda: [randn(4, 6)], ["S1"]),
    Case("x.unfold(1, 3, 2)", lambda x: x.unfold(1, 3, 2), lambda: [randn(5, 7)], ["S0"]),
    Case("x.unfold(0, 2, 1)", lambda x: x.unfold(0, 2, 1), lambda: [randn(5, 6)], ["P"]),
]


PATCH = Patch(
    name="unfold",
    summary="strategy for aten.unfold (torch 2.9 to 2.15)",
    ops=("aten.unfold.default",),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    upstream_issue=None,
    communication="only a shard on `dim`",
)
