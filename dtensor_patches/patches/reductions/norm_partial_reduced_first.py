"""The pending p-norm of a vector norm over a sharded dim is treated as a pending *sum* by the
next op, on every release 2.9 to 2.13: silently wrong values (2.14 fixed it).

Trigger (measured on 2.9.1 to 2.13.0, 2 ranks; right on 2.14.1 and 2.15.0): ``x`` sharded on its last dim (a TP-sharded
weight or activation), ``n = torch.linalg.vector_norm(x, dim=-1)`` is placed ``_NormPartial(2)``:
each rank holds the norm of its shard, and the value is ``(sum_r n_r^2)^(1/2)``. torch's
strategies for the next op keep that placement as if it were ``Partial(sum)``:
``n.sum()``, ``x.norm(dim=-1).sum()`` (a weight-norm regulariser), the per-row norms summed in
float64, give ``sqrt(sum_r (sum_i n_ri)^2)`` instead of ``sum_i sqrt(sum_r n_ri^2)`` on every
release; ``n.mean()`` and ``(n * 2).sum()`` too on 2.9 (``mean``) and 2.9/2.10 (``mul``).

Fix (a miss rule for every op, consulted only on a cache miss, that acts only when an input is
placed ``_NormPartial``): unless the op moves or copies elements without combining them (views,
casts, ``clone``, ``stack``/``cat``: the cross-rank p-norm is applied element by element, so
these commute with it) or is a norm itself (torch combines a norm of a pending norm itself),
the pending norm is reduced first (one all-reduce of the norm tensor: the communication the
op needs anyway, since no other op commutes with a p-norm), then torch's strategy runs on the
reduced value. Every other call keeps torch's cached path and pays nothing; a call that does
meet a pending norm runs in Python on every call (no cached decision), which is the cost of one
small redistribution per such call.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import is_dtensor, norm_partial_class
from dtensor_patches._torch.schemas import writes_self
from dtensor_patches.dispatch.miss_rules import ANY_OP, DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches._builders import holds_placement
from dtensor_patches.reproducers import Case, randn

# Ops that move, copy or cast elements without combining them (a p-norm applied element by
# element across ranks commutes with them), and the norms torch combines with a pending norm.
_COMMUTING_PACKETS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "unsqueeze",
        "squeeze",
        "permute",
        "transpose",
        "t",
        "expand",
        "select",
        "slice",
        "alias",
        "clone",
        "detach",
        "_to_copy",
        "stack",
        "cat",
        "split",
        "unbind",
        "copy_",
        "linalg_vector_norm",
        "norm",
        "_foreach_norm",
    }
)


def _packet(op: Any) -> str:
    name = str(op)
    return name.split(".")[1] if name.count(".") >= 2 else name


def _reduce(value: Any, norm_partial: type) -> Any:
    from torch.distributed.tensor import Replicate

    if isinstance(value, (list, tuple)):
        return type(value)(_reduce(item, norm_partial) for item in value)
    if not (is_dtensor(value) and any(isinstance(p, norm_partial) for p in value.placements)):
        return value
    wanted = [Replicate() if isinstance(p, norm_partial) else p for p in value.placements]
    # Below autograd (inside DTensor's dispatch): the reduction carries no history. The input
    # itself keeps its placement (a new DTensor is reduced), so a failed op changes nothing.
    with torch.no_grad():
        return value.redistribute(value.device_mesh, wanted)


def _run_reduced(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    norm_partial = norm_partial_class()
    args = tuple(_reduce(a, norm_partial) for a in args)
    kwargs = {k: _reduce(v, norm_partial) for k, v in kwargs.items()}
    return op_call(*args, **kwargs)


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    norm_partial = norm_partial_class()
    if not (
        holds_placement(schema.args_schema, norm_partial)
        or holds_placement(schema.kwargs_schema.values(), norm_partial)
    ):
        return None
    if _packet(schema.op) in _COMMUTING_PACKETS or writes_self(schema.op):
        # In-place writes into a pending norm are inplace_writes' (it writes shares back).
        return None
    return _run_reduced


def _registrations() -> list[MissRule]:
    norm_partial_class()  # a release that moved the class fails here, at apply time
    return [MissRule(ANY_OP, _rule)]


# x sharded on the dim its norm is taken over (Shard(1) of a [rows, features] tensor).
CASES = [
    Case(
        "vector_norm(x, dim=-1).sum()",
        lambda x: torch.linalg.vector_norm(x, dim=-1).sum(),
        lambda: [randn(4, 6)],
        ["S1"],
    ),
    Case(
        "x.norm(dim=-1).mean()",
        lambda x: x.norm(dim=-1).mean(),
        lambda: [randn(4, 6, seed=1)],
        ["S1"],
    ),
    Case(
        "(vector_norm(x, dim=-1) * 2).sum()",
        lambda x: (torch.linalg.vector_norm(x, dim=-1) * 2).sum(),
        lambda: [randn(4, 6, seed=2)],
        ["S1"],
    ),
    Case(
        "vector_norm(x, dim=-1).to(float64).sum()",
        lambda x: torch.linalg.vector_norm(x, dim=-1).to(torch.float64).sum(),
        lambda: [randn(4, 6, seed=3)],
        ["S1"],
    ),
    Case(
        "vector_norm(x, dim=-1) (stays pending: torch's)",
        lambda x: torch.linalg.vector_norm(x, dim=-1),
        lambda: [randn(4, 6, seed=4)],
        ["S1"],
    ),
]

PATCH = Patch(
    name="norm_partial_reduced_first",
    summary="a vector norm's pending _NormPartial result is reduced before an op that would "
    "combine it as a sum (sum, mean, mul, ...)",
    # The ops that make a _NormPartial; the rule itself looks at every op's inputs.
    ops=("aten.linalg_vector_norm.default",),
    # Measured: 2.14.1 and 2.15.0 combine a pending norm right in every case of the tripwire.
    gate=SpecifierSet(">=2.9,<2.14"),
    overrides_existing=True,
    registrations=_registrations,
    cases=CASES,
    communication="one all-reduce of the norm tensor, which any op that combines it needs",
)
