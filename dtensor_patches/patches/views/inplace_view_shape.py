"""In-place view ops (``squeeze_``, ``unsqueeze_``, ``transpose_``, ``t_``, …) on a DTensor
whose placements they do not change leave its shape stale.

Trigger: ``v @ M`` with a 1-D ``v`` (ATen's ``matmul`` computes ``v.unsqueeze(0).mm(M)`` and then
``squeeze_(0)``) whenever the product is ``Partial`` or ``Replicate()`` (``v`` and ``M`` sharded
on the contracted dim: a value head's ``h[-1] @ W``); any ``x.unsqueeze_(0)``/``x.squeeze_()``/
``x.t_()`` on a replicated or ``Partial`` ``x``. DTensor's in-place path keeps the target's
spec when the output placements equal the input's: the local tensor is squeezed, the DTensor
still reports the old shape (``v @ M`` reports ``(1, 5)``, the single-device result is
``(5,)``), and later ops see a tensor that is not what it says. Measured on 2.9.1 and 2.13.0
(``matmul``/``__rmatmul__`` rows of the op sweep); a placement change (``Shard(1)`` to
``Shard(0)``) takes torch's other branch and is right.

Torch 2.13 also has no strategy for ``unsqueeze_`` at all (and 2.9 none for ``transpose_``:
``stft`` of a DTensor).

Fix: a miss rule on these ops: where torch's decision keeps the target's placements without
redistributing it, or torch has no decision, the out-of-place twin (``squeeze``, ``unsqueeze``,
``transpose``, ``t``) computes the view with torch's own propagation, the op runs on the local
tensor, and the target gets the view's spec and matching outer size and strides. A view that
would need a redistribution (squeezing a sharded dim) raises a clear error: an in-place view
cannot move data. ``squeeze_`` drops only the dims whose *global* size is 1 from the local tensor
too: a sharded dim with one element per rank is size 1 locally but not globally, and a local
``squeeze_()`` without a dim dropped it (``[2, 1, 3]`` ``Shard(0)`` on 2 ranks ended with local
``(3,)`` for a spec implying ``(1, 3)``; with uneven shards the next gather aborted gloo or hung;
issue 23, item 10). Calls that change placements keep torch's path. Cost: calls of these ops that keep placements are not cached (a sharding
propagation per call); they are rare outside decompositions, and no common op is touched.
All-or-nothing: the local tensor changes only if the op succeeds on it, and the spec is
replaced after that.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor, shares_storage, spec_of
from dtensor_patches._torch.modes import finish_inplace_view
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import normalize_dims

# The ops with ``Tag.inplace_view`` whose first argument is the DTensor they change, and the
# out-of-place view op that computes the same view.
TWINS = {
    "aten.squeeze_.default": "aten.squeeze.default",
    "aten.squeeze_.dim": "aten.squeeze.dim",
    "aten.squeeze_.dims": "aten.squeeze.dims",
    "aten.unsqueeze_.default": "aten.unsqueeze.default",
    "aten.transpose_.default": "aten.transpose.int",
    "aten.t_.default": "aten.t.default",
}
OPS = tuple(TWINS)


def _existing() -> tuple[str, ...]:
    names = []
    for name in OPS:
        try:
            op = resolve_op(name)
            resolve_op(TWINS[name])
        except Exception:  # noqa: BLE001 - an overload this release lacks is simply not ruled
            continue
        if torch.Tag.inplace_view in op.tags:
            names.append(name)
    return tuple(names)


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    target = schema.args_schema[0] if schema.args_schema else None
    if target is None or not hasattr(target, "placements"):
        return None
    sharding = native.sharding()
    if sharding is not None:
        spec = sharding.output_spec
        if not hasattr(spec, "placements") or _moves_target(sharding, target):
            return None
        if tuple(spec.placements) != tuple(target.placements):
            return None  # torch's branch for a placement change sets the spec itself
    elif native.error() is None:
        return None  # torch produced the output itself
    return _in_place_view


def _moves_target(sharding: Any, target: Any) -> bool:
    """torch's decision redistributes the target itself (its redistribute schema places the
    first argument elsewhere); a redistribute schema that keeps it where it is does not."""
    if not getattr(sharding, "needs_redistribute", False):
        return False
    schema = getattr(sharding, "redistribute_schema", None)
    wanted = schema.args_schema[0] if schema is not None and schema.args_schema else None
    return wanted is None or tuple(getattr(wanted, "placements", ())) != tuple(target.placements)


def _in_place_view(op_call: Any, args: Any, kwargs: Any) -> Any:
    """The view the out-of-place twin makes (torch's propagation, shape and spec), applied to
    the target: its local tensor changed by the op, then its spec and outer metadata."""
    x = args[0]
    twin = resolve_op(TWINS[str(op_call)])
    view = twin(x, *args[1:], **kwargs)
    local = local_tensor(x)
    view_local = local_tensor(view)
    if not shares_storage(view_local, local):
        raise RuntimeError(
            f"{op_call} on a DTensor placed {tuple(x.placements)}: this view needs a "
            f"redistribution ({tuple(x.placements)} -> {tuple(view.placements)}), and an "
            "in-place view cannot change where the data lives; use the out-of-place "
            f"{TWINS[str(op_call)]} (x = x.{str(twin).split('.')[1]}(...))"
        )
    _apply_to_local(op_call, x, local, args, kwargs)
    return finish_inplace_view(op_call, tuple(args), dict(kwargs), x, spec_of(view))


def _apply_to_local(
    op_call: Any, x: Any, local: torch.Tensor, args: Any, kwargs: dict[str, Any]
) -> None:
    """Run the in-place view op on ``x``'s local tensor, as the global view changes it.

    ``squeeze_`` (every overload) squeezes the local tensor along exactly the dims of global
    size 1 that the call names (all of them for no dim): a dim sharded with one element per
    rank is size 1 only locally and stays. The other ops act on the same dims locally.
    """
    if not str(op_call).startswith("aten.squeeze_."):
        op_call(local, *args[1:], **kwargs)
        return
    ndim = x.ndim
    given = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("dims"))
    if isinstance(given, (tuple, list)) and not given:
        return  # squeeze_(()) squeezes nothing
    requested = range(ndim) if given is None else normalize_dims(given, ndim)
    drop = tuple(d for d in requested if ndim > 0 and x.shape[d] == 1)
    if drop:
        local.squeeze_(drop)


def _registrations() -> list[MissRule]:
    return [MissRule(name, _rule) for name in _existing()]


def _vector_matrix(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return v @ m


def _unsqueeze_then_sum(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y.unsqueeze_(0)
    return y.sum(-1)


def _squeeze_partial(x: torch.Tensor) -> torch.Tensor:
    y = x.sum(0, keepdim=True)  # Partial(sum) of a Shard(0) x
    y.squeeze_(0)
    return y * 2


# The tripwire's cases: In-place view ops that keep placements: shape and values vs single-device.
CASES = [
    Case(
        "v @ M, v and M Shard(0) (Partial product)",
        _vector_matrix,
        lambda: [randn(4), randn(4, 5)],
        ["S0", "S0"],
    ),
    Case("x.unsqueeze_(0) of a Replicate x", _unsqueeze_then_sum, lambda: [randn(3, 4)], ["R"]),
    Case("y.squeeze_(0) of a Partial y", _squeeze_partial, lambda: [randn(4, 3)], ["S0"]),
]


PATCH = Patch(
    name="inplace_view_shape",
    summary="squeeze_/unsqueeze_/transpose_/t_ that keep placements update the DTensor's shape",
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    # torch has strategies for these ops; the rule acts on what they decide.
    overrides_existing=True,
    communication="none",
)
