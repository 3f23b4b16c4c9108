"""An optimizer step re-propagates every in-place update whose float keyword changed (2.10, 2.11).

torch keys a sharding decision by the non-tensor arguments its ``RuntimeSchemaInfo`` declares as
deciding, and no pointwise op declares ``value=`` or ``alpha=``. From 2.10 the key is computed
in C++, and there every keyword argument goes into it, declared or not. AdamW's
``param.addcdiv_(exp_avg, denom, value=-step_size)`` changes ``step_size`` on every step (bias
correction, any LR schedule), as does SGD's ``param.add_(grad, alpha=-lr)`` under a schedule:
each such call misses both caches and runs the full propagation again, about 1 ms of CPU each
on a 2-rank CPU mesh against 8 us for a cached one (2.11.0; the tiny Qwen2 TP + SP example
spends 10 ms of its 48 ms main-thread step there: 8 ``addcdiv_`` per step). 2.12 and later
key them as declared (one propagation); measured on 2.9.1, 2.10.0, 2.11.0, 2.12.0 and 2.13.0
(:func:`reproduce`; 2.9 keys them in Python, as declared). The C++ cache also keeps one entry per value, growing every step
(the list-argument case is pytorch/pytorch#178276, fixed by #178301).

Fix: torch's propagation on a miss (``propagate_op_sharding_non_cached``, what both of its
caches call) is wrapped. A call with a ``float`` keyword argument the op does not declare as
deciding is looked up by a key without those keywords (everything else kept:
:func:`~dtensor_patches._torch.decision_keys.float_keywords_left_out`); a decision found there
serves it, else torch propagates and the decision is kept, where it holds no non-tensor value
of its call (:func:`~dtensor_patches._torch.decision_keys.serves_other_scalars`). That is what
torch's own key means on 2.9 and from 2.12. The kept decisions are dropped whenever the sharding
caches are cleared (any patch applied or reverted) and when they reach 4096.

Cost: nothing on a cached call (this runs on misses only); on a miss, one pass over the
keyword arguments, and for the calls it concerns, one dict lookup instead of a propagation.
The C++ cache still grows by one entry per value (as in stock torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.decision_keys import float_keywords_left_out, serves_other_scalars
from dtensor_patches._torch.tables import counting_strategy_calls, sharding_generation
from dtensor_patches.patch import Patch, WrappedFunction

OPS = ("aten.addcdiv_.default", "aten.add_.Tensor")  # what optimizers call with a float keyword
_LIMIT = 4096


def _reusing(original: Callable[..., Any]) -> Callable[..., Any]:
    kept: dict[Any, Any] = {}
    generation = [sharding_generation()]

    def propagate_op_sharding_non_cached(self: Any, op_schema: Any) -> Any:
        key = float_keywords_left_out(op_schema)
        if key is None or torch.compiler.is_compiling():
            return original(self, op_schema)
        now = sharding_generation()
        if now != generation[0]:
            kept.clear()
            generation[0] = now
        decision = kept.get(key)
        if decision is not None:
            return decision
        decision = original(self, op_schema)
        if serves_other_scalars(decision):
            if len(kept) >= _LIMIT:
                kept.clear()
            kept[key] = decision
        return decision

    return propagate_op_sharding_non_cached


def reproduce(mesh: Any) -> str | None:
    """``p.addcdiv_(a, b, value=v)`` on ``Shard(0)`` DTensors with ``v`` the step sizes of
    four AdamW steps: how often torch runs the op's sharding strategy after the first, and
    ``p`` against the same updates on plain tensors."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    rows = 2 * mesh.size()
    full_p, full_a = torch.randn(rows, 3, generator=g), torch.randn(rows, 3, generator=g)
    full_b = torch.rand(rows, 3, generator=g) + 1
    p, a, b = (distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in (full_p, full_a, full_b))
    values = [-1e-3 / (1 - 0.9**step) for step in range(1, 5)]
    p.addcdiv_(a, b, value=values[0])
    full_p.addcdiv_(full_a, full_b, value=values[0])
    op = torch.ops.aten.addcdiv_.default
    with counting_strategy_calls(op) as calls:
        for value in values[1:]:
            p.addcdiv_(a, b, value=value)
            full_p.addcdiv_(full_a, full_b, value=value)
    if not torch.allclose(p.full_tensor(), full_p):
        return "addcdiv_ with a new value=: values differ from the plain tensors"
    if calls:
        return (
            f"addcdiv_(..., value=v) with {len(values) - 1} new values of v ran torch's sharding "
            f"propagation {len(calls)} times (a cached decision serves every value)"
        )
    return None


PATCH = Patch(
    name="float_keywords_unkeyed",
    summary=(
        "a float keyword (an optimizer's value=, alpha=) no longer makes torch re-propagate "
        "the call's sharding"
    ),
    ops=OPS,
    gate=SpecifierSet(">=2.10,<2.12"),
    registrations=lambda: [
        WrappedFunction("propagate_op_sharding_non_cached", _reusing),
    ],
    reproduce=reproduce,
    overrides_existing=True,
    communication="none",
)
