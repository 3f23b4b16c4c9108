"""``torch.topk`` along a sharded dim gathers the whole input on every release 2.9 to 2.15.

Trigger: ``logits.topk(k, -1)`` of TP vocab-sharded logits (top-k sampling masks, the top-k
tokens logged beside log-probs): torch's strategy replicates the top-k dim, an all-gather of
``[batch, seq, vocab]`` for a ``[batch, seq, k]`` result (measured on 2 ranks, 2.9.1 to
2.15.0).

Fix (a miss rule on ``aten.topk.default``, taken when the top-k dim is sharded and nothing is
pending): each rank takes its own top ``k`` (with global indices), the candidates of each
sharding mesh dim are all-gathered (``k`` values and indices per rank) and the top ``k`` of
them kept; values and indices come back replicated on those mesh dims, other shards kept.
Ties go to the lower index, as a sorted single-device ``topk`` gives them; ``sorted=False``
returns them sorted (allowed: the order is then unspecified). NaN counts as the largest
value, as in ``torch.sort``. The backward (a scatter into zeros) needs no patch from 2.10; on
2.9 it raises with and without this patch (``value_selecting_reduction_backward`` builds plain
zeros beside the DTensor gradient: ``MixedTensorError``; docs/known-gaps.md).
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
    all_gather_along,
    mesh_dims_sharding,
    plain_layout,
    shard_extent,
)
from dtensor_patches.patches.vocab._reproduce import moves_no_full_tensor

OP = "aten.topk.default"


def _options(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, bool]:
    k = int(args[1] if len(args) > 1 else kwargs["k"])
    dim = int(args[2] if len(args) > 2 else kwargs.get("dim", -1))
    largest = bool(args[3] if len(args) > 3 else kwargs.get("largest", True))
    return k, dim, largest


def _rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
    args = schema.args_schema
    x = args[0] if args else None
    placements = getattr(x, "placements", None)
    if placements is None or not plain_layout(placements) or len(x.shape) == 0:
        return None
    k, dim, _ = _options(tuple(args), dict(schema.kwargs_schema))
    dim %= len(x.shape)
    if not mesh_dims_sharding(placements, dim) or not 0 < k <= x.shape[dim]:
        return None  # torch's own path (and its error for an invalid k)
    return _topk


def _best(
    values: torch.Tensor, indices: torch.Tensor, k: int, dim: int, largest: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of candidate ``values`` along ``dim`` with their ``indices``; ties to the
    lower index (a stable sort of the candidates in index order)."""
    order = torch.sort(indices, dim=dim, stable=True).indices
    values, indices = values.gather(dim, order), indices.gather(dim, order)
    rank = torch.sort(values, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return values.gather(dim, rank), indices.gather(dim, rank)


def _topk(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from torch.distributed.tensor import Replicate

    x = args[0]
    k, dim, largest = _options(args, kwargs)
    dim %= x.ndim
    mesh = x.device_mesh
    offset, size = shard_extent(x.shape, mesh, x.placements, dim)
    local = local_tensor(x)
    take = min(k, size)
    values, indices = torch.topk(local, take, dim, largest, True)
    indices = indices + offset
    if take < k:
        # Pad to k candidates per rank (all-gathers need equal shapes) with entries that sort
        # last: the worst value, an index past every real one.
        shape = list(values.shape)
        shape[dim] = k - take
        worst = float("-inf") if largest else float("inf")
        if not values.is_floating_point():
            info = torch.iinfo(values.dtype)
            worst = info.min if largest else info.max
        values = torch.cat([values, values.new_full(shape, worst)], dim)
        indices = torch.cat([indices, indices.new_full(shape, x.shape[dim])], dim)
    over = mesh_dims_sharding(x.placements, dim)
    for mesh_dim in over:
        values = all_gather_along(values, mesh, mesh_dim, dim)
        indices = all_gather_along(indices, mesh, mesh_dim, dim)
        values, indices = _best(values, indices, k, dim, largest)
    placements = [Replicate() if i in over else p for i, p in enumerate(x.placements)]
    shape = list(x.shape)
    shape[dim] = k
    return tuple(sharded_result(t, mesh, placements, shape) for t in (values, indices))


def _registrations() -> list[MissRule]:
    return [MissRule(OP, _rule)]


def _top3(x: torch.Tensor) -> Any:
    return x.topk(3, -1)


def _bottom2(x: torch.Tensor) -> Any:
    return x.topk(2, -1, largest=False)


def reproduce(mesh: Any) -> str | None:
    """``topk(3, -1)`` (values, indices; its gradient is tested with ``apply_all()``: torch 2.9's
    backward builds plain zeros beside DTensors, with and without this patch) and ``topk(2, largest=False)`` of
    ``Shard(-1)`` logits ``[2, 3, 65]``: single-device results, no collective as large as a
    shard."""
    return moves_no_full_tensor(
        mesh,
        [
            ("topk(3, -1) of Shard(-1) [2, 3, 65]", _top3),
            ("topk(2, -1, largest=False) of Shard(-1) [2, 3, 65]", _bottom2),
        ],
        shape=(2, 3, 65),
    )


PATCH = Patch(
    name="topk_over_shards",
    summary="topk along a sharded dim (vocab-parallel logits) from per-rank candidates, no gather of the input",
    ops=(OP,),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
    upstream_fix="none in any release up to 2.15.0 (measured: the top-k dim is replicated)",
    communication="an all-gather of `k` values and indices per rank and sharding mesh dim",
)
