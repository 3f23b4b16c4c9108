"""The backward of ``layer_norm`` is wrong or raises on torch 2.9 to 2.11 when its weight and
bias are sharded on a normalized dim, or when its inputs are pending (``Partial``).

Trigger (measured on 2.9.1, 2.10.0 and 2.11.0; 2.12 and later right): ``F.layer_norm(x,
x.shape[-k:], w, b)`` with ``w`` and ``b`` DTensors placed ``Shard(0)`` (an affine layer norm
whose parameters are sharded like the features, without FSDP gathering them first), then
``.backward()``: the forward is right (torch gathers the weight), but torch's strategy for
``native_layer_norm_backward`` passes the weight's local shard to the kernel, which checks it
against the whole normalized shape: ``RuntimeError: Expected weight to be of same shape as
normalized_shape, but got weight of shape [2, 2, 3] and normalized_shape = [3, 2, 3]``. Where
the normalized dim is shorter than the mesh, the rank whose shard is full-sized passes and
the others raise: one rank waits for ever (what the strategy validator's ``layer_norm`` and
``native_layer_norm`` ranks "crashed" on). With the input, weight and bias pending as
``Partial(sum)`` (a layer norm applied to a row-parallel output before its reduction) the
backward kept the shares and the input gradient was silently wrong (found by the validator
once its ranks no longer crashed).

Fix (a miss rule for ``native_layer_norm_backward``, consulted only on a cache miss): a call
whose ``weight`` or ``bias`` is sharded, or with any pending input, runs with those made
``Replicate()`` first (an all-gather of the normalized shape, an all-reduce of a pending
input: what the kernel needs whole), then torch's strategy; every other call keeps torch's
cached decision.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import Call
from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.reproducers import Case, randn

# native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask)
_AFFINE = (5, 6)


def _needs_whole(index: int, placements: Any) -> bool:
    """Whether argument ``index`` placed ``placements`` must be made ``Replicate()``: a pending
    input anywhere, a shard of the weight or bias."""
    return any(p.is_partial() or (index in _AFFINE and p.is_shard()) for p in placements)


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    for index, arg in enumerate(schema.args_schema):
        placements = getattr(arg, "placements", None)
        if placements and _needs_whole(index, placements):
            return _made_whole
    return None


def _made_whole(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    args = list(args)
    # Below autograd (inside DTensor's dispatch): the collectives carry no history, and the
    # inputs themselves keep their placement (new DTensors are made).
    for index, value in enumerate(args):
        if isinstance(value, DTensor) and _needs_whole(index, value.placements):
            wanted = [
                p if p.is_replicate() or not _needs_whole(index, [p]) else Replicate()
                for p in value.placements
            ]
            args[index] = value.detach().redistribute(value.device_mesh, wanted)
    return op_call(*args, **kwargs)


def _concerns(call: Call) -> bool | None:
    """A sharded weight or bias (the 5th and 6th tensor arguments), or a pending input, is the
    case."""
    return any("S(" in i for i in call.inputs[4:6]) or call.partial_inputs


def _registrations() -> list[MissRule]:
    return [MissRule("aten.native_layer_norm_backward.default", _rule)]


def _layer_norm_grads(x: Any, w: Any, b: Any) -> tuple[Any, ...]:
    """Gradients of ``layer_norm(x, x.shape[1:], w, b)`` (fresh leaves: DTensors and plain
    tensors alike)."""
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
    out = torch.nn.functional.layer_norm(leaves[0], tuple(x.shape[1:]), leaves[1], leaves[2])
    return torch.autograd.grad((out * out).sum(), leaves)


# The tripwire's cases: affine parameters sharded like the normalized features.
CASES = [
    Case(
        "layer_norm grads, weight and bias Shard(0) of [3, 4]",
        _layer_norm_grads,
        lambda: [randn(2, 3, 4), randn(3, 4, seed=1), randn(3, 4, seed=2)],
        ["R", "S0", "S0"],
    ),
    Case(
        "layer_norm grads, x, weight and bias pending",
        _layer_norm_grads,
        lambda: [randn(2, 3, 4), randn(3, 4, seed=1), randn(3, 4, seed=2)],
        ["P", "P", "P"],
    ),
    Case(
        "layer_norm grads, weight Shard(1) of [3, 4], x Shard(0)",
        _layer_norm_grads,
        lambda: [randn(4, 3, 4), randn(3, 4, seed=1), randn(3, 4, seed=2)],
        ["S0", "S1", "R"],
    ),
]


PATCH = Patch(
    name="layer_norm_backward_layouts",
    summary="layer_norm's backward gathers a weight/bias sharded on a normalized dim and reduces "
    "pending inputs instead of raising, hanging on an empty shard, or keeping shares (2.9-2.11)",
    ops=("aten.native_layer_norm_backward.default",),
    gate=SpecifierSet(">=2.9,<2.12"),
    overrides_existing=True,
    registrations=_registrations,
    concerns=_concerns,
    cases=CASES,
    communication="an all-gather of a sharded weight and bias (the normalized shape), an "
    "all-reduce of a pending input",
    replicates=True,
)
