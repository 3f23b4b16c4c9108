"""``softmax`` / ``log_softmax`` / ``logsumexp`` along a sharded dim gather the whole tensor,
forward and backward, on every release 2.9 to 2.15: with TP vocab-sharded logits that is an all-gather of
``[batch, seq, vocab]`` per call (issue 20).

Trigger: ``logits.log_softmax(-1)`` (token log-probs, entropy, KL to a reference policy),
``(logits / T).softmax(-1)`` and ``F.cross_entropy`` of ``Shard(-1)`` logits outside
``loss_parallel()``. torch's strategies for ``_softmax``/``_log_softmax`` and their backward
replicate the softmax dim, so the values are right but every rank holds and receives the
full logits: at a vocabulary of 150k and 32k tokens about 20 GB per rank and step. Measured on
2 ranks, 2.9.1 to 2.15.0.

Fix (miss rules on the five ops, taken only when the softmax dim is sharded and nothing is
pending): each rank computes on its shard with the two ``[..., 1]`` reductions a hand-written
vocab-parallel softmax needs, the max (``MAX`` all-reduce) and the sum of exponentials
(``SUM`` all-reduce), in float32 for half inputs as ATen accumulates; the output keeps the
input's placements (``logsumexp``: replicated on the reduced dims; its backward is pointwise).
The backward ops reduce one ``[..., 1]`` sum (``sum(g)`` for log-softmax,
``sum(g * y)`` for softmax); a gradient arriving replicated is cut locally, one arriving
``Partial`` is reduce-scattered to the output's placements (what any layout must pay for it).
Inside ``loss_parallel()`` torch's own handlers keep ``_log_softmax`` (see
``loss_parallel_backward``).
Cost: these calls run in Python on every call (a handful of local ops and two collectives of
``[..., 1]``); every other softmax keeps torch's cached path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.dispatch.shards import sharded_result
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches._along_shards import (
    LOW_PRECISION,
    all_reduce_over,
    mesh_dims_sharding,
    plain_layout,
    sharded_along,
    softmax_backward_on_shards,
    softmax_on_shards,
)
from dtensor_patches.patches.vocab._reproduce import moves_no_full_tensor
from dtensor_patches.strategies import is_shard

_FORWARD = ("aten._softmax.default", "aten._log_softmax.default")
_BACKWARD = ("aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default")
_LOGSUMEXP = "aten.logsumexp.default"
OPS = (*_FORWARD, *_BACKWARD, _LOGSUMEXP)


def _reduced_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return tuple(sorted({d % ndim for d in dims})) if dims else tuple(range(ndim))


def _logsumexp(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    x = args[0]
    dims = _reduced_dims(args[1] if len(args) > 1 else kwargs["dim"], x.ndim)
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    mesh = x.device_mesh
    over = tuple(i for d in dims for i in mesh_dims_sharding(x.placements, d))
    local = local_tensor(x)
    acc = local.float() if local.dtype in LOW_PRECISION else local
    if acc.numel() == 0:
        shape = [1 if d in dims else n for d, n in enumerate(acc.shape)]
        peak = acc.new_full(shape, float("-inf"))
    else:
        peak = acc.amax(dims, keepdim=True)
    all_reduce_over(peak, mesh, over, dist.ReduceOp.MAX)
    # As ATen: an infinite max is not subtracted (exp(inf - inf) would be NaN).
    peak = torch.where(peak.isinf(), torch.zeros_like(peak), peak)
    total = all_reduce_over(
        (acc - peak).exp().sum(dims, keepdim=True), mesh, over, dist.ReduceOp.SUM
    )
    out = total.log() + peak
    if not keepdim:
        out = out.squeeze(dims) if dims else out
    placements = []
    for p in x.placements:
        if (is_shard(p) and p.dim in dims) or not is_shard(p):
            placements.append(Replicate())
        else:
            placements.append(
                Shard(p.dim if keepdim else p.dim - sum(1 for d in dims if d < p.dim))
            )
    shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
    if not keepdim:
        shape = [n for d, n in enumerate(x.shape) if d not in dims]
    size = torch.Size(shape)
    return sharded_result(out.to(local.dtype), mesh, placements, size)


def _logsumexp_rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    args = schema.args_schema
    x = args[0] if args else None
    placements = getattr(x, "placements", None)
    if placements is None or not plain_layout(placements) or len(x.shape) == 0:
        return None
    dims = args[1] if len(args) > 1 else schema.kwargs_schema.get("dim", ())
    reduced = _reduced_dims(dims, len(x.shape))
    return _logsumexp if any(mesh_dims_sharding(placements, d) for d in reduced) else None


def _forward_rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    args = schema.args_schema
    return softmax_on_shards if len(args) >= 3 and sharded_along(args[0], args[1]) else None


def _backward_rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    args = schema.args_schema
    if len(args) < 4 or not hasattr(args[0], "placements"):
        return None
    return softmax_backward_on_shards if sharded_along(args[1], args[2]) else None


def _registrations() -> list[MissRule]:
    return [
        *(MissRule(op, _forward_rule) for op in _FORWARD),
        *(MissRule(op, _backward_rule) for op in _BACKWARD),
        MissRule(_LOGSUMEXP, _logsumexp_rule),
    ]


def _log_softmax_and_grad(x: torch.Tensor, w: torch.Tensor) -> Any:
    x = x.detach().requires_grad_()
    y = x.log_softmax(-1)
    (grad,) = torch.autograd.grad((y * w).sum(), [x])
    return y.detach(), grad


def _softmax_and_grad(x: torch.Tensor, w: torch.Tensor) -> Any:
    x = x.detach().requires_grad_()
    y = F.softmax(x / 0.7, -1)
    (grad,) = torch.autograd.grad((y * w).sum(), [x])
    return y.detach(), grad


def _logsumexp_and_grad(x: torch.Tensor, w: torch.Tensor) -> Any:
    x = x.detach().requires_grad_()
    y = x.logsumexp(-1)
    (grad,) = torch.autograd.grad((y * y.detach()).sum(), [x])
    return y.detach(), grad


def _weights() -> list[torch.Tensor]:
    """A replicated ``[11]`` weighting of the classes, so that the gradient is not zero."""
    return [torch.linspace(-1.0, 1.0, 11)]


def reproduce(mesh: Any) -> str | None:
    """``log_softmax`` and ``softmax / T`` of ``Shard(-1)`` logits, forward and backward
    (uneven vocab): single-device values and gradients, and no all-gather of the logits."""
    return moves_no_full_tensor(
        mesh,
        [
            ("log_softmax(-1) + grad of Shard(-1) [2, 3, 11]", _log_softmax_and_grad),
            ("softmax(x / 0.7, -1) + grad of Shard(-1) [2, 3, 11]", _softmax_and_grad),
            ("logsumexp(-1) + grad of Shard(-1) [2, 3, 11]", _logsumexp_and_grad),
        ],
        shape=(2, 3, 11),
        extra=_weights,
    )


PATCH = Patch(
    name="softmax_over_shards",
    summary="softmax/log_softmax/logsumexp along a sharded dim (vocab-parallel logits) without gathering it, forward and backward",
    ops=OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
    upstream_fix="none in any release up to 2.15.0 (measured: the softmax dim is replicated)",
    communication="two all-reduces of `[..., 1]` forward (max, sum of exponentials), one backward",
)
