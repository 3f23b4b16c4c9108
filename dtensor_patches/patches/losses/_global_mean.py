"""Losses reduced with a global count: the custom handlers of the ``elementwise_losses`` and
``nll_loss`` patches.

A strategy cannot express ``reduction="mean"`` over uneven shards: the local kernel divides by
the local count, and ``Partial("avg")`` then weighs every rank equally. These handlers run the
local kernel with ``reduction="sum"`` and divide by the global count (or the global total
weight), so the result is a ``Partial("sum")`` of correctly scaled shares and the elementwise
work never leaves its shard.
"""

from __future__ import annotations

from typing import Any

import torch

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches._torch.schemas import op_arguments
from dtensor_patches.dispatch.gather import replicated_result
from dtensor_patches.dispatch.shards import shard_of
from dtensor_patches.patches._along_shards import block_lookup, shard_extent
from dtensor_patches.strategies import is_shard

__all__ = ["class_sharded", "elementwise_loss", "nll_loss"]


# ATen's loss reductions (at::Reduction): the ``reduction`` argument of every loss op.
_NONE, _MEAN, _SUM = 0, 1, 2


def _local(value: Any, mesh: Any, placements: Any) -> Any:
    """This rank's local tensor of ``value`` redistributed to ``placements``.

    A plain tensor counts as replicated (the same on every rank), as in
    :func:`replicated_result`; non-tensors pass through.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if tuple(value.placements) == tuple(placements):
            return local_tensor(value)
        # Detached and without grad: this runs below autograd, inside DTensor's dispatch, and
        # recording redistribute's own autograd node there fails on torch 2.9 (detach_).
        with torch.no_grad():
            return value.detach().redistribute(mesh, tuple(placements)).to_local()
    if isinstance(value, torch.Tensor):
        return shard_of(value, mesh, placements)
    return value


def _aligned(placements: Any, shape: torch.Size, other: torch.Size) -> list[Any]:
    """Placements of a tensor of shape ``other`` broadcast against ``shape`` sharded as
    ``placements``: sharded on the dim aligned from the right, replicated where it broadcasts
    (size 1 along a longer dim, or missing)."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in placements:
        dim = p.dim - (len(shape) - len(other)) if is_shard(p) else -1
        # Same size as the sharded dim: cut alike (also when both are 1); else it broadcasts.
        same = dim >= 0 and int(other[dim]) == int(shape[p.dim])
        out.append(Shard(dim) if same else Replicate())
    return out


def _sharded(local: torch.Tensor, mesh: Any, placements: Any, shape: torch.Size) -> Any:
    """``local`` as this rank's shard of a contiguous tensor of global ``shape``."""
    from torch.distributed.tensor import DTensor

    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(int(size), 1)
    return DTensor.from_local(
        local,
        mesh,
        tuple(placements),
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(reversed(stride)),
    )


def _partial_sum(local: torch.Tensor, mesh: Any, placements: Any) -> Any:
    """``local`` as one rank's share of a sum over the mesh dims that ``placements`` shard."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    out = [Partial("sum") if is_shard(p) else Replicate() for p in placements]
    return DTensor.from_local(local, mesh, out, run_check=False)


def elementwise_loss(op_call: Any, args: Any, kwargs: Any) -> Any:
    """An elementwise loss op or its ``*_backward``, with every ``reduction``, on shards.

    For ops whose ``self`` is the input, whose other tensors (``target``, ``weight``,
    ``pos_weight``) broadcast against it, and whose ``mean`` is the sum over all elements
    divided by their count (``mse_loss``, ``smooth_l1_loss``, ``huber_loss``,
    ``soft_margin_loss``, ``binary_cross_entropy``, ``binary_cross_entropy_with_logits``);
    backward ops are recognised by their ``grad_output`` argument.

    ``self`` keeps its ``Shard(d)`` placements (anything else is replicated first); the other
    tensors follow on the aligned dims. ``none``: the output is sharded like ``self``, no
    communication; ``sum``: ``Partial("sum")`` of the local sums; ``mean``: the local sums
    divided by the global element count, ``Partial("sum")``. The backward of ``mean`` scales
    the replicated scalar gradient by the same count, instead of the local kernel's local
    count. Arguments that do not broadcast to ``self``'s shape (a target larger than the input)
    are computed on full tensors (:func:`replicated_result`).
    """
    from torch.distributed.tensor import DTensor, Replicate

    bound = op_arguments(op_call, tuple(args), dict(kwargs))
    x = bound["self"]
    others = [
        name
        for name, value in bound.items()
        if isinstance(value, torch.Tensor) and name not in ("self", "grad_output")
    ]
    if not isinstance(x, DTensor) or any(
        torch.broadcast_shapes(x.shape, bound[name].shape) != x.shape for name in others
    ):
        return replicated_result(op_call, args, kwargs)
    mesh, shape = x.device_mesh, x.shape
    placements = [p if is_shard(p) else Replicate() for p in x.placements]
    local = dict(bound)
    local["self"] = _local(x, mesh, placements)
    for name in others:
        local[name] = _local(bound[name], mesh, _aligned(placements, shape, bound[name].shape))
    reduction = int(bound["reduction"])
    if "grad_output" in bound:
        grad = bound["grad_output"]
        if reduction == _NONE:
            local["grad_output"] = _local(grad, mesh, _aligned(placements, shape, grad.shape))
        else:
            local["grad_output"] = _local(grad, mesh, [Replicate()] * mesh.ndim)
        if reduction == _MEAN:
            # d(sum / n) = d(sum) / n with the global n; the kernel would use the local one.
            local["grad_output"] = local["grad_output"] / shape.numel()
            local["reduction"] = _SUM
        return _sharded(op_call(*local.values()), mesh, placements, shape)
    if reduction == _NONE:
        return _sharded(op_call(*local.values()), mesh, placements, shape)
    local["reduction"] = _SUM
    out = op_call(*local.values())
    if reduction == _MEAN:
        out = out / shape.numel()
    return _partial_sum(out, mesh, placements)


def _class_shard_targets(
    target: torch.Tensor, ignore_index: int, offset: int, size: int
) -> torch.Tensor:
    """Targets of this rank's class block: ``target - offset`` where it falls in the block,
    else -1, which the local kernel is then told to ignore (the caller's ``ignore_index``
    included: shifted, it could name a class of this block)."""
    local, inside = block_lookup(target, offset, size)
    return torch.where(inside & (target != ignore_index), local, torch.full_like(local, -1))


def nll_loss(op_call: Any, args: Any, kwargs: Any) -> Any:
    """``nll_loss_forward``/``nll_loss2d_forward`` and their backward, on shards.

    ``self`` is ``[C]``, ``[N, C]`` or ``[N, C, d1, …]`` (log-probabilities); ``target`` has
    the same shape without the class dim ``C``; ``weight`` (per class) is replicated. Shards
    on every dim stay. A shard of ``C`` (vocab-parallel log-probs) picks the targets that fall
    in its class block and the results are summed over those mesh dims (``Partial(sum)``, also
    for ``reduction="none"``): no gather of ``[N, C]``. ``mean`` is the weighted sum over all
    ranks divided by the global total weight (sum of the weights of the non-ignored targets),
    one scalar all-reduce; the per-rank weighted means that torch 2.9 to 2.13 average are
    wrong whenever ranks hold different total weights (uneven shards, ``ignore_index``,
    class weights). The backward takes that global total weight, so the local kernel's
    gradient is already the global one, and is sharded like ``self``.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    bound = op_arguments(op_call, tuple(args), dict(kwargs))
    x = bound["self"]
    if not isinstance(x, DTensor):
        return replicated_result(op_call, args, kwargs)
    mesh, shape = x.device_mesh, x.shape
    channel = 1 if len(shape) >= 2 else 0
    placements = [p if is_shard(p) else Replicate() for p in x.placements]
    over_classes = [i for i, p in enumerate(placements) if is_shard(p) and p.dim == channel]
    target_placements = [
        Shard(p.dim - (1 if p.dim > channel else 0))
        if is_shard(p) and p.dim != channel
        else Replicate()
        for p in placements
    ]
    replicate = [Replicate()] * mesh.ndim
    target_shape = bound["target"].shape
    local = dict(bound)
    local["self"] = _local(x, mesh, placements)
    local["target"] = _local(bound["target"], mesh, target_placements)
    class_placements = [Shard(0) if i in over_classes else Replicate() for i in range(mesh.ndim)]
    local["weight"] = _local(bound["weight"], mesh, class_placements)
    if over_classes:
        offset, size = shard_extent(shape, mesh, placements, channel)
        local["target"] = _class_shard_targets(
            local["target"], int(bound["ignore_index"]), offset, size
        )
        local["ignore_index"] = -1
    reduction = int(bound["reduction"])
    if "grad_output" in bound:
        grad_placements = target_placements if reduction == _NONE else replicate
        local["grad_output"] = _local(bound["grad_output"], mesh, grad_placements)
        local["total_weight"] = _local(bound["total_weight"], mesh, replicate)
        return _sharded(op_call(*local.values()), mesh, placements, shape)
    if reduction == _NONE:
        out, total = op_call(*local.values())
        summed = [
            Partial("sum") if i in over_classes else p for i, p in enumerate(target_placements)
        ]
        return (
            _sharded(out, mesh, summed, target_shape),
            DTensor.from_local(total, mesh, replicate, run_check=False),
        )
    local["reduction"] = _SUM
    out, total = op_call(*local.values())
    if reduction == _SUM:
        return _partial_sum(out, mesh, placements), _partial_sum(total, mesh, placements)
    # The global total weight: one scalar all-reduce (none when nothing is sharded).
    with torch.no_grad():
        total = _partial_sum(total, mesh, placements).full_tensor()
    return (
        _partial_sum(out / total, mesh, placements),
        DTensor.from_local(total, mesh, replicate, run_check=False),
    )


def class_sharded(op_schema: Any, *, backward: bool) -> bool:
    """Whether an ``nll_loss`` call's ``self`` (argument 1 of the backward ops, 0 of the
    forward ones) is sharded on its class dim, with plain ``Shard`` and ``Replicate``
    placements only."""
    position = 1 if backward else 0
    args = op_schema.args_schema
    x = args[position] if len(args) > position else None
    placements = getattr(x, "placements", None)
    if placements is None or not all(is_shard(p) or p.is_replicate() for p in placements):
        return False
    channel = 1 if len(x.shape) >= 2 else 0
    return any(is_shard(p) and p.dim == channel for p in placements)
