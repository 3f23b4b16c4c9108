"""Reductions with no sharding strategy on torch 2.9: ``argmax``/``argmin``, ``logsumexp``, ``std``.

Trigger: ``x.argmax(1)``, ``torch.logsumexp(x, 1)``, ``x.std(1)`` on any DTensor raise
``NotImplementedError: Operator aten.<op> does not have a sharding strategy registered``.
Common in RL stacks: greedy tokens (argmax over the vocab), log-normalisers of logits, and
reward/advantage statistics.

Fix: a dimwise strategy (``dtensor_patches.strategies.dimwise_strategy``): shards on the dims
not reduced stay sharded with no communication; a shard on a reduced dim, or a ``Partial()``
input, is gathered first. Indices from ``argmax``/``argmin`` are then global. Measured fixed
upstream in torch 2.10 (each op has a native strategy or handler there).
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.patches._builders import dims_arg, dimwise, keepdim_arg
from dtensor_patches.reproducers import Case, randn


def _registrations() -> list[Strategy]:
    arg_reduce = {"dims": dims_arg(1), "keepdim": keepdim_arg(2)}
    return [
        dimwise("aten.argmax.default", **arg_reduce),
        dimwise("aten.argmin.default", **arg_reduce),
        dimwise("aten.logsumexp.default", **arg_reduce),
        dimwise(
            "aten.std.correction",
            dims=dims_arg(1),
            keepdim=keepdim_arg(99),  # keyword-only
            static_kwargkey=("correction", "keepdim"),
        ),
    ]


# The tripwire's cases: The reductions above on ``Shard(0)``/``Shard(1)`` inputs vs single-device results.
# Sizes that leave no rank an empty shard on 2 or 4 ranks (7 rows: 4 + 3, 2 + 2 + 2 + 1): an
# empty shard hits another stock bug (empty_shard_extrema) whose raise on one rank aborts the
# whole run where this patch is gated out.
CASES = [
    Case("x.argmax(1)", lambda x: x.argmax(1), lambda: [randn(4, 8)], ["S1"]),
    Case("x.argmin(0)", lambda x: x.argmin(0), lambda: [randn(7, 6)], ["S0"]),
    Case("logsumexp(x, 1)", lambda x: torch.logsumexp(x, 1), lambda: [randn(4, 6)], ["S0"]),
    Case("logsumexp(x, 1)", lambda x: torch.logsumexp(x, 1, True), lambda: [randn(4, 6)], ["S1"]),
    Case("x.std(1)", lambda x: x.std(1), lambda: [randn(4, 6)], ["S1"]),
    Case("x.std(0)", lambda x: x.std(0, correction=0), lambda: [randn(5, 6)], ["S1"]),
]


PATCH = Patch(
    name="dim_reductions",
    summary="strategies for argmax/argmin, logsumexp, std (torch 2.9)",
    ops=(
        "aten.argmax.default",
        "aten.argmin.default",
        "aten.logsumexp.default",
        "aten.std.correction",
    ),
    gate=SpecifierSet(">=2.9,<2.10"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategies from torch 2.10 (measured)",
    communication="only a shard on the reduced dim is gathered",
)
