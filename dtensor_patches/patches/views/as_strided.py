"""``as_strided`` on a DTensor raises on every release 2.9 to 2.15 unless it is a no-op.

Trigger: ``x.fill_diagonal_(v)`` (its composite makes an ``as_strided`` view of the diagonal),
``torch.as_strided(x, ...)``, on a sharded or replicated DTensor. 2.9 has no strategy
(``does not have a sharding strategy registered``); from 2.10 torch's custom handler allows
only the no-op call (same size, stride and offset) and raises ``as_strided not supported
with DTensor`` for the rest, before sharding propagation, so the fallback's miss hook never
sees the call.

Fix: a custom handler that keeps torch's no-op case (``aten.alias``) and runs every other call
through the fallback's machinery on gathered inputs (``dispatch.gather.run_gathered``): a copy of the
strided view, ``Replicate()`` unless its shape is the input's, tracked like ``inplace_writes``'
views so that an in-place write into it (``fill_diagonal_``) reaches the tensor it was made
from. It gathers the whole input by nature: a strided view may touch any element. Counted in
``fallback_report()`` like any fallback.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import is_view
from dtensor_patches._torch.schemas import op_arguments, resolve_op
from dtensor_patches._torch.tables import custom_op_handlers
from dtensor_patches.errors import first_line
from dtensor_patches.patch import Handler, Patch
from dtensor_patches.reproducers import Case, randn

OP = "aten.as_strided.default"


def _registrations() -> list[Handler]:
    native = custom_op_handlers().get(resolve_op(OP))
    return [Handler(OP, _handler(native))]


def _handler(native: Any) -> Any:
    from dtensor_patches.dispatch import gather

    def handler(op_call: Any, args: Any, kwargs: Any) -> Any:
        source = args[0]
        if _is_noop(source, args, kwargs):
            return torch.ops.aten.alias.default(source)
        _refuse_views(source)
        if native is not None:
            try:
                return native(op_call, args, kwargs)
            except RuntimeError as exc:
                if "as_strided not supported with DTensor" not in str(exc):
                    raise
                return gather.run_gathered(op_call, tuple(args), dict(kwargs), first_line(exc))
        return gather.run_gathered(op_call, tuple(args), dict(kwargs), "no strategy")

    return handler


def _is_noop(source: Any, args: Any, kwargs: Any) -> bool:
    bound = op_arguments(resolve_op(OP), tuple(args), dict(kwargs))
    offset = bound.get("storage_offset")
    return (
        tuple(source.size()) == tuple(bound["size"])
        and tuple(source.stride()) == tuple(bound["stride"])
        and (offset is None or source.storage_offset() == offset)
    )


def _refuse_views(source: Any) -> None:
    """``as_strided`` addresses its input's storage; for a view that is the base's storage,
    which the gathered copy of the view does not hold: refuse instead of a wrong value."""
    if is_view(source) or source.storage_offset() != 0 or not source.is_contiguous():
        raise RuntimeError(
            "as_strided of a view (or non-contiguous) DTensor: its strides and offset address "
            "the base tensor's storage, which a gathered copy of the view does not have, so "
            "no correct result exists here. Call it on x.contiguous() (a fresh tensor) or on "
            "the base."
        )


def _fill_diagonal(x: torch.Tensor) -> torch.Tensor:
    return x.clone().fill_diagonal_(3.0)


def _strided(x: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(x, (2, 3), (1, 2), 1) * 2


# The tripwire's cases: ``fill_diagonal_`` and ``as_strided`` on DTensors vs single-device results.
CASES = [
    Case("fill_diagonal_ of Shard(0)", _fill_diagonal, lambda: [randn(5, 4)], ["S0"]),
    Case("fill_diagonal_ of Shard(1)", _fill_diagonal, lambda: [randn(4, 5)], ["S1"]),
    Case("as_strided of Replicate", _strided, lambda: [randn(4, 5)], ["R"]),
]


PATCH = Patch(
    name="as_strided",
    summary="as_strided (fill_diagonal_) runs on gathered inputs instead of raising",
    ops=(OP,),
    # Measured: with the patch, 2.9.1 to 2.12.0 give wrong values where stock raises; a patch
    # may never turn a clear error into a wrong result, so those releases keep torch's error.
    gate=SpecifierSet(">=2.13"),
    known_unfixable=SpecifierSet(">=2.9,<2.13"),
    registrations=_registrations,
    cases=CASES,
    replicates=True,
    overrides_existing=True,
    communication="replicates: the whole input",
)
