"""Writes through a view that DTensor had to redistribute reach the tensor it was made from.

Trigger (every release 2.9 to 2.15, measured): ``torch.nn.init.zeros_(w[:2])`` with ``w`` a
``Shard(0)`` parameter. Slicing a sharded dim makes DTensor gather a temporary first; the
view's local tensor points into that temporary, and the write never reaches ``w``. Also
``w[:2] = 0``, ``w.t()[:, 1:3].zero_()``, and every view op that redistributes (``slice``,
``select``, ``view``, ``unbind``, ``split``...).

Where it acts, and what that costs: one miss rule for every op, consulted only when a call
meets sharding propagation without a cached decision, acting on *view ops whose input must be
redistributed* (seen in torch's own decision: ``needs_redistribute`` on the input). The view is
made from the redistributed input and returned as a ``TrackedView``, a ``DTensor`` subclass that
records how it was made. Only such views take a Python path: their ops dispatch through
``TrackedView.__torch_dispatch__``, which unwraps them and, for an op that writes into one,
computes the write on a scratch copy, replays the recorded view op on the gathered source to
find the region, and writes the source's new shards into the source's own local tensor (which
aliases the real base). Chains of such views are followed to the first untracked source.
Nothing is written until every step has succeeded. Cached calls (ordinary slices that need no
redistribution) pay nothing.

Gate: torch 2.10 and 2.11 dispatch DTensor subclasses through the C++ fast path without
calling their ``__torch_dispatch__`` (measured; 2.12 honours it again, 2.9 is Python), so a
tracked view cannot see its writes there and the patch is gated out; those releases lose such
writes as stock torch does (README, known gaps).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from torch.utils._pytree import tree_flatten, tree_unflatten

from dtensor_patches import compat
from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.errors import LostWriteError
from dtensor_patches.handlers import shard_of
from dtensor_patches.patch import MissRule, Patch, Registration
from dtensor_patches.patches.inplace_writes import _is_spec, _writes_self

__all__ = ["PATCH", "tracked_view_class"]


def _dtensor_class() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


_IS_VIEW: dict[Any, bool] = {}


def _is_view_op(op: Any) -> bool:
    """A view op: its outputs alias its first argument without writing it."""
    known = _IS_VIEW.get(op)
    if known is None:
        schema = op._schema
        first = schema.arguments[0].alias_info if schema.arguments else None
        outs = [r.alias_info for r in schema.returns]
        known = bool(
            first is not None
            and not first.is_write
            and outs
            and all(
                a is not None and not a.is_write and set(a.before_set) & set(first.before_set)
                for a in outs
            )
        )
        _IS_VIEW[op] = known
    return known


def _written_positions(op: Any) -> list[int]:
    """Schema positions of the arguments ``op`` writes (``self`` of in-place ops, ``out``)."""
    return [
        i
        for i, a in enumerate(op._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def _rule(schema: Any, native: compat.NativeDecision) -> compat.DivertedCall | None:
    op = schema.op
    args = schema.args_schema
    if getattr(_MAKING, "active", False):
        return None  # the view of the redistributed input: torch's own decision
    if _is_view_op(op) and args and _is_spec(args[0]):
        sharding = native.sharding()
        if sharding is None or not sharding.needs_redistribute:
            return None
        moved = sharding.redistribute_schema
        if moved is None or not _is_spec(moved.args_schema[0]):
            return None
        wanted = tuple(moved.args_schema[0].placements)
        if wanted == tuple(args[0].placements):
            return None
        return _tracked_view_maker(wanted)
    return None
    return None


# --- views that DTensor had to redistribute -------------------------------------------------


@functools.cache
def tracked_view_class() -> type:
    """The ``TrackedView`` class (a ``DTensor`` subclass, built on first use so that importing
    this module does not import ``torch.distributed.tensor``)."""

    class TrackedView(_dtensor_class()):  # type: ignore[misc]
        """A DTensor view whose local tensor lives in a temporary (its input was
        redistributed).

        Made by the ``inplace_writes`` patch for view ops that redistribute their input
        (``w[:2]`` of a ``Shard(0)`` ``w``, ``hidden[:, -1]`` of a sequence-sharded tensor...).
        It behaves like any DTensor; an op that writes into it is carried into the tensor the
        view was made from, as on a single device. Ops on it run through this class's
        ``__torch_dispatch__`` (Python), so only such views pay for the tracking.
        """

        _dtensor_patches_view_of: tuple[Any, Any, tuple[Any, ...], dict[str, Any], int | None]

        @classmethod
        def __torch_dispatch__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return _dispatch_tracked(func, args, kwargs or {})

    return TrackedView


def _is_tracked(value: Any) -> bool:
    return isinstance(value, tracked_view_class())


def _dispatch_tracked(func: Any, args: Any, kwargs: Any) -> Any:
    flat, spec = tree_flatten((args, kwargs))
    plain = [_as_plain(a) if _is_tracked(a) else a for a in flat]
    plain_args, plain_kwargs = tree_unflatten(plain, spec)
    written = _written_views(func, args, kwargs)
    if written:
        return _write_through(func, args, kwargs, plain_args, plain_kwargs, written)
    out = func(*plain_args, **plain_kwargs)
    if _is_view_op(func) and args and _is_tracked(args[0]):
        return _track(out, args[0], func, tuple(args[1:]), dict(kwargs))
    return out


def _as_plain(view: Any) -> Any:
    """A plain DTensor over the same local tensor and spec."""
    return compat.make_dtensor(compat.local_tensor(view), view._spec)


def _track(out: Any, source: Any, op_call: Any, rest: tuple[Any, ...], kwargs: Any) -> Any:
    """``out`` (a DTensor view, or a list/tuple of them) as TrackedViews of ``source``."""
    dtensor = _dtensor_class()

    def one(value: Any, index: int | None) -> Any:
        if not isinstance(value, dtensor):
            return value
        tracked = compat.make_dtensor(
            compat.local_tensor(value), value._spec, cls=tracked_view_class()
        )
        tracked._dtensor_patches_view_of = (source, op_call, rest, kwargs, index)
        return tracked

    if isinstance(out, (list, tuple)):
        return type(out)(one(v, i) for i, v in enumerate(out))
    return one(out, None)


_MAKING = threading.local()


def _tracked_view_maker(wanted: tuple[Any, ...]) -> compat.DivertedCall:
    def run(op_call: Any, args: Any, kwargs: Any) -> Any:
        source = args[0]
        # Not ``source.detach()``: detach is a view op too, and some releases redistribute
        # for it (``_NormPartial`` on 2.15), which would come back here.
        plain = compat.make_dtensor(compat.local_tensor(source), source._spec)
        _MAKING.active = True
        try:
            with torch.no_grad():
                moved = plain.redistribute(source.device_mesh, wanted)
                out = op_call(moved, *args[1:], **kwargs)
        finally:
            _MAKING.active = False
        return _track(out, source, op_call, tuple(args[1:]), dict(kwargs))

    return run


def _written_views(func: Any, args: Any, kwargs: Any) -> list[tuple[str, int | None, Any]]:
    """The TrackedViews ``func`` writes into: ``(where, index, view)``, ``where`` is
    ``"arg"``/``"kwarg:name"``."""
    found: list[tuple[str, int | None, Any]] = []
    for i in _written_positions(func):
        argument = func._schema.arguments[i]
        if i < len(args):
            value, where, index = args[i], "arg", i
        elif argument.name in kwargs:
            value, where, index = kwargs[argument.name], f"kwarg:{argument.name}", None
        else:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if _is_tracked(v):
                found.append((where, index, v))
    return found


def _gathered(value: Any) -> torch.Tensor:
    return compat.make_dtensor(compat.local_tensor(value), value._spec).full_tensor()


def _region(record: Any, full_source: torch.Tensor) -> torch.Tensor:
    """The recorded view op replayed on the plain full source: the view's place in it.

    Raises:
        LostWriteError: the replay is not a view into ``full_source``.
    """
    _, op_call, rest, kwargs, index = record
    try:
        region = op_call(full_source, *rest, **kwargs)
    except RuntimeError as exc:
        raise LostWriteError(
            f"in-place write into a view made by {op_call} from a redistributed DTensor: "
            f"replaying the view on the full tensor failed ({exc}), so its place in the base "
            "cannot be found. Write into the base directly."
        ) from exc
    if index is not None:
        region = region[index]
    if not compat.shares_storage(region, full_source):
        raise LostWriteError(
            f"in-place write into a view made by {op_call} from a redistributed DTensor: on a "
            "plain tensor that op does not return a view, so the write has no place in the "
            "base. Write into the base directly."
        )
    return region


def _write_through(
    func: Any,
    args: Any,
    kwargs: Any,
    plain_args: Any,
    plain_kwargs: Any,
    written: list[tuple[str, int | None, Any]],
) -> Any:
    """Run ``func`` on scratch copies of the written views, carry each new value up the chain
    of sources, then write every local tensor at once (nothing changes if a step fails)."""
    scratch: dict[int, Any] = {}
    for where, index, view in written:
        copy = compat.make_dtensor(compat.local_tensor(view).clone(), view._spec)
        scratch[id(view)] = copy
        if where == "arg" and index is not None:
            plain_args = (*plain_args[:index], copy, *plain_args[index + 1 :])
        else:
            name = where.split(":", 1)[1]
            plain_kwargs = {**plain_kwargs, name: copy}
    with torch.no_grad():
        out = func(*plain_args, **plain_kwargs)
        writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _, _, view in written:
            new = scratch[id(view)]
            writes.append((compat.local_tensor(view), compat.local_tensor(new)))
            node, new_full = view, new.full_tensor()
            while _is_tracked(node):
                record = node._dtensor_patches_view_of
                source = record[0]
                full_source = _gathered(source)
                _region(record, full_source).copy_(new_full)
                writes.append(
                    (
                        compat.local_tensor(source),
                        shard_of(full_source, source.device_mesh, source.placements),
                    )
                )
                node, new_full = source, full_source
        for destination, value in writes:
            destination.copy_(value)
    if _writes_self(func):
        return args[0]
    by_id = {id(s): view for _, _, view in written for s in [scratch[id(view)]]}

    def back(value: Any) -> Any:
        return by_id.get(id(value), value)

    if isinstance(out, (list, tuple)):
        return type(out)(back(v) for v in out)
    return back(out)


def _registrations() -> list[Registration]:
    return [MissRule(compat.ANY_OP, _rule)]


def _zeros_through_view(x: torch.Tensor) -> torch.Tensor:
    torch.nn.init.zeros_(x[1:3])
    return x


def _fill_slice(x: torch.Tensor) -> torch.Tensor:
    # ``fill_`` with a number: ``x[:2] = 0.5`` would need ``fill_.Tensor``'s strategy, which
    # the ``inplace_writes`` patch provides (a tripwire checks one patch alone).
    x[:2].fill_(0.5)
    return x


def _fill_transposed_slice(x: torch.Tensor) -> torch.Tensor:
    x.t()[:, 1:3].fill_(7.0)
    return x


def _select_and_write(x: torch.Tensor) -> torch.Tensor:
    x[2].mul_(-1.0)
    return x


CASES = [
    Case(
        "nn.init.zeros_(x[1:3])", _zeros_through_view, lambda: [randn(5, 6)], ["S0"], inplace=True
    ),
    Case("x[:2].fill_(0.5)", _fill_slice, lambda: [randn(5, 6)], ["S0"], inplace=True),
    Case("x.t()[:, 1:3].fill_(7)", _fill_transposed_slice, lambda: [randn(5, 6)], ["S0"], True),
    Case("x[2].mul_(-1)", _select_and_write, lambda: [randn(4, 6)], ["S0"], True),
]


def reproduce(mesh: object) -> str | None:
    """Writes through views of sharded dims, compared after the write."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="view_writes",
    summary="writes through views that DTensor redistributed reach the tensor they came from",
    ops=("aten.slice.Tensor", "aten.select.int"),
    gate=SpecifierSet(">=2.9,!=2.10.*,!=2.11.*"),
    known_unfixable=SpecifierSet(">=2.10,<2.12"),
    registrations=_registrations,
    reproduce=reproduce,
    replicates=True,
    overrides_existing=True,
)
