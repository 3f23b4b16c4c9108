"""Ops with data-dependent output shapes fail on DTensors on every release 2.9 to 2.15.

Trigger: ``torch.nonzero(mask)``, ``torch.masked_select(x, mask)``, ``torch.unique(ids)``,
``torch.bincount(ids)`` on DTensors (selecting valid tokens, counting token ids). They fail
inside shape propagation (``Sharding propagation failed``), before any strategy is looked up,
so a strategy cannot help.

Fix: a custom handler (``dtensor_patches.dispatch.gather.replicated_result``) gathers the inputs,
runs the op once on full tensors, and returns ``Replicate()`` DTensors holding the correct
global result (global indices for ``nonzero``). This gathers whole inputs by nature: each rank
needs the global output shape.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.dispatch.gather import replicated_result
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, randn

OPS = (
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.bincount.default",
)


def _registrations() -> list[Handler]:
    return [Handler(op, replicated_result) for op in OPS]


def _ids() -> torch.Tensor:
    return (torch.arange(30).reshape(5, 6) * 7) % 11


# The tripwire's cases: Each op on sharded inputs vs the single-device result (indices exact).
CASES = [
    Case("nonzero(x > 0)", lambda x: torch.nonzero(x > 0), lambda: [randn(5, 6)], ["S0"]),
    Case("nonzero(x > 0)", lambda x: torch.nonzero(x > 0), lambda: [randn(4, 6)], ["S1"]),
    Case(
        "masked_select(x, x > 0)",
        lambda x: torch.masked_select(x, x > 0),
        lambda: [randn(5, 6)],
        ["S1"],
    ),
    Case(
        "unique(ids, counts)",
        lambda x: torch.unique(x, return_inverse=True, return_counts=True),
        lambda: [_ids()],
        ["S0"],
    ),
    Case("unique(ids, dim=0)", lambda x: torch.unique(x, dim=0), lambda: [_ids() % 2], ["S1"]),
    Case("unique_consecutive(ids)", torch.unique_consecutive, lambda: [_ids() // 4], ["S0"]),
    Case("bincount(ids)", lambda x: torch.bincount(x), lambda: [torch.arange(11) % 5], ["S0"]),
]


PATCH = Patch(
    name="data_dependent",
    summary="nonzero, masked_select, unique, unique_consecutive, bincount: replicated global result",
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    replicates=True,
    communication="**replicates** (output shape is global)",
)
