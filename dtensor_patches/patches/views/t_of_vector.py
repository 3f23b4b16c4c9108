"""``x.t()`` of a 1-D (or 0-D) DTensor mislabels its shard on torch 2.9 and 2.10.

Trigger: ``v.t()`` / ``v.T`` of a sharded vector (a bias, a per-token score), often inside
code written for matrices. ``t`` of a vector is the vector itself, but the strategy of torch 2.9 and
2.10 swaps dims 0 and 1 regardless, so a ``Shard(0)`` vector comes back placed ``Shard(1)``: a dim it
does not have. The next op that gathers it fails (``_to_replicate_tensor``: ``IndexError: list
index out of range``), or an op that reads placements computes from the wrong dim. Measured
on 2.9.1 and 2.10.0 (``t`` rows of the 2.9.1 op sweep); from 2.11 the placement is kept.

Fix: a miss rule on ``aten.t.default``: an input with fewer than 2 dims comes back as the
same DTensor view with its own placements (no communication). Matrices keep torch's path.
"""

from __future__ import annotations

from typing import Any

from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor, make_dtensor, spec_of
from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.reproducers import Case, randn

OP = "aten.t.default"


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    x = schema.args_schema[0] if schema.args_schema else None
    if x is None or not hasattr(x, "placements") or len(x.shape) >= 2:
        return None
    return _same_placements


def _same_placements(op_call: Any, args: Any, kwargs: Any) -> Any:
    x = args[0]
    return make_dtensor(op_call(local_tensor(x)), spec_of(x))


def _registrations() -> list[MissRule]:
    return [MissRule(OP, _rule)]


# The tripwire's cases: ``t`` of a sharded vector, then an op that gathers it, vs single-device.
CASES = [
    Case("v.t() * 2 of a Shard(0) vector", lambda v: v.t() * 2, lambda: [randn(6)], ["S0"]),
    Case("v.T + v of a Shard(0) vector", lambda v: v.T + v, lambda: [randn(5)], ["S0"]),
]


PATCH = Patch(
    name="t_of_vector",
    summary="x.t() of a sharded vector keeps its placement (2.9/2.10 label it Shard(1))",
    ops=(OP,),
    gate=SpecifierSet(">=2.9,<2.11"),
    registrations=_registrations,
    cases=CASES,
    overrides_existing=True,
    communication="none",
)
