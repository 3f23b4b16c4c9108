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
torch's own handler where there is one (2.10+, correct there and cheaper: it gathers only
per-rank winners), except for a 1-D input, where torch's handler raises on a reshape
(``logits[-1].argmax(-1)`` of vocab-sharded logits: ``shape '[1, 4, 2]' is invalid``, measured on
2.13); on 2.9, which has no handler, and for 1-D inputs, the reduced dim is gathered and other
shards stay. Measured failing on every release 2.9 to 2.15.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import local_tensor
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches._torch.tables import custom_op_handlers
from dtensor_patches.dispatch.shards import contiguous_stride
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import is_shard


def _along_dim(op_call: Any, x: Any, dim: int, keepdim: bool) -> Any:
    """``argmax(x, dim)`` with the reduced dim gathered, other shards kept (torch 2.9)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ndim = max(x.ndim, 1)
    dim %= ndim
    placements = tuple(p if is_shard(p) and p.dim != dim else Replicate() for p in x.placements)
    if placements != tuple(x.placements):
        x = x.redistribute(x.device_mesh, placements)
    local = op_call(local_tensor(x), dim, keepdim)
    out_placements = [
        Shard(p.dim if keepdim or p.dim < dim else p.dim - 1) if is_shard(p) else p
        for p in placements
    ]
    shape = list(x.shape)
    if shape:
        if keepdim:
            shape[dim] = 1
        else:
            shape.pop(dim)
    size = torch.Size(shape)
    return DTensor.from_local(
        local,
        x.device_mesh,
        out_placements,
        run_check=False,
        shape=size,
        stride=contiguous_stride(size),
    )


def _handler(native: Callable[..., Any] | None) -> Callable[..., Any]:
    def handle(op_call: Any, args: Any, kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        if dim is not None:
            if native is not None and x.ndim > 1:
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
CASES = [
    Case("x.argmax() Shard(0)", lambda x: x.argmax(), lambda: [randn(5, 6)], ["S0"]),
    Case("x.argmin() Shard(1)", lambda x: x.argmin(), lambda: [randn(5, 3)], ["S1"]),
    Case(
        "x.argmax() ties Shard(1)",
        lambda x: x.argmax(),
        lambda: [torch.tensor([[0, 0, 0, 1], [1, 0, 0, 0]])],
        ["S1"],
    ),
    Case(
        "argmin(x, None, keepdim) Shard(0)",
        lambda x: torch.argmin(x, None, True),
        lambda: [randn(3, 4)],
        ["S0"],
    ),
    Case("x.argmax(1) Shard(1)", lambda x: x.argmax(1), lambda: [randn(4, 6)], ["S1"]),
    Case("v.argmax(-1) 1-D Shard(0)", lambda v: v.argmax(-1), lambda: [randn(6)], ["S0"]),
    Case(
        "argmin(v, 0, keepdim) 1-D Shard(0)",
        lambda v: torch.argmin(v, 0, True),
        lambda: [randn(5)],
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
