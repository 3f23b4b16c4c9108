"""The infinity norm of a pending maximum (``Partial(max)``), and the ``-inf`` norm of a pending
minimum, keep the pending placement and are wrong, on torch 2.11 to 2.15.

Trigger (measured on 2.11.0 to 2.15.0, stock and with every other patch):
``x`` placed ``Partial("max")`` (each rank holds a share, the value is their elementwise
maximum: ``from_local(..., [Partial("max")])``, or an ``amax`` over a sharded dim before it is
read), then ``torch.linalg.vector_norm(x, inf)`` (with or without ``dim``): torch's strategy
(since pytorch#165962) keeps ``Partial(max)`` on the result, i.e. the maximum over ranks of
each share's ``max |x_r|``, but ``|max_r x_r|`` is not ``max_r |x_r|`` once a share holds a
large negative value. The same for ``vector_norm(x, -inf, dim=d)`` of a ``Partial("min")``.
2.10 is right; on 2.9 ``partial_norms`` reduces every pending input of a norm. Found by the strategy
validator (``norm.inf``, ``P.min``, once its ranks no longer crashed).

Fix (a miss rule per op, consulted only on a cache miss): an infinity norm of an input pending
as a maximum or minimum runs on the input reduced first (one all-reduce of the input, which
any correct computation of it needs); every other norm keeps torch's decision.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import Call
from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches._builders import run_partials_reduced
from dtensor_patches.reproducers import Case, randn

# op -> position of its order argument.
_ORDER_AT = {
    "aten.linalg_vector_norm.default": 1,
    "aten.linalg_vector_norm.out": 1,
    "aten._foreach_norm.Scalar": 1,
}


def _pending_extremum(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return any(_pending_extremum(v) for v in value)
    placements = getattr(value, "placements", None) or ()
    return any(p.is_partial("max") or p.is_partial("min") for p in placements)


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    args = schema.args_schema
    at = _ORDER_AT[str(schema.op)]
    order = args[at] if len(args) > at else schema.kwargs_schema.get("ord", 2)
    if order not in (math.inf, -math.inf) or not args or not _pending_extremum(args[0]):
        return None
    return run_partials_reduced


def _concerns(call: Call) -> bool | None:
    """An input pending as a maximum or minimum may be the case (the norm's order, which
    decides it, is not recorded)."""
    return None if any("P(max)" in i or "P(min)" in i for i in call.inputs) else False


def _registrations() -> list[MissRule]:
    return [MissRule(op, _rule) for op in _ORDER_AT]


def _pending(reduce_op: str) -> Any:
    """``full -> DTensor`` pending as ``reduce_op`` over shares whose combination is ``full``:
    rank 0 holds ``full``, the others the identity of ``reduce_op`` (so it reads back exactly)."""

    def make(x: Any) -> Any:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Partial

        if not isinstance(x, DTensor):
            return x
        full = x.full_tensor()
        fill = -math.inf if reduce_op == "max" else math.inf
        local = (
            full if dist.get_rank(x.device_mesh.get_group()) == 0 else torch.full_like(full, fill)
        )
        return DTensor.from_local(local, x.device_mesh, [Partial(reduce_op)], run_check=False)

    return make


def _shares_differ(reduce_op: str) -> Any:
    """``full -> DTensor`` pending as ``reduce_op``, every rank's share different: rank ``r``
    holds ``full`` shifted by ``-3 r`` for a maximum (``+3 r`` for a minimum), so the maximum
    is rank 0's ``full`` while another share holds the largest ``|value|``."""

    def make(x: Any) -> Any:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Partial

        if not isinstance(x, DTensor):
            return x
        full = x.full_tensor()
        rank = dist.get_rank(x.device_mesh.get_group())
        shift = -3.0 * rank if reduce_op == "max" else 3.0 * rank
        return DTensor.from_local(
            full + shift, x.device_mesh, [Partial(reduce_op)], run_check=False
        )

    return make


# The tripwire's cases: x replicated on the mesh, made pending with shares that differ.
CASES = [
    Case(
        "vector_norm(P.max, inf)",
        lambda x: torch.linalg.vector_norm(_shares_differ("max")(x), math.inf),
        lambda: [randn(4, 3)],
        ["R"],
    ),
    Case(
        "vector_norm(P.min, -inf, dim=1)",
        lambda x: torch.linalg.vector_norm(_shares_differ("min")(x), -math.inf, dim=1),
        lambda: [randn(4, 3, seed=1)],
        ["R"],
    ),
    Case(
        "vector_norm(P.max, 2) (reduced by torch)",
        lambda x: torch.linalg.vector_norm(_pending("max")(x)),
        lambda: [randn(4, 3, seed=2)],
        ["R"],
    ),
]


PATCH = Patch(
    name="extremum_partial_norms",
    summary="the inf norm of a Partial(max) DTensor (and the -inf norm of a Partial(min)) "
    "reduces the input first instead of keeping the pending placement",
    ops=tuple(_ORDER_AT),
    gate=SpecifierSet(">=2.11"),
    overrides_existing=True,
    registrations=_registrations,
    concerns=_concerns,
    cases=CASES,
    # On 2.9 partial_norms (reducing every pending input of a norm) is the fix.
    requires=("partial_norms",),
    upstream_issue="regression of https://github.com/pytorch/pytorch/pull/165962 (2.10), measured",
    communication="one all-reduce of the pending input (the lower bound: |x| needs x)",
)
