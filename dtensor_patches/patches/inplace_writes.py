"""In-place writes on DTensors: ``Partial`` targets, fills, and writes through views.

Three kinds of in-place write are wrong or refused by stock DTensor (measured on 2.9.1 to
2.15.0, 2-rank gloo mesh):

1. **An in-place op on a ``Partial`` target.** ``n = torch.linalg.vector_norm(x); n += 2``
   or ``p.clamp_(min=0.5)`` with ``p`` a ``Partial(sum)`` DTensor: on 2.9/2.10 each rank
   applies the op to its own share, so ``n += 2`` adds 2 per rank and ``clamp_`` clamps the
   shares (silently wrong); from 2.12 DTensor refuses ("in-place operations that require
   placement changes are not supported"). ``p.fill_(3)`` on a ``Partial(sum)`` target gives
   ``world * 3`` on every release.
2. **Writes through a view of a sharded dim.** ``torch.nn.init.zeros_(w[:2])`` with ``w`` a
   ``Shard(0)`` parameter: slicing a sharded dim makes DTensor gather a temporary first, the
   view's local tensor points into that temporary, and the write never reaches ``w`` (every
   release). ``w[:2] = 0`` and ``nn.init.normal_(w[:2])`` likewise.
3. ``aten.fill_.Tensor`` (``x[:, 0] = 1.0``, ``x.fill_(t)``) has no sharding strategy on any
   release (2.15 routes ``x[:, 0] = 1.0`` differently, but ``x.fill_(t)`` still fails).

Fix: a custom handler on the in-place ops below. A call whose target is neither ``Partial``
nor a view detached from its base goes straight to DTensor's own dispatch
(``compat.dispatch_natively``); only the two problem cases get extra work:

- ``Partial`` target: the op is applied to the *reduced* value, and the caller's object
  becomes ``Replicate()`` on those mesh dims (the issue's policy: updated in place, placements
  describe the data). Ops that are linear in the target (``zero_``, ``mul_``/``div_`` by a
  scalar, ``neg_``) keep ``Partial`` with no communication; ops that overwrite every element
  (``fill_``, ``copy_``, ``normal_``, ``uniform_``) relabel without reducing.
- Detached view: after the op, the view's new values are written into the base's global
  region (found from the view's global stride and offset) and the base's shards are
  refreshed. On 2.9 a DTensor view does not carry its global offset, so the region cannot be
  found and :class:`~dtensor_patches.errors.LostWriteError` is raised instead of losing the
  write.

Cost: every call of these ops on a DTensor goes through a Python handler (a few placement
checks) before the native dispatch; see ``benchmarks/patch_costs.py``. The extra
communication happens only in the two problem cases.

Upstream: torch made the ``Partial`` case raise instead of computing wrong values (2.12,
"in-place operations that require placement changes are not supported"); no release
redistributes the target in place or carries writes through redistributed views.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dtensor_patches import compat
from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.errors import LostWriteError
from dtensor_patches.handlers import shard_of
from dtensor_patches.patch import Handler, Patch, Registration, Strategy
from dtensor_patches.strategies import elementwise_strategy, uniform_strategy


class _Kind(enum.Enum):
    """How an in-place op treats a ``Partial`` target."""

    REDUCES = "reduce the target first"  # non-linear or affine: needs the full value
    LINEAR = "keep Partial"  # linear in the target: shares stay valid
    OVERWRITES = "relabel, no reduction"  # every element overwritten: old shares irrelevant


_OPS: dict[str, _Kind] = {
    # arithmetic and affine
    "aten.add_.Tensor": _Kind.REDUCES,
    "aten.add_.Scalar": _Kind.REDUCES,
    "aten.sub_.Tensor": _Kind.REDUCES,
    "aten.sub_.Scalar": _Kind.REDUCES,
    "aten.mul_.Tensor": _Kind.REDUCES,
    "aten.div_.Tensor": _Kind.REDUCES,
    "aten.div_.Tensor_mode": _Kind.REDUCES,
    "aten.addcmul_.default": _Kind.REDUCES,
    "aten.addcdiv_.default": _Kind.REDUCES,
    "aten.lerp_.Scalar": _Kind.REDUCES,
    "aten.lerp_.Tensor": _Kind.REDUCES,
    # non-linear
    "aten.clamp_.default": _Kind.REDUCES,
    "aten.clamp_.Tensor": _Kind.REDUCES,
    "aten.clamp_min_.default": _Kind.REDUCES,
    "aten.clamp_max_.default": _Kind.REDUCES,
    "aten.pow_.Scalar": _Kind.REDUCES,
    "aten.pow_.Tensor": _Kind.REDUCES,
    "aten.exp_.default": _Kind.REDUCES,
    "aten.log_.default": _Kind.REDUCES,
    "aten.sqrt_.default": _Kind.REDUCES,
    "aten.rsqrt_.default": _Kind.REDUCES,
    "aten.abs_.default": _Kind.REDUCES,
    "aten.reciprocal_.default": _Kind.REDUCES,
    "aten.sigmoid_.default": _Kind.REDUCES,
    "aten.tanh_.default": _Kind.REDUCES,
    "aten.relu_.default": _Kind.REDUCES,
    "aten.nan_to_num_.default": _Kind.REDUCES,
    # linear in the target
    "aten.zero_.default": _Kind.LINEAR,
    "aten.mul_.Scalar": _Kind.LINEAR,
    "aten.div_.Scalar": _Kind.LINEAR,
    "aten.neg_.default": _Kind.LINEAR,
    # overwrite every element
    "aten.fill_.Scalar": _Kind.OVERWRITES,
    "aten.fill_.Tensor": _Kind.OVERWRITES,
    "aten.copy_.default": _Kind.OVERWRITES,
    "aten.normal_.default": _Kind.OVERWRITES,
    "aten.uniform_.default": _Kind.OVERWRITES,
}

def _follow_self(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema, driver=0)


# Strategies the native path needs where torch has none (measured): ``fill_.Tensor`` and
# ``fill.Tensor`` on every release so far, ``clamp_min_``/``clamp_max_`` up to 2.12.
_STRATEGIES_IF_MISSING: dict[str, Callable[[Any], Any]] = {
    "aten.fill_.Tensor": uniform_strategy,
    "aten.fill.Tensor": uniform_strategy,
    "aten.clamp_min_.default": _follow_self,
    "aten.clamp_max_.default": _follow_self,
}


def _dtensor_class() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def _detached_base(target: Any) -> Any:
    """The DTensor base of ``target`` when ``target`` is a view whose local tensor does not
    alias the base's (DTensor redistributed before viewing), else ``None``.

    Every rank reaches the same answer: whether a view op redistributes is decided from the
    global specs, which all ranks share.
    """
    base = target._base
    if base is None or not isinstance(base, _dtensor_class()):
        return None
    if compat.shares_storage(compat.local_tensor(target), compat.local_tensor(base)):
        return None
    return base


# Attribute on a DTensor made by slice/select that no longer aliases its input's storage:
# (input DTensor, op, remaining args, kwargs), enough to replay the view on plain tensors.
_VIEW_RECORD = "_dtensor_patches_view_of"

# The view ops whose redistributing calls are recorded: indexing (``w[:2]``, ``w[0]``,
# ``w[1:3, 2:]``) and ``narrow`` (which decomposes to ``slice``).
_RECORDED_VIEW_OPS = ("aten.slice.Tensor", "aten.select.int")


def _record_view(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Run the view natively; remember how to replay it when its result is detached."""
    source = args[0] if args else None
    out = compat.dispatch_natively(op_call, args, kwargs)
    dtensor = _dtensor_class()
    if isinstance(source, dtensor) and isinstance(out, dtensor):
        detached = not compat.shares_storage(compat.local_tensor(out), compat.local_tensor(source))
        if detached or hasattr(source, _VIEW_RECORD):
            setattr(out, _VIEW_RECORD, (source, op_call, tuple(args[1:]), dict(kwargs)))
    return out


def _region(view: Any, base: Any, full_base: torch.Tensor) -> torch.Tensor:
    """The view of the plain tensor ``full_base`` that corresponds to the DTensor ``view``.

    Follows recorded slice/select calls back to a DTensor that aliases ``base``'s storage,
    whose place in ``base`` is its global stride and offset.

    Raises:
        LostWriteError: the chain has an unrecorded redistributing view, or needs a global
            offset that this release does not carry (2.9).
    """
    record = getattr(view, _VIEW_RECORD, None)
    if record is not None:
        source, op_call, rest, kwargs = record
        return op_call(_region(source, base, full_base), *rest, **kwargs)
    if view is base:
        return full_base
    if not compat.shares_storage(compat.local_tensor(view), compat.local_tensor(base)):
        raise LostWriteError(
            f"in-place write into a view of a sharded DTensor (view shape {tuple(view.shape)}, "
            f"base shape {tuple(base.shape)}, placements {tuple(base.placements)}): DTensor "
            "gathered a sharded dim into a temporary to build the view, through a view op "
            "whose place in the base is not tracked (only slicing, select and narrow are), "
            "so the write cannot reach the base. Write into the base directly."
        )
    if not compat.view_geometry_is_global():
        raise LostWriteError(
            f"in-place write into a view of a sharded DTensor: torch {torch.__version__} does "
            "not record where a DTensor view lies in its base (every view reports offset 0), "
            "so the write cannot reach the base. Slice the base itself (w[a:b]) instead of a "
            "transposed or reshaped view of it."
        )
    if tuple(base.stride()) != tuple(full_base.stride()) or base.storage_offset() != 0:
        raise LostWriteError(
            "in-place write into a view of a sharded DTensor whose base is not contiguous "
            f"(stride {tuple(base.stride())}, offset {base.storage_offset()}): the view's "
            "place in the base cannot be located, so the write cannot reach the base"
        )
    return full_base.as_strided(view.size(), view.stride(), view.storage_offset())


def _settle_partial(target: Any, *, reduce: bool) -> None:
    """Make ``target``'s ``Partial`` mesh dims ``Replicate()`` in place.

    ``reduce``: the local tensor becomes the reduced value (one all-reduce); otherwise it is
    left as is, for ops that overwrite every element anyway.
    """
    from torch.distributed.tensor import Replicate

    settled = [Replicate() if p.is_partial() else p for p in target.placements]
    if reduce:
        with torch.no_grad():
            value = target.detach().redistribute(target.device_mesh, settled).to_local()
            compat.local_tensor(target).copy_(value)
    compat.set_placements(target, settled)


def _locate(view: Any, base: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(full base, view's region in it)``; raises LostWriteError before anything changes."""
    with torch.no_grad():
        full = base.detach().full_tensor()
        return full, _region(view, base, full)


def _write_back(view: Any, base: Any, full: torch.Tensor, region: torch.Tensor) -> None:
    """Write ``view``'s values into ``region`` of ``full`` and refresh ``base``'s shards."""
    with torch.no_grad():
        region.copy_(view.detach().full_tensor())
        compat.local_tensor(base).copy_(shard_of(full, base.device_mesh, base.placements))


# ``x.mul_(3.0)`` reaches DTensor as ``mul_.Tensor`` with a Python number: linear then.
_LINEAR_WITH_NUMBER = frozenset({"aten.mul_.Tensor", "aten.div_.Tensor"})


def _kind_of_call(kind: _Kind, op_call: Any, args: Any) -> _Kind:
    if (
        kind is _Kind.REDUCES
        and str(op_call) in _LINEAR_WITH_NUMBER
        and len(args) > 1
        and isinstance(args[1], (int, float, bool))
    ):
        kind = _Kind.LINEAR
    if kind is _Kind.LINEAR and compat.torch_release() < _NATIVE_LINEAR_INPLACE_ON_PARTIAL:
        # Measured: on 2.9 native div_/neg_ on a Partial target leave it unchanged, on 2.10
        # they raise; only from 2.11 does torch keep Partial correctly in place.
        return _Kind.OVERWRITES if str(op_call) == "aten.zero_.default" else _Kind.REDUCES
    return kind


_NATIVE_LINEAR_INPLACE_ON_PARTIAL = Version("2.11")


# The out-of-place twin of an in-place overload, where the overload names differ.
_OUT_OF_PLACE_NAMES = {
    "aten.pow_.Scalar": "aten.pow.Tensor_Scalar",
    "aten.pow_.Tensor": "aten.pow.Tensor_Tensor",
}

# What DTensor (2.12+) says when an in-place op's strategies all change the target's placement.
_PLACEMENT_CHANGE_REFUSAL = "in-place operations that require placement changes"


def _out_of_place(op_call: Any) -> Any:
    name = str(op_call)
    twin = _OUT_OF_PLACE_NAMES.get(name)
    if twin is None:
        namespace, packet, overload = name.split(".")
        twin = f"{namespace}.{packet.removesuffix('_')}.{overload}"
    return compat.resolve_op(twin)


def _through_out_of_place(op_call: Any, args: Any, kwargs: Any) -> Any:
    """Compute the op out of place, then write it into the target in its own placements.

    For in-place calls that DTensor refuses because every strategy it has would change the
    target's placement (e.g. ``x.add_(r)`` with ``x`` sharded on a dim shorter than the mesh,
    2.13). The result is checked like ATen checks an in-place result: same shape, castable
    dtype.
    """
    target = args[0]
    if str(op_call) == "aten.copy_.default":
        # ``copy`` (the twin) has no strategy on some releases; the result is ``src`` itself.
        src = args[1]
        result = src.expand(target.shape) if isinstance(src, _dtensor_class()) else src
        if not isinstance(result, _dtensor_class()):
            raise RuntimeError(f"{op_call}: expected a DTensor source, got {type(src).__name__}")
    else:
        result = _out_of_place(op_call)(*args, **kwargs)
    if tuple(result.shape) != tuple(target.shape):
        raise RuntimeError(
            f"{op_call}: output with shape {list(target.shape)} doesn't match the broadcast "
            f"shape {list(result.shape)}"
        )
    if not torch.can_cast(result.dtype, target.dtype):
        raise RuntimeError(
            f"{op_call}: result type {result.dtype} can't be cast to the desired output type "
            f"{target.dtype}"
        )
    with torch.no_grad():
        placed = result.detach().redistribute(target.device_mesh, target.placements).to_local()
        compat.local_tensor(target).copy_(placed.to(target.dtype))
    return target


def _native_or_through_out_of_place(op_call: Any, args: Any, kwargs: Any) -> Any:
    try:
        return compat.dispatch_natively(op_call, args, kwargs)
    except RuntimeError as exc:
        if _PLACEMENT_CHANGE_REFUSAL not in str(exc) or str(op_call) in _NO_TWIN:
            raise
    return _through_out_of_place(op_call, args, kwargs)


# Random fills have no out-of-place twin with the same arguments.
_NO_TWIN = frozenset({"aten.normal_.default", "aten.uniform_.default"})


def _handler(kind: _Kind) -> Callable[[Any, Any, Any], Any]:
    def handle(op_call: Any, args: Any, kwargs: Any) -> Any:
        target = args[0] if args else None
        if not isinstance(target, _dtensor_class()):
            return compat.dispatch_natively(op_call, args, kwargs)
        has_partial = any(p.is_partial() for p in target.placements)
        base = _detached_base(target)
        if not has_partial and base is None:
            return _native_or_through_out_of_place(op_call, args, kwargs)
        located = _locate(target, base) if base is not None else None
        call_kind = _kind_of_call(kind, op_call, args)
        if has_partial and call_kind is not _Kind.LINEAR:
            _settle_partial(target, reduce=call_kind is _Kind.REDUCES)
        out = _native_or_through_out_of_place(op_call, args, kwargs)
        if located is not None:
            _write_back(target, base, *located)
        return out

    handle.__qualname__ = f"inplace_writes_handler[{kind.name}]"
    return handle


def _registrations() -> list[Registration]:
    registrations: list[Registration] = []
    for name, strategy in _STRATEGIES_IF_MISSING.items():
        # Only where torch has none, so a native strategy is never shadowed.
        if not compat.has_native_strategy(compat.resolve_op(name)):
            registrations.append(Strategy(name, strategy))
    registrations += [Handler(name, _handler(kind)) for name, kind in _OPS.items()]
    registrations += [Handler(name, _record_view) for name in _RECORDED_VIEW_OPS]
    return registrations


# --- reproducer -------------------------------------------------------------------------


def _norm_plus_two(x: torch.Tensor) -> torch.Tensor:
    n = torch.linalg.vector_norm(x)
    n += 2
    return n


def _sum_then_clamp(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0).clamp_(min=0.5)


def _sum_then_fill(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0).fill_(3.0)


def _zeros_through_view(x: torch.Tensor) -> torch.Tensor:
    torch.nn.init.zeros_(x[1:3])
    return x


def _setitem_slice(x: torch.Tensor) -> torch.Tensor:
    x[:2] = 0.5
    return x


def _first_column(x: torch.Tensor) -> torch.Tensor:
    x[:, 0] = 1.0
    return x


def _fill_with_tensor(x: torch.Tensor) -> torch.Tensor:
    return x.fill_(torch.tensor(2.5))


CASES = [
    Case("vector_norm(x) += 2", _norm_plus_two, lambda: [randn(5, 6)], ["S0"]),
    Case("x.sum(0).clamp_(min=0.5)", _sum_then_clamp, lambda: [randn(5, 6)], ["S0"]),
    Case("x.sum(0).fill_(3)", _sum_then_fill, lambda: [randn(5, 6)], ["S0"]),
    Case(
        "nn.init.zeros_(x[1:3])", _zeros_through_view, lambda: [randn(5, 6)], ["S0"], inplace=True
    ),
    Case("x[:2] = 0.5", _setitem_slice, lambda: [randn(5, 6)], ["S0"], inplace=True),
    Case("x[:, 0] = 1.0", _first_column, lambda: [randn(5, 6)], ["S0"], inplace=True),
    Case("x.fill_(tensor)", _fill_with_tensor, lambda: [randn(5, 6)], ["S1"], inplace=True),
]


def reproduce(mesh: object) -> str | None:
    """Partial targets, writes through slices of a sharded dim, and ``fill_.Tensor``."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="inplace_writes",
    summary=(
        "in-place ops on Partial targets reduce first; writes through views of sharded dims "
        "reach the base; fill_.Tensor strategy (torch 2.9 to 2.15)"
    ),
    ops=(*_OPS, "aten.fill.Tensor", *_RECORDED_VIEW_OPS),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
)
