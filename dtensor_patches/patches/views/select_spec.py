"""``aten.select.int`` corrupts its input's spec where the input is not sharded on the dim.

Trigger (torch 2.9.1, measured): ``x[0]`` or ``x.select(0, i)`` on a DTensor that is not
sharded on the selected dim (``Replicate()``, ``Partial()``, or sharded elsewhere). torch's
strategy hands the input's own ``DTensorSpec`` object back as the output spec, and propagation
then writes the *output's* tensor meta into it. The input DTensor (and every cached decision
that shares that spec object) now claims the output's shape: a replicated ``[N, 1]`` tensor
reports global shape ``()`` after ``x[0]`` while its local shape is ``(1,)``; the next
``x.sum(0)`` comes back with shape ``()``; a mixture-of-experts router loop
(``torch.where(expert_mask[i])``) fails, and a later ``unbind`` breaks.

Fix: the same rule with fresh spec objects: shards on other dims stay (renumbered past the
selected dim), a shard on the selected dim is gathered first, ``Partial`` stays (select is
linear), no communication otherwise.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import undecidable
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    return [dimwise("aten.select.int", dims=dims_arg(1, default=0), keepdim=False, linear=True)]


def _select_then_shape(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    first = x[0]
    # The input must still be what it was: its sum and a second select.
    return first, x.sum(0) + x[1]


def _router_loop(mask: torch.Tensor) -> list[torch.Tensor]:
    # MoE routing: one row of a [E, T] expert mask per expert, then its nonzero positions.
    return [mask[i].float().sum(0) for i in range(mask.shape[0])]


def _rows_of_partial(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = x.sum(0)
    return p[0], p.sum()


# The tripwire's cases: Selects on unsharded dims, then the input used again, vs single-device results.
CASES = [
    Case("x[0] of a replicated [N, 1]", _select_then_shape, lambda: [randn(4, 1)], ["R"]),
    Case("x[0] of a Shard(1) x", _select_then_shape, lambda: [randn(4, 6)], ["S1"]),
    Case("mask[i] router loop", _router_loop, lambda: [(randn(3, 5) > 0).float()], ["R"]),
    Case("p[0] of a Partial", _rows_of_partial, lambda: [randn(4, 3, 2)], ["S0"]),
]


PATCH = Patch(
    name="select_spec",
    summary="aten.select.int no longer writes the output's shape into its input's spec",
    ops=("aten.select.int",),
    gate=SpecifierSet(">=2.9,<2.10"),
    registrations=_registrations,
    cases=CASES,
    concerns=undecidable,
    overrides_existing=True,
    communication="none (a shard on the selected dim is gathered, as torch does)",
)
