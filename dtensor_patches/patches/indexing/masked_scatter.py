"""``masked_scatter`` fails on DTensors on every release 2.9 to 2.15.

Trigger: ``x.masked_scatter(mask, src)`` / ``x.masked_scatter_(mask, src)`` (writing image or
audio embeddings into the token positions of a multimodal sequence). ``src`` is consumed in
order over every masked position of the whole tensor, so no rank can compute its shard alone.

Fix: custom handlers: the out-of-place op returns the correct global result as ``Replicate()``;
the in-place op writes each rank's shard of the result back into the caller's tensor, which
keeps its placements.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.dispatch.gather import inplace_through_full, replicated_result
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Handler]:
    return [
        Handler("aten.masked_scatter.default", replicated_result),
        Handler("aten.masked_scatter_.default", inplace_through_full),
    ]


def _inputs() -> list[torch.Tensor]:
    x = randn(5, 6)
    return [x, x > 0, randn(30, seed=1)]


def _inplace(x: torch.Tensor, mask: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return x.masked_scatter_(mask, src)


# The tripwire's cases: Out-of-place and in-place ``masked_scatter`` on sharded tensors vs single-device.
CASES = [
    Case(
        "x.masked_scatter(mask, src)",
        lambda x, m, s: x.masked_scatter(m, s),
        _inputs,
        ["S0", "S0", "R"],
    ),
    Case("x.masked_scatter_(mask, src)", _inplace, _inputs, ["S1", "R", "R"], inplace=True),
]


PATCH = Patch(
    name="masked_scatter",
    summary="masked_scatter / masked_scatter_ on sharded tensors",
    ops=("aten.masked_scatter.default", "aten.masked_scatter_.default"),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    replicates=True,
    communication="**replicates**",
)
