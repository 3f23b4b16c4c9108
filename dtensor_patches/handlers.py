"""Custom DTensor op handlers: for ops that no sharding strategy can serve.

A handler runs instead of DTensor's sharding propagation for one op (see
``compat.register_custom_handler``). Two kinds live here:

- :func:`replicated_result`: ops whose output shape depends on the data (``nonzero``,
  ``masked_select``, ``unique``, ``bincount``) fail inside shape propagation, before any
  strategy is consulted. The handler gathers the inputs, runs the op once on full tensors and
  returns ``Replicate()`` DTensors with the correct global result.
- :func:`inplace_through_full`: in-place ops whose result at one position depends on other
  positions (``index_put_`` with indices into a sharded dim, ``masked_scatter_``). The handler
  computes the full result, then writes the caller's own shard of it into the caller's local
  tensor, so the object is updated in place and keeps its placements.

Both move whole tensors; the README's patch table says which patches use them.

A third kind keeps data sharded and only fixes how a loss is reduced:
:func:`elementwise_loss` (``mse_loss``, ``huber_loss``, ``binary_cross_entropy``… and their
``*_backward``) and :func:`nll_loss` (``nll_loss_forward``/``nll_loss2d_forward`` and their
backward). A strategy cannot express ``reduction="mean"`` over uneven shards: the local
kernel divides by the local count, and ``Partial("avg")`` then weighs every rank equally.
These handlers run the local kernel with ``reduction="sum"`` and divide by the global count
(or the global total weight), so the result is a ``Partial("sum")`` of correctly scaled
shares and the elementwise work never leaves its shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from dtensor_patches import compat
from dtensor_patches.strategies import is_shard

__all__ = [
    "contiguous_stride",
    "elementwise_loss",
    "full_tensor",
    "inplace_through_full",
    "nll_loss",
    "partial_shares",
    "replicated_result",
    "shard_of",
]


def contiguous_stride(shape: Any) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape`` (size-0 dims count as 1, as ATen does).

    For ``DTensor.from_local(..., shape=, stride=)`` when a handler builds a global result.
    """
    stride, running = [], 1
    for size in reversed(tuple(shape)):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def _dtensor_class() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def _mesh_of(args: Any, kwargs: Any) -> Any:
    dtensor = _dtensor_class()
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, dtensor):
            return leaf.device_mesh
    raise TypeError("a DTensor handler was called without DTensor arguments")


def _full(value: Any) -> Any:
    if isinstance(value, _dtensor_class()):
        return value.full_tensor()
    return value


def full_tensor(value: Any) -> Any:
    """``value.full_tensor()`` for a DTensor (gathered on every rank); anything else as is."""
    return _full(value)


def _replicated(mesh: Any, value: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


def replicated_result(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Run ``op_call`` on the gathered inputs; every tensor output is a ``Replicate()`` DTensor.

    Plain tensors among the arguments are taken as already replicated (the same on every rank).
    """
    mesh = _mesh_of(args, kwargs)
    out = op_call(*tree_map(_full, args), **tree_map(_full, kwargs))
    return tree_map(lambda v: _replicated(mesh, v), out)


def partial_shares(value: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's share of ``value`` (the local tensor of the reduced value) under
    ``placements``: on every ``Partial(sum)`` mesh dim the value stays on coordinate 0 and is
    zero elsewhere, so the shares sum to it; other reductions (avg, max, min) keep the value on
    every rank. ``Shard``/``Replicate`` mesh dims are left as they are (no communication).
    """
    from torch.distributed.tensor import Partial

    coordinate = mesh.get_coordinate()
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op == "sum" and coordinate[mesh_dim] != 0:
            return torch.zeros_like(value)
    return value


def shard_of(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's local tensor of ``full`` under ``placements`` (no communication).

    ``Shard`` cuts as DTensor does (uneven last shards included); ``Partial(sum)`` puts the
    whole value on coordinate 0 of that mesh dim and zeros elsewhere, so the shares sum to it;
    other ``Partial`` reductions (avg, max, min) keep the value on every rank.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    placements = tuple(placements)
    shard_only = [Replicate() if isinstance(p, Partial) else p for p in placements]
    # Detached: on 2.9 a ``full`` that requires grad makes from_local's autograd wrapper call
    # aten.detach_ on a DTensor, which has no strategy there.
    local = (
        DTensor.from_local(full.detach(), mesh, [Replicate()] * mesh.ndim, run_check=False)
        .redistribute(mesh, shard_only)
        .to_local()
    )
    return partial_shares(local, mesh, placements)


def inplace_through_full(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Apply an in-place op to the gathered first argument, then write back this rank's shard.

    The caller's DTensor object (``args[0]``) is updated in place and keeps its placements;
    every rank sees every write, whichever shard it lands in.
    """
    target = args[0]
    full_args = tree_map(_full, args)
    op_call(*full_args, **tree_map(_full, kwargs))
    local = compat.local_tensor(target)
    with torch.no_grad():
        local.copy_(shard_of(full_args[0], target.device_mesh, target.placements))
    return target


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
            return compat.local_tensor(value)
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

    bound = compat.op_arguments(op_call, tuple(args), dict(kwargs))
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


def nll_loss(op_call: Any, args: Any, kwargs: Any) -> Any:
    """``nll_loss_forward``/``nll_loss2d_forward`` and their backward, batch dims kept sharded.

    ``self`` is ``[C]``, ``[N, C]`` or ``[N, C, d1, …]`` (log-probabilities); ``target`` has
    the same shape without the class dim ``C``; ``weight`` (per class) is replicated. Shards
    on every dim but ``C`` stay; ``C`` is gathered. ``mean`` is the weighted sum over all
    ranks divided by the global total weight (sum of the weights of the non-ignored targets),
    one scalar all-reduce; the per-rank weighted means that torch 2.9 to 2.13 average are
    wrong whenever ranks hold different total weights (uneven shards, ``ignore_index``,
    class weights). The backward takes that global total weight, so the local kernel's
    gradient is already the global one.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    bound = compat.op_arguments(op_call, tuple(args), dict(kwargs))
    x = bound["self"]
    if not isinstance(x, DTensor):
        return replicated_result(op_call, args, kwargs)
    mesh, shape = x.device_mesh, x.shape
    channel = 1 if len(shape) >= 2 else 0
    placements = [p if is_shard(p) and p.dim != channel else Replicate() for p in x.placements]
    target_placements = [
        Shard(p.dim - (1 if p.dim > channel else 0)) if is_shard(p) else p for p in placements
    ]
    replicate = [Replicate()] * mesh.ndim
    target_shape = bound["target"].shape
    local = dict(bound)
    local["self"] = _local(x, mesh, placements)
    local["target"] = _local(bound["target"], mesh, target_placements)
    local["weight"] = _local(bound["weight"], mesh, replicate)
    reduction = int(bound["reduction"])
    if "grad_output" in bound:
        grad_placements = target_placements if reduction == _NONE else replicate
        local["grad_output"] = _local(bound["grad_output"], mesh, grad_placements)
        local["total_weight"] = _local(bound["total_weight"], mesh, replicate)
        return _sharded(op_call(*local.values()), mesh, placements, shape)
    if reduction == _NONE:
        out, total = op_call(*local.values())
        return (
            _sharded(out, mesh, target_placements, target_shape),
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
