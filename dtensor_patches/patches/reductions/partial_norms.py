"""``amax``/``amin`` and vector norms of a ``Partial(sum)`` DTensor are wrong on torch 2.9.

Trigger (torch 2.9.1, measured): ``p = x.sum(0)`` with ``x`` sharded is ``Partial(sum)``;
``p.amax()``, ``torch.linalg.vector_norm(p)`` and ``torch._foreach_norm([p])`` keep the output
``Partial(sum)``, so the result is the *sum of the per-rank maxima / norms*. The gradient norm
of ``clip_grad_norm_`` over gradients that are still ``Partial`` (TP without a reduction yet,
gradients accumulated by hand with ``from_local(..., [Partial()])``) is silently wrong, and so
is the clipping. Measured correct on 2.10.0 and later (see the gate).

Fix: a miss rule per op (``_reduce_first``): a ``Partial`` input is reduced first, then
torch's own strategy runs; sharded and replicated inputs keep torch's path (a ``Shard``
gradient's norm stays a cheap partial norm).
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.modes import foreach_norm
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches._builders import reduce_partial_first
from dtensor_patches.reproducers import Case, randn

OPS = (
    "aten.amax.default",
    "aten.amin.default",
    "aten.linalg_vector_norm.default",
    "aten._foreach_norm.Scalar",
)


def _registrations() -> list[MissRule]:
    return [reduce_partial_first(op) for op in OPS]


# ``x.sum(0)`` of a ``Shard(0)`` x is ``Partial(sum)`` with shares of different signs (a
# ``Partial`` made of scaled copies would hide the bug: max and norm commute with a positive
# scale).
# The tripwire's cases: amax/amin/vector_norm/_foreach_norm of Partial(sum) tensors vs single-device.
CASES = [
    Case("x.sum(0).amax()", lambda x: x.sum(0).amax(), lambda: [randn(4, 6)], ["S0"]),
    Case("x.sum(0).amin(-1)", lambda x: x.sum(0).amin(-1), lambda: [randn(4, 2, 6)], ["S0"]),
    Case(
        "vector_norm(x.sum(0))",
        lambda x: torch.linalg.vector_norm(x.sum(0)),
        lambda: [randn(4, 6)],
        ["S0"],
    ),
    Case(
        "_foreach_norm of Partial(sum) grads",
        lambda x, y: tuple(foreach_norm()([x.sum(0), y.sum(0)])),
        lambda: [randn(4, 6), randn(4, 3, 2, seed=1)],
        ["S0", "S0"],
    ),
    Case(
        "vector_norm of a Shard(0) (stays torch's)",
        lambda x: torch.linalg.vector_norm(x),
        lambda: [randn(6)],
        ["S0"],
    ),
]


PATCH = Patch(
    name="partial_norms",
    summary="amax/amin/vector_norm/_foreach_norm of a Partial(sum) DTensor reduce first (2.9)",
    ops=OPS,
    gate=SpecifierSet(">=2.9,<2.10"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="https://github.com/pytorch/pytorch/pull/159856, https://github.com/pytorch/pytorch/pull/165962 (2.10)",
    overrides_existing=True,
    communication="all-reduce of `Partial` inputs only; shards keep torch's path",
)
