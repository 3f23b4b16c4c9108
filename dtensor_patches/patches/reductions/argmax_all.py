"""``x.argmax()`` / ``x.argmin()`` without ``dim`` on a sharded DTensor: no strategy on torch 2.9,
a crash inside torch's own handler on 2.10 and 2.11, and a silently wrong index on ties from
2.12.

Trigger: ``x.argmax()`` with ``x`` ``Shard(d)`` (best-of-n selection over a flattened score
tensor). Torch 2.10 and 2.11 route ``argmax``/``argmin`` to a custom handler that all-gathers
each rank's 0-d winner along dim 0, which gloo refuses (``allgather_coalesced: invalid size of
output tensor``). From 2.12 the handler picks the first *rank* holding the maximum, which is not
the first occurrence in flattened order once a dim other than 0 is sharded: for
``[[0, 0, 0, 1], [1, 0, 0, 0]]`` ``Shard(1)`` it returns 4 instead of 3.

Fix (a custom handler replacing torch's): without ``dim``, the input is gathered (``Partial``
reduced) and the op runs once on the full tensor, so ties resolve exactly as on one device;
the 0-d (or all-ones with ``keepdim``) index is ``Replicate()``. With ``dim`` the call goes to
torch's own handler where there is one (2.10+, correct there: it gathers only per-rank
winners), except where the sharded dim leaves a rank's shard empty (torch's handler raises on
that rank and the others hang) and for a 1-D input, where torch's handler raises on a reshape
(``logits[-1].argmax(-1)`` of vocab-sharded logits: ``shape '[1, 4, 2]' is invalid``, measured on
2.13); on 2.9, which has no handler, and for 1-D inputs, a sharded reduced dim is answered
from per-rank winners too (each rank's best value and global index, all-gathered: two tensors
of the result's size; NaN first, ties to the lower index) and other shards stay. Measured
failing on every release 2.9 to 2.15.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches._torch.tables import custom_op_handlers
from dtensor_patches.dispatch.shards import nested_shards_leave_a_rank_empty, sharded_result
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import is_shard


def _reduced_shape(shape: Any, dim: int, keepdim: bool) -> list[int]:
    """The shape of a reduction over ``dim`` (a 0-dim input stays 0-dim)."""
    out = list(shape)
    if out:
        if keepdim:
            out[dim] = 1
        else:
            out.pop(dim)
    return out


def _pick(values: torch.Tensor, indices: torch.Tensor, largest: bool) -> torch.Tensor:
    """The winner among per-rank candidates stacked on dim 0 (global indices): a NaN first
    (argmax/argmin return the first NaN), then the best value, ties to the lower index."""
    nan = (
        values.isnan() if values.is_floating_point() else torch.zeros_like(values, dtype=torch.bool)
    )
    best = torch.where(nan, values.new_zeros(()), values)
    best = best.amax(0) if largest else best.amin(0)
    any_nan = nan.any(0)
    chosen = torch.where(any_nan, nan, (values == best) & ~nan)
    beyond = torch.iinfo(indices.dtype).max
    return torch.where(chosen, indices, indices.new_full((), beyond)).amin(0)


def _by_winners(op_call: Any, x: Any, dim: int, keepdim: bool) -> Any:
    """``argmax(x, dim)`` / ``argmin`` with ``dim`` sharded: each rank's winner and its value,
    all-gathered over the mesh dims that shard ``dim`` (two tensors of the result's size per
    rank), and the first best of them; other shards kept."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from dtensor_patches._torch.dtensors import local_shape_and_offset

    mesh = x.device_mesh
    local = local_tensor(x)
    largest = "argmax" in op_call.name()
    shape_local, offset = local_shape_and_offset(x.shape, mesh, x.placements)
    if shape_local[dim] == 0:
        worst = float("-inf") if largest else float("inf")
        out_shape = [n for d, n in enumerate(local.shape) if d != dim]
        values = (
            local.new_full(out_shape, worst)
            if local.is_floating_point()
            else local.new_full(
                out_shape, torch.iinfo(local.dtype).min if largest else torch.iinfo(local.dtype).max
            )
        )
        indices = torch.full(out_shape, x.shape[dim], dtype=torch.long, device=local.device)
    else:
        indices = op_call(local, dim, False)
        values = local.gather(dim, indices.unsqueeze(dim)).squeeze(dim)
        indices = indices + offset[dim]
    over = [i for i, p in enumerate(x.placements) if is_shard(p) and p.dim == dim]
    for mesh_dim in over:
        group = mesh.get_group(mesh_dim)
        size = dist.get_world_size(group)
        all_values = [torch.empty_like(values) for _ in range(size)]
        all_indices = [torch.empty_like(indices) for _ in range(size)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_indices, indices.contiguous(), group=group)
        stacked_values, stacked_indices = torch.stack(all_values), torch.stack(all_indices)
        indices = _pick(stacked_values, stacked_indices, largest)
        chosen = (stacked_indices == indices).long().argmax(0, keepdim=True)
        values = stacked_values.gather(0, chosen).squeeze(0)
    if keepdim:
        indices = indices.unsqueeze(dim)
    placements = [
        Replicate()
        if i in over or not is_shard(p)
        else Shard(p.dim if keepdim or p.dim < dim else p.dim - 1)
        for i, p in enumerate(x.placements)
    ]
    return sharded_result(indices, mesh, placements, _reduced_shape(x.shape, dim, keepdim))


def _along_dim(op_call: Any, x: Any, dim: int, keepdim: bool) -> Any:
    """``argmax(x, dim)``: per-rank winners where ``dim`` is sharded (:func:`_by_winners`),
    else the local op with other shards kept; a ``Partial`` input is reduced first."""
    from torch.distributed.tensor import Replicate, Shard

    ndim = max(x.ndim, 1)
    dim %= ndim
    if (
        x.ndim > 0
        and all(is_shard(p) or p.is_replicate() for p in x.placements)
        and any(is_shard(p) and p.dim == dim for p in x.placements)
    ):
        return _by_winners(op_call, x, dim, keepdim)
    placements = tuple(p if is_shard(p) and p.dim != dim else Replicate() for p in x.placements)
    if placements != tuple(x.placements):
        x = x.redistribute(x.device_mesh, placements)
    local = op_call(local_tensor(x), dim, keepdim)
    out_placements = [
        Shard(p.dim if keepdim or p.dim < dim else p.dim - 1) if is_shard(p) else p
        for p in placements
    ]
    return sharded_result(
        local, x.device_mesh, out_placements, _reduced_shape(x.shape, dim, keepdim)
    )


def _empty_shard_along(x: Any, dim: int) -> bool:
    """Whether ``dim`` of ``x`` is sharded so that some rank's shard is empty (torch's handler
    then raises on that rank only, in its local kernel, and the others hang in its gather)."""
    dim %= max(x.ndim, 1)
    # Over every mesh dim that shards it, in turn: on a 2x2 mesh [Shard(0), Shard(0)] of 2 rows
    # leaves two ranks empty though each mesh dim alone divides what it cuts.
    ranks = [
        x.device_mesh.size(i)
        for i, p in enumerate(x.placements)
        if is_shard(p) and p.dim % x.ndim == dim
    ]
    return bool(ranks) and nested_shards_leave_a_rank_empty(x.shape[dim], ranks)


def _handler(native: Callable[..., Any] | None) -> Callable[..., Any]:
    def handle(op_call: Any, args: Any, kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if dim is not None:
            if native is not None and x.ndim > 1 and not _empty_shard_along(x, dim):
                return native(op_call, args, kwargs)
            return _along_dim(op_call, x, dim, keepdim)
        # The whole tensor: gather once, so ties resolve in flattened order as on one device.
        local = op_call(x.full_tensor(), None, keepdim)
        mesh = x.device_mesh
        return DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)

    return handle


def _registrations() -> list[Handler]:
    handlers = custom_op_handlers()
    registrations = []
    for name in ("aten.argmax.default", "aten.argmin.default"):
        # torch's own handler (2.10+), kept for calls with ``dim``.
        native = handlers.get(resolve_op(name))
        registrations.append(Handler(name, _handler(native)))
    return registrations


# The tripwire's cases: ``argmax``/``argmin`` over the whole tensor (ties included) and along a dim.
# Uneven sizes that leave no rank an empty shard on 2 or 4 ranks (7 rows: 4, 3 and 2, 2, 2, 1):
# on stock torch an empty shard makes the ranks' collectives disagree in size, which aborts
# gloo on 4 ranks (``check --world-size 4``) instead of showing this bug.
CASES = [
    Case("x.argmax() Shard(0)", lambda x: x.argmax(), lambda: [randn(7, 6)], ["S0"]),
    Case("x.argmin() Shard(1)", lambda x: x.argmin(), lambda: [randn(5, 7)], ["S1"]),
    Case(
        "x.argmax() ties Shard(1)",
        lambda x: x.argmax(),
        lambda: [torch.tensor([[0, 0, 0, 1], [1, 0, 0, 0]])],
        ["S1"],
    ),
    Case(
        "argmin(x, None, keepdim) Shard(0)",
        lambda x: torch.argmin(x, None, True),
        lambda: [randn(7, 4)],
        ["S0"],
    ),
    Case("x.argmax(1) Shard(1)", lambda x: x.argmax(1), lambda: [randn(4, 7)], ["S1"]),
    Case("v.argmax(-1) 1-D Shard(0)", lambda v: v.argmax(-1), lambda: [randn(8)], ["S0"]),
    Case(
        "logits.argmin(-1) Shard(-1) [2, 3, 11]",
        lambda x: x.argmin(-1),
        lambda: [randn(2, 3, 11)],
        ["S2"],
    ),
    Case(
        "argmin(v, 0, keepdim) 1-D Shard(0)",
        lambda v: torch.argmin(v, 0, True),
        lambda: [randn(7)],
        ["S0"],
    ),
]


PATCH = Patch(
    name="argmax_all",
    summary="argmax()/argmin() without dim: first occurrence over the whole sharded tensor",
    ops=("aten.argmax.default", "aten.argmin.default"),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    overrides_existing=True,
    communication="the whole input, without `dim` or for 1-D",
)
