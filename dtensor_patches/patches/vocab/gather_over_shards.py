"""``torch.gather`` of token ids along a sharded dim: gathers the whole input when more than one
id is picked, and on every release 2.9 to 2.15 its ``_MaskPartial`` result loses its mask once it
is viewed, squeezed or reduced (pytorch/pytorch#160697): wrong values or an ``IndexError``.

Trigger: token log-probs from vocab-sharded logits written as
``logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)`` or
``torch.gather(logp, -1, ids.unsqueeze(-1)).squeeze(-1)``. torch's strategy answers an index of
size 1 along the sharded dim with a ``_MaskPartial`` output whose pending sum needs the mask
saved with the index's shape; ``squeeze(-1)`` of it raises ``IndexError: too many indices for
tensor of dimension 2`` when it is reduced (measured on 2.13.0, 2 ranks). An index of any
other size gathers ``[batch, seq, vocab]``.

Fix (a miss rule on ``aten.gather.default``, taken when the gathered dim is sharded and the
index is replicated on those mesh dims): each rank picks the ids that fall in its shard (the
others read 0) and the result is ``Partial(sum)``, an ordinary pending sum that views, squeezes,
casts and reductions carry correctly; reading it is one all-reduce of the index's size, what a
hand-written vocab-parallel gather does. Every other gather keeps torch's cached path; these
calls run in Python on every call. Bool inputs keep torch's path (a sum of bools is no pick).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches.dispatch.miss_rules import DivertedCall, NativeDecision
from dtensor_patches.dispatch.shards import sharded_result
from dtensor_patches.patch import MissRule, Patch
from dtensor_patches.patches._along_shards import (
    block_lookup,
    mesh_dims_sharding,
    plain_layout,
    replicated_over,
    shard_extent,
    summed_over,
)
from dtensor_patches.patches.vocab._reproduce import moves_no_full_tensor
from dtensor_patches.strategies import is_shard

OP = "aten.gather.default"


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    args = schema.args_schema
    if len(args) < 3:
        return None
    x, dim, index = args[0], args[1], args[2]
    if not (hasattr(x, "placements") and hasattr(index, "placements") and isinstance(dim, int)):
        return None
    if not (plain_layout(x.placements) and plain_layout(index.placements)):
        return None
    if x.tensor_meta is None or x.tensor_meta.dtype == torch.bool or len(x.shape) == 0:
        return None
    dim %= len(x.shape)
    over = mesh_dims_sharding(x.placements, dim)
    if not over or len(index.shape) != len(x.shape):
        return None
    if not replicated_over(index.placements, over):
        return None
    for mesh_dim, (p, q) in enumerate(zip(x.placements, index.placements, strict=True)):
        if mesh_dim not in over and (
            p != q or (is_shard(p) and x.shape[p.dim] != index.shape[p.dim])
        ):
            # Other mesh dims must cut the input and the index alike (batch shards).
            return None
    return _gather


def _gather(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, index = args[0], args[1], args[2]
    dim %= x.ndim
    mesh = x.device_mesh
    offset, size = shard_extent(x.shape, mesh, x.placements, dim)
    ids, inside = block_lookup(local_tensor(index), offset, size)
    local = local_tensor(x)
    if size == 0:
        picked = local.new_zeros(ids.shape)
    else:
        picked = local.gather(dim, ids).masked_fill(~inside, 0)
    placements = summed_over(index.placements, mesh_dims_sharding(x.placements, dim))
    return sharded_result(picked, mesh, placements, index.shape)


def _registrations() -> list[MissRule]:
    return [MissRule(OP, _rule)]


def _ids() -> list[torch.Tensor]:
    """Token ids of a ``[2, 3]`` batch over a vocabulary of 11, replicated."""
    return [torch.tensor([[0, 5, 10], [6, 2, 7]])]


def _logprobs_lse(x: torch.Tensor, ids: torch.Tensor) -> Any:
    x = x.detach().requires_grad_()
    lp = x.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - x.logsumexp(-1)
    (grad,) = torch.autograd.grad((lp * lp.detach().sign()).sum(), [x])
    return lp.detach(), grad


def _logprobs_gather(x: torch.Tensor, ids: torch.Tensor) -> Any:
    x = x.detach().requires_grad_()
    lp = torch.gather(x.log_softmax(-1), -1, ids.unsqueeze(-1)).squeeze(-1)
    (grad,) = torch.autograd.grad(lp.sum(), [x])
    return lp.detach(), grad


def _two_ids(x: torch.Tensor, ids: torch.Tensor) -> Any:
    return x.gather(-1, torch.stack([ids, (ids + 3) % 11], -1)).sum(-1)


def reproduce(mesh: Any) -> str | None:
    """Token log-probs of ``Shard(-1)`` logits ``[2, 3, 11]`` written with ``gather`` then
    ``squeeze`` (minus ``logsumexp``, and of ``log_softmax``), values and gradients, and a
    gather of two ids per row: single-device values, no collective as large as a shard."""
    return moves_no_full_tensor(
        mesh,
        [
            ("gather(-1, ids[..., None]).squeeze(-1) - logsumexp(-1) + grad", _logprobs_lse),
            ("gather(log_softmax(-1), -1, ids[..., None]).squeeze(-1) + grad", _logprobs_gather),
            ("gather(-1, two ids per row).sum(-1)", _two_ids),
        ],
        shape=(2, 3, 11),
        extra=_ids,
    )


PATCH = Patch(
    name="gather_over_shards",
    summary="gather of ids along a sharded dim (vocab-parallel log-probs): Partial(sum) result that views keep, no gather of the input",
    ops=(OP,),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    requires=("softmax_over_shards",),
    overrides_existing=True,
    upstream_issue="https://github.com/pytorch/pytorch/issues/160697",
    communication="none; reading the `Partial(sum)` result is one all-reduce of the index's size",
)
