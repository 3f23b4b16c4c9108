"""Tracked views: a view that DTensor had to redistribute, whose writes reach the tensor it was
made from.

Slicing a sharded dim (``w[:2]`` of a ``Shard(0)`` ``w``) makes DTensor gather a temporary
first; the view's local tensor points into that temporary, and a write into it never reaches
``w`` (measured on every release 2.9 to 2.15). A :class:`TrackedView` is a ``DTensor`` subclass
that records how it was made: its ops dispatch through its own ``__torch_dispatch__``, which
unwraps it and, for an op that writes into it, computes the write on a scratch copy, replays
the recorded view op on the gathered source to find the region, and writes the source's new
shards into the source's own local tensor. Chains of such views are followed to the first
untracked source (the *root*). Nothing is written until every step has succeeded.

Every op on a tracked view first gives it the root's current values (the root gathered once
per call, the recorded view ops replayed on it): a write into the base after the view was made
(``v = x[1:3]; x.mul_(2)``) shows in ``v`` and in what ``v``'s writes carry back, as on one
device. All the views of one root that a call writes (``aminmax(y, 0, out=(x[0], x[1]))``)
are written into one full copy of the root, so that every write lands. View ops that return a
list (``unbind``, ``split``, ``chunk``) make tracked views too, one per piece. Every rank must
run the same ops on its tracked views (each is a collective), as with any DTensor op.

Two things make tracked views: the :class:`TrackViews` registration (a miss rule for every op,
acting on view ops whose input torch's own decision must redistribute), and the gather engine
for view ops it runs. Only tracked views pay for the tracking; cached calls (ordinary slices
that need no redistribution) pay nothing.

torch 2.10 and 2.11 dispatch DTensor subclasses through the C++ fast path without calling
their ``__torch_dispatch__`` (measured; 2.12 honours it again, 2.9 is Python). There a tracked
view also defines ``__torch_function__``, which torch calls before dispatch for any Python call
with a tracked view among its arguments: the call runs under :func:`tracking_mode_class`'s mode,
which sends each aten op with a tracked view to the tracked path. A write torch makes inside its
own C++ code (``x[1:3] = v``: ``__setitem__`` slices and copies in C++) reaches no Python there.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from dtensor_patches import state
from dtensor_patches._torch.dispatch_hook import DivertedCall, NativeDecision
from dtensor_patches._torch.dtensors import (
    dtensor_class,
    dtensor_types,
    has_internal_overlap,
    local_tensor,
    rewrap,
    set_local,
    shares_storage,
)
from dtensor_patches._torch.modes import subclass_torch_function_disabled
from dtensor_patches._torch.schemas import (
    argument_names,
    is_view_op,
    tree_flatten,
    tree_unflatten,
    writes_self,
    written_positions,
)
from dtensor_patches._torch.versions import subclass_dispatch_honoured
from dtensor_patches.dispatch.miss_rules import any_op_key, ensure_hook
from dtensor_patches.dispatch.shards import gather_full, shard_of
from dtensor_patches.errors import LostWriteError
from dtensor_patches.ledger import EntryKey

if TYPE_CHECKING:
    from dtensor_patches._torch.types import OpSchema

__all__ = [
    "TrackViews",
    "is_tracked",
    "region_in",
    "track",
    "tracked_view_class",
    "view_record",
    "view_rule",
]


@functools.cache
def tracked_view_class() -> type:
    """The ``TrackedView`` class (a ``DTensor`` subclass, built on first use so that importing
    this module does not import ``torch.distributed.tensor``)."""

    class TrackedView(dtensor_class()):  # type: ignore[misc]
        """A DTensor view whose local tensor lives in a temporary (its input was
        redistributed): an op that writes into it is carried into the tensor the view was made
        from, as on a single device."""

        dtensor_patches_view_of: tuple[Any, Any, tuple[Any, ...], dict[str, Any], int | None]

        @classmethod
        def __torch_dispatch__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            return _dispatch_tracked(func, args, kwargs or {})

    if not subclass_dispatch_honoured():
        # torch 2.10/2.11 run DTensor subclasses through the C++ fast path without calling
        # __torch_dispatch__. __torch_function__ runs before that dispatch, and only for calls
        # that have a tracked view among their arguments: such a call runs under a dispatch
        # mode that sends every aten op with a tracked view to the tracked path. Every other
        # call (no tracked view) pays nothing.
        mode_class = tracking_mode_class()

        def torch_function(
            cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            with mode_class(), subclass_torch_function_disabled():
                return func(*args, **(kwargs or {}))

        TrackedView.__torch_function__ = classmethod(torch_function)
    return TrackedView


@functools.cache
def tracking_mode_class() -> type:
    """A dispatch mode that sends each aten op with a tracked view among its arguments to the
    tracked path and lets every other op through (torch 2.10/2.11, see
    :func:`tracked_view_class`)."""
    from dtensor_patches._torch.modes import dispatch_mode_class

    class TrackingMode(dispatch_mode_class()):  # type: ignore[misc]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            flat, _ = tree_flatten((args, kwargs))
            if any(is_tracked(a) for a in flat):
                return _dispatch_tracked(func, args, kwargs)
            return func(*args, **kwargs)

    return TrackingMode


def is_tracked(value: object) -> bool:
    """Whether ``value`` is a tracked view."""
    return isinstance(value, tracked_view_class())


def _record(view: Any) -> tuple[Any, Any, tuple[Any, ...], dict[str, Any], int | None]:
    """``(source, view op, other args, kwargs, output index)`` of a tracked view."""
    return view.dtensor_patches_view_of


def view_record(
    value: object,
) -> tuple[Any, Any, tuple[Any, ...], dict[str, Any], int | None] | None:
    """``(source, view op, other args, kwargs, output index)`` of a tracked view, else ``None``."""
    return _record(value) if is_tracked(value) else None


def region_in(full_source: torch.Tensor, record: Any) -> torch.Tensor:
    """The view ``record`` (a :func:`view_record`) describes, replayed on the plain
    ``full_source``: a view of it.

    Raises:
        LostWriteError: the replay fails or is not a view of ``full_source``.
    """
    return _region(record, full_source, write=True)


def track(out: Any, source: Any, op_call: Any, rest: tuple[Any, ...], kwargs: Any) -> Any:
    """``out`` (a DTensor view, or a list/tuple of them, of ``source`` made by ``op_call``) as
    tracked views of ``source``."""
    dtensor = dtensor_class()

    def one(value: Any, index: int | None) -> Any:
        if not isinstance(value, dtensor):
            return value
        tracked = rewrap(value, cls=tracked_view_class())
        tracked.dtensor_patches_view_of = (source, op_call, rest, kwargs, index)
        return tracked

    if isinstance(out, (list, tuple)):
        return type(out)(one(v, i) for i, v in enumerate(out))
    return one(out, None)


def _dispatch_tracked(func: Any, args: Any, kwargs: Any) -> Any:
    flat, spec = tree_flatten((args, kwargs))
    views = {id(a): a for a in flat if is_tracked(a)}
    roots = _refresh(list(views.values()))
    plain = [rewrap(a) if is_tracked(a) else a for a in flat]
    plain_args, plain_kwargs = tree_unflatten(plain, spec)
    written = _written_views(func, args, kwargs)
    if written:
        return _write_through(func, args, plain_args, plain_kwargs, written, roots)
    out = func(*plain_args, **plain_kwargs)
    if is_view_op(func) and args and is_tracked(args[0]):
        return track(out, args[0], func, tuple(args[1:]), dict(kwargs))
    return out


# Set while a tracked view's own view is being made from the redistributed input, so that the
# rule leaves that inner call to torch (per thread: dispatch is per thread).
_MAKING = threading.local()


def _maker(wanted: tuple[Any, ...]) -> DivertedCall:
    def run(op_call: Any, args: Any, kwargs: Any) -> Any:
        source = args[0]
        # Not ``source.detach()``: detach is a view op too, and some releases redistribute
        # for it (``_NormPartial`` on 2.15), which would come back here.
        plain = rewrap(source)
        _MAKING.active = True
        try:
            with torch.no_grad():
                moved = plain.redistribute(source.device_mesh, wanted)
                out = op_call(moved, *args[1:], **kwargs)
        finally:
            _MAKING.active = False
        return track(out, source, op_call, tuple(args[1:]), dict(kwargs))

    return run


def _is_spec(value: Any) -> bool:
    return isinstance(value, dtensor_types().DTensorSpec)


def view_rule(schema: OpSchema, native: NativeDecision) -> DivertedCall | None:
    """The miss rule: a view op whose input torch's decision redistributes makes a tracked view
    (made from the redistributed input, with torch's own decision for that inner call)."""
    op = schema.op
    args = schema.args_schema
    if getattr(_MAKING, "active", False):
        return None
    if not (is_view_op(op) and args and _is_spec(args[0])):
        return None
    sharding = native.sharding()
    if sharding is None or not sharding.needs_redistribute:
        return None
    moved = sharding.redistribute_schema
    source: Any = args[0]
    target: Any = moved.args_schema[0] if moved is not None else None
    if not _is_spec(target):
        return None
    wanted = tuple(target.placements)
    if wanted == tuple(source.placements):
        return None
    return _maker(wanted)


@dataclass(frozen=True)
class TrackViews:
    """Make tracked views of every view op whose input DTensor must redistribute (a miss rule
    for every op, :func:`view_rule`)."""

    kind: ClassVar[str] = "tracked views"

    @property
    def concerns(self) -> tuple[str, ...]:
        return ()

    def entries(self) -> Sequence[EntryKey]:
        return [(state.MISS_RULES_TABLE, any_op_key(view_rule))]

    def install(self) -> None:
        ensure_hook()
        state.MISS_RULES[any_op_key(view_rule)] = view_rule


# --- writes into tracked views ---------------------------------------------------------


def _written_views(func: Any, args: Any, kwargs: Any) -> list[tuple[str, int | None, Any]]:
    """The tracked views ``func`` writes into: ``(where, index, view)``, ``where`` is
    ``"arg"``/``"kwarg:name"``."""
    found: list[tuple[str, int | None, Any]] = []
    names = argument_names(func)
    for i in written_positions(func):
        if i < len(args):
            value, where, index = args[i], "arg", i
        elif names[i] in kwargs:
            value, where, index = kwargs[names[i]], f"kwarg:{names[i]}", None
        else:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if is_tracked(v):
                found.append((where, index, v))
    return found


def _chain(view: Any) -> tuple[Any, list[Any]]:
    """``(root, records)``: the first untracked tensor up the chain of sources of ``view``, and
    the records of the view ops that make ``view`` from it, root first."""
    records = []
    node = view
    while is_tracked(node):
        record = _record(node)
        records.append(record)
        node = record[0]
    return node, records[::-1]


def _gather_root(root: Any) -> torch.Tensor:
    """The full value of ``root`` (an untracked DTensor) as a fresh plain tensor, in the layout
    it reports (a collective on every rank of its mesh)."""
    full, _ = gather_full(rewrap(root))
    if shares_storage(full, local_tensor(root)):
        full = full.clone()  # Replicate(): the local tensor itself
    return full


def _replay(full_root: torch.Tensor, records: list[Any], *, write: bool) -> torch.Tensor:
    """The recorded view ops replayed on the plain full root, root first: the view's value (and,
    for ``write=True``, its place in ``full_root``).

    Raises:
        LostWriteError: ``write=True`` and a replayed op fails or is not a view of its input.
    """
    region = full_root
    for record in records:
        region = _region(record, region, write=write)
    return region


def _region(record: Any, full_source: torch.Tensor, *, write: bool = True) -> torch.Tensor:
    """The recorded view op replayed on the plain full source: the view's place in it.

    Raises:
        LostWriteError: ``write`` and the replay fails or is not a view into ``full_source``.
    """
    _, op_call, rest, kwargs, index = record
    if not write:
        region = op_call(full_source, *rest, **kwargs)
        return region[index] if index is not None else region
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
    if not shares_storage(region, full_source):
        raise LostWriteError(
            f"in-place write into a view made by {op_call} from a redistributed DTensor: on a "
            "plain tensor that op does not return a view, so the write has no place in the "
            "base. Write into the base directly."
        )
    return region


def _refresh(views: list[Any]) -> dict[int, tuple[Any, torch.Tensor]]:
    """Give every tracked view among ``views`` the current values of its root (the tensor it
    was made from, through the whole chain): a write into the root after the view was made
    (``v = x[1:3]; x.mul_(2)``) must show in ``v``, as on one device (issue 23, item 5).

    Each root is gathered once (a collective on every rank: every rank runs the same ops on its
    tracked views); each view's local tensor is overwritten with its shard of the recorded view
    ops replayed on it. Returns ``{id(root): (root, full root)}`` for the writes that follow.
    """
    roots: dict[int, tuple[Any, torch.Tensor]] = {}
    if not views:
        return roots
    with torch.no_grad():
        for view in views:
            root, records = _chain(view)
            if id(root) not in roots:
                roots[id(root)] = (root, _gather_root(root))
            value = _replay(roots[id(root)][1], records, write=False)
            local = local_tensor(view)
            fresh = shard_of(value, view.device_mesh, view.placements)
            if tuple(fresh.shape) != tuple(local.shape):
                continue
            if has_internal_overlap(local):
                set_local(view, fresh)
            else:
                local.copy_(fresh)
    return roots


def _write_through(
    func: Any,
    args: Any,
    plain_args: Any,
    plain_kwargs: Any,
    written: list[tuple[str, int | None, Any]],
    roots: dict[int, tuple[Any, torch.Tensor]],
) -> Any:
    """Run ``func`` on scratch copies of the written views, write each new value into its place
    in the full root (all views of one root into the same full tensor, so that two views of one
    base written by one call both land: ``aminmax(y, 0, out=(x[0], x[1]))``, issue 23, item
    12), then write every local tensor at once (nothing changes if a step fails).

    Raises:
        LostWriteError: a written view has no place in its root (nothing is written).
    """
    scratch: dict[int, Any] = {}
    for where, index, view in written:
        copy = rewrap(view, local=local_tensor(view).clone())
        scratch[id(view)] = copy
        if where == "arg" and index is not None:
            plain_args = (*plain_args[:index], copy, *plain_args[index + 1 :])
        else:
            name = where.split(":", 1)[1]
            plain_kwargs = {**plain_kwargs, name: copy}
    with torch.no_grad():
        out = func(*plain_args, **plain_kwargs)
        writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        touched: dict[int, tuple[Any, torch.Tensor]] = {}
        for _, _, view in written:
            new = scratch[id(view)]
            root, records = _chain(view)
            touched[id(root)] = roots[id(root)]
            _replay(roots[id(root)][1], records, write=True).copy_(new.full_tensor())
            writes.append((local_tensor(view), local_tensor(new)))
        for root, full_root in touched.values():
            writes.append(
                (local_tensor(root), shard_of(full_root, root.device_mesh, root.placements))
            )
        for destination, value in writes:
            destination.copy_(value)
    if writes_self(func):
        return args[0]
    by_id = {id(scratch[id(view)]): view for _, _, view in written}

    def back(value: Any) -> Any:
        return by_id.get(id(value), value)

    if isinstance(out, (list, tuple)):
        return type(out)(back(v) for v in out)
    return back(out)
