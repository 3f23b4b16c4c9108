"""``rms_norm`` with the normalised (hidden) dim sharded raises from torch 2.10, and an in-place
scalar add on a ``Partial(sum)`` DTensor is silently wrong on torch 2.9 and 2.10.

Trigger: ``F.rms_norm(x, (h,), w)`` (``nn.RMSNorm``, HF ``Qwen2RMSNorm`` under TP + SP when the
norm input is sharded on the hidden dim) with ``x`` ``Shard(-1)``, evenly sharded. On CPU,
ATen's composite ``rms_norm`` computes ``x.pow(2).mean(-1, keepdim=True).add_(eps)``: the mean
over the sharded dim is ``Partial(avg)`` (sum of squares reduced later: no gather), and the
in-place ``aten.add_.Scalar`` on it raises from torch 2.10 (``in-place operations that require
placement changes are not supported``). Its gradient goes through the same ops. Directly,
``torch.ops.aten.add_.Scalar(p, c)`` on a ``Partial(sum)`` tensor adds ``c`` on every rank, so
the sum gains ``n * c`` (2.9, 2.10) or raises (2.11+).

Fix (a custom handler replacing torch's ``add_.Scalar`` dispatch): adding a constant commutes
with ``avg``, ``max`` and ``min`` (``avg(x_i + c) = avg(x_i) + c``), so those ``Partial``
placements, every ``Shard`` and ``Replicate`` add ``c`` to the local tensor and keep their
placements with no communication. ``Partial(sum)`` adds ``c`` on one rank of each reduced
group only (``sum(x_0 + c, x_1, ...) = sum(x) + c``); the others add ``0`` so that dtype errors
are raised on every rank alike. Any other placement (norm partials, masked partials) raises
``NotImplementedError`` naming it. In ``rms_norm`` the sum of squares thus stays ``Partial``
until ``rsqrt`` reduces it: one all-reduce of a ``[..., 1]`` tensor, never a gather of ``x``.
Upstream: pytorch/pytorch#197501 (open as of torch 2.15) adds the same rule for
``Partial(avg)``; measured failing on every release 2.9 to 2.15.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches import compat
from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.patch import Handler, Patch

# reduce(x_i + c) == reduce(x_i) + c for these Partial reductions.
_SHIFT_INVARIANT = ("avg", "max", "min")


def _add_scalar_(op_call: Any, args: Any, kwargs: Any) -> Any:
    """``aten.add_.Scalar(self, other, alpha=1)`` with ``self`` a DTensor: see the module doc."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    target = args[0]
    coordinate = target.device_mesh.get_coordinate()
    if coordinate is None:  # this rank holds no part of the mesh
        return target
    add_here = True
    for mesh_dim, p in enumerate(target.placements):
        if isinstance(p, (Shard, Replicate)):
            continue
        # Exactly Partial: subclasses (norm / masked partials) reduce otherwise.
        if type(p) is Partial and p.reduce_op in _SHIFT_INVARIANT:
            continue
        if type(p) is Partial and p.reduce_op == "sum":
            add_here = add_here and coordinate[mesh_dim] == 0
            continue
        raise NotImplementedError(
            f"dtensor_patches: aten.add_.Scalar on a DTensor placed {p}: only Shard, "
            "Replicate and Partial(sum/avg/max/min) are supported"
        )
    other = args[1] if len(args) > 1 else kwargs["other"]
    rest = {k: v for k, v in kwargs.items() if k != "other"}
    if not add_here:
        other = type(other)(0)  # same Python type: the same dtype checks on every rank
    op_call(compat.local_tensor(target), other, *args[2:], **rest)
    return target


def _registrations() -> list[Handler]:
    return [Handler("aten.add_.Scalar", _add_scalar_)]


def _as_partial(x: Any, reduce_op: str) -> Any:
    """A ``Partial(reduce_op)`` DTensor whose reduction is ``x``'s full value."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial

    full = x.full_tensor()
    n = dist.get_world_size()
    local = full * (2 * (dist.get_rank() + 1) / (n * (n + 1))) if reduce_op == "sum" else full
    return DTensor.from_local(local, x.device_mesh, [Partial(reduce_op)], run_check=False)


def _scalar_add_(x: Any, reduce_op: str) -> Any:
    if hasattr(x, "device_mesh"):
        x = _as_partial(x, reduce_op)
    else:
        x = x.clone()
    return torch.ops.aten.add_.Scalar(x, 1.5, alpha=2)


def _rms_norm_grads(x: Any, w: Any) -> tuple[Any, ...]:
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = F.rms_norm(x, (x.shape[-1],), w, 1e-6)
    return (y, *torch.autograd.grad((y * y * y).sum(), [x, w]))


CASES = [
    Case(
        "rms_norm(x, (6,), w) Shard(1)",
        lambda x, w: F.rms_norm(x, (6,), w, 1e-6),
        lambda: [randn(4, 6), randn(6, seed=2)],
        ["S1", "S0"],
    ),
    Case(
        "rms_norm(x) and grads, 2x3x4 Shard(2)",
        _rms_norm_grads,
        lambda: [randn(2, 3, 4), randn(4, seed=2)],
        ["S2", "R"],
    ),
    Case(
        "add_.Scalar on Partial(sum)",
        lambda x: _scalar_add_(x, "sum"),
        lambda: [randn(4, 6)],
        ["R"],
    ),
    Case(
        "add_.Scalar on Partial(avg)",
        lambda x: _scalar_add_(x, "avg"),
        lambda: [randn(4, 6)],
        ["R"],
    ),
    Case(
        "add_.Scalar on Shard(1)",
        lambda x: torch.ops.aten.add_.Scalar(x, 2),
        lambda: [randn(3, 5)],
        ["S1"],
        inplace=True,
    ),
]


def reproduce(mesh: object) -> str | None:
    """``rms_norm`` (and its gradients) over a sharded hidden dim; scalar ``add_`` on partials."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="add_scalar_partial",
    summary="in-place scalar add on Partial DTensors; rms_norm over a sharded hidden dim",
    ops=("aten.add_.Scalar",),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_issue="https://github.com/pytorch/pytorch/pull/197501 (open: Partial(avg) only)",
    overrides_existing=True,
)
