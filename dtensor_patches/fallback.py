"""The safety net: any DTensor call that torch refuses runs correctly, counted and logged.

When DTensor's sharding propagation raises for a call (no strategy, propagation failed, a
redistribution it refuses, a data-dependent output shape), the miss hook in
:mod:`dtensor_patches.compat` hands the call here instead of raising
(``compat.set_call_fallback``). The fallback:

1. gathers every DTensor argument to ``Replicate()`` (``Partial`` ones are reduced);
2. runs the op once on the full local tensors, below autograd (inputs detached, no grad), so
   backward ops without a strategy take the same path: they are ops too;
3. returns DTensors that describe the data: an output with the shape of an input (``Shard``/
   ``Replicate`` only) takes that input's placements by keeping this rank's chunk, with no
   communication, so downstream code keeps its layout; any other output is ``Replicate()``;
4. for in-place and ``out=`` calls, writes this rank's shard of the full result into the
   caller's local tensor (placements kept), after the whole computation succeeded, so a failed
   call leaves every tensor as it was;
5. random ops (``Tag.nondeterministic_seeded``) run on every rank and the result of mesh
   coordinate ``(0, …, 0)`` is broadcast, so every rank holds the same values.

It runs only where torch (with the applied patches) raised: a call that torch can run is
dispatched exactly as without the library, and the decision torch caches for it is untouched.

Every fallback is counted per (op, input placements) with the bytes it gathered onto this
rank; the first one of each kind is logged (``logging.getLogger("dtensor_patches.fallback")``)
and so is the 100th, as a hot-loop note. :func:`fallback_report` lists them.

Modes (``apply_all(fallback=...)`` or ``DTENSOR_PATCHES_FALLBACK``): ``"warn"`` (default: run
and log), ``"error"`` (raise :class:`~dtensor_patches.errors.PatchError` naming the op and the
placements), ``"off"`` (torch's own error).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from dtensor_patches import compat
from dtensor_patches.errors import PatchError

__all__ = [
    "FALLBACK_ENV",
    "MODES",
    "FallbackRecord",
    "disabled",
    "fallback_report",
    "install",
    "mode",
    "reset_report",
    "resolve_mode",
    "run_fallback",
    "run_gathered",
    "uninstall",
]

log = logging.getLogger("dtensor_patches.fallback")

FALLBACK_ENV = "DTENSOR_PATCHES_FALLBACK"
"""``off``, ``warn`` or ``error``: the fallback mode, overriding ``apply_all(fallback=)``."""

MODES = ("off", "warn", "error")
HOT_LOOP_CALLS = 100
"""After this many fallbacks of one (op, placements), the log says so once."""


@dataclass
class FallbackRecord:
    """One kind of fallback: ``op`` called with DTensor inputs placed as ``placements``.

    ``calls``: how often; ``bytes``: bytes gathered onto this rank over all calls (the data
    each rank received to hold full inputs; 0 for inputs that were already replicated).
    """

    op: str
    placements: str
    calls: int = 0
    bytes: int = 0
    reason: str = ""


_LOCK = threading.Lock()
_RECORDS: dict[tuple[str, str], FallbackRecord] = {}
_MODE: list[str] = ["off"]


def resolve_mode(requested: str | None) -> str:
    """The mode in effect: ``DTENSOR_PATCHES_FALLBACK`` if set, else ``requested``, else
    ``"warn"``.

    Raises:
        ValueError: an unknown mode (from the argument or the environment).
    """
    raw = os.environ.get(FALLBACK_ENV, "").strip().lower()
    chosen = raw or (requested if requested is not None else "warn")
    if chosen not in MODES:
        where = f"{FALLBACK_ENV}={raw!r}" if raw else f"fallback={requested!r}"
        raise ValueError(f"{where}: the fallback mode is one of {', '.join(MODES)}")
    return chosen


def mode() -> str:
    """The fallback mode installed now (``"off"`` when none)."""
    return _MODE[0]


def install(chosen: str) -> None:
    """Install the fallback in mode ``chosen`` (``"off"`` removes it). Idempotent.

    With ``"warn"`` or ``"error"`` the mixed-kind grouping fixes are installed too
    (:mod:`dtensor_patches.mixed`): optimizers and ``clip_grad_norm_`` over lists that mix
    plain tensors, DTensors and several meshes.

    Raises:
        ValueError: unknown mode.
        PatchError: an internal the hook or the grouping fix needs moved (nothing changed).
    """
    from dtensor_patches import mixed

    if chosen not in MODES:
        raise ValueError(f"fallback mode is one of {', '.join(MODES)}, got {chosen!r}")
    if chosen == "off":
        uninstall()
        return
    compat.check_call_time_internals()
    mixed.install()
    try:
        compat.set_call_fallback(run_fallback)
    except BaseException:
        mixed.uninstall()
        raise
    _MODE[0] = chosen
    compat.clear_sharding_caches()


def uninstall() -> None:
    """Remove the fallback and the grouping fixes (torch's own errors again)."""
    from dtensor_patches import mixed

    compat.set_call_fallback(None)
    mixed.uninstall()
    if _MODE[0] != "off":
        compat.clear_sharding_caches()
    _MODE[0] = "off"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Switch the fallback off for the duration of a ``with`` block (this process), then
    restore the mode before it. Reproducers and tripwires run under it, so a patch is never
    called needed or fixed because of the fallback."""
    before = mode()
    uninstall()
    try:
        yield
    finally:
        if before != "off":
            install(before)


def fallback_report() -> list[FallbackRecord]:
    """The fallbacks so far in this process, most bytes first: op, input placements, calls,
    bytes gathered onto this rank (copies; the counters keep running)."""
    with _LOCK:
        rows = [FallbackRecord(**vars(r)) for r in _RECORDS.values()]
    return sorted(rows, key=lambda r: (-r.bytes, -r.calls, r.op))


def reset_report() -> None:
    """Forget the counted fallbacks (the log then says each kind once more)."""
    with _LOCK:
        _RECORDS.clear()


def _dtensor_class() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def _placements_text(leaves: list[Any]) -> str:
    dtensor = _dtensor_class()
    parts = []
    for leaf in leaves:
        if isinstance(leaf, dtensor):
            mesh = "x".join(str(s) for s in leaf.device_mesh.shape)
            parts.append(f"{list(leaf.shape)}{tuple(leaf.placements)}@{mesh}")
    return ", ".join(parts)


def _record(op: Any, placements: str, moved: int, reason: str) -> None:
    key = (str(op), placements)
    with _LOCK:
        record = _RECORDS.get(key)
        first = record is None
        if record is None:
            record = _RECORDS[key] = FallbackRecord(str(op), placements, reason=reason)
        record.calls += 1
        record.bytes += moved
        calls = record.calls
    if first:
        log.warning(
            "dtensor_patches fallback: %s on %s runs on gathered inputs (%d bytes moved to "
            "this rank); torch refused it: %s",
            op,
            placements,
            moved,
            reason,
        )
    elif calls == HOT_LOOP_CALLS:
        log.warning(
            "dtensor_patches fallback: %s on %s fell back %d times (in a loop?); see "
            "dtensor_patches.fallback_report() for the bytes moved, and a patch or another "
            "placement to avoid it",
            op,
            placements,
            calls,
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _written_arguments(op: Any) -> list[int]:
    """Positions (in the schema) of the arguments ``op`` writes: in-place ``self``, ``out=``."""
    schema = op._schema
    return [
        i
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def _is_view_op(op: Any) -> bool:
    from dtensor_patches.patches.view_writes import _is_view_op as is_view

    return bool(is_view(op))


def _is_random(op: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def _gather(value: Any) -> tuple[Any, int]:
    """The full tensor of a DTensor (detached, on every rank) and the bytes it moved here."""
    from torch.distributed.tensor import Replicate

    if not isinstance(value, _dtensor_class()):
        return value, 0
    local = compat.local_tensor(value)
    if all(isinstance(p, Replicate) for p in value.placements):
        return local.detach(), 0
    if value.numel() == 0:
        # Nothing to gather; torch 2.9's all-gather of empty uneven shards hangs on some ranks.
        return torch.empty(value.shape, dtype=value.dtype, device=local.device), 0
    full = value.detach().full_tensor()
    if value.is_contiguous() and not full.is_contiguous():
        # Gathering a Shard(d > 0) gives a permuted view on some releases (2.9); views
        # (``flatten``) of the gathered tensor must see the layout the DTensor reports.
        full = full.contiguous()
    if any(p.is_shard() for p in value.placements):
        moved = max(full.numel() - local.numel(), 0) * full.element_size()
    else:
        # Partial only: a reduction, not a gather; every rank still received a full copy.
        moved = full.numel() * full.element_size()
    return full, moved


def _scratch(original: Any, full: Any, targets: list[tuple[Any, torch.Tensor]]) -> Any:
    """Copies of a written argument's full tensors (a tensor or a list of them) for the op to
    write into; each DTensor among them is recorded in ``targets`` with its copy."""
    dtensor = _dtensor_class()
    if isinstance(full, (list, tuple)):
        return type(full)(_scratch(o, f, targets) for o, f in zip(original, full, strict=True))
    if not isinstance(full, torch.Tensor):
        return full
    copy = full.clone()
    if isinstance(original, dtensor):
        targets.append((original, copy))
    return copy


def _broadcast_from_origin(value: Any, mesh: Any) -> Any:
    """``value`` (a plain tensor) as computed on mesh coordinate (0, …, 0), on every rank."""
    import torch.distributed as dist

    if not isinstance(value, torch.Tensor):
        return value
    out = value.contiguous()
    for mesh_dim in range(mesh.ndim):
        group = mesh.get_group(mesh_dim)
        dist.broadcast(out, src=dist.get_global_rank(group, 0), group=group)
    return out


def _describe(mesh: Any, full: torch.Tensor, like: list[Any]) -> Any:
    """``full`` (identical on every rank) as a DTensor: sharded like the first input of the
    same shape whose placements are ``Shard``/``Replicate`` only, else ``Replicate()``."""
    from torch.distributed.tensor import DTensor, Replicate

    from dtensor_patches.handlers import shard_of

    placements: tuple[Any, ...] = (Replicate(),) * mesh.ndim
    for leaf in like:
        if (
            leaf.shape == full.shape
            and leaf.device_mesh == mesh
            and all(p.is_shard() or isinstance(p, Replicate) for p in leaf.placements)
        ):
            placements = tuple(leaf.placements)
            break
    local = full if all(isinstance(p, Replicate) for p in placements) else None
    if local is None:
        local = shard_of(full, mesh, placements)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def run_fallback(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], error: Exception) -> Any:
    """Run a call that DTensor refused (``error``) on gathered inputs; see the module doc.

    Raises:
        PatchError: mode ``"error"`` (naming the op and the placements), or DTensors on
            different meshes (no single mesh to describe the result on).
        Exception: whatever the op raises on the full plain tensors (the error a
            single-device run would give); nothing is written then.
    """
    dtensor = _dtensor_class()
    leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, dtensor)]
    placements = _placements_text(leaves)
    if _MODE[0] == "error":
        raise PatchError(
            f"{op} on DTensors {placements}: torch has no way to run it "
            f"({_first_line(error)}); dtensor_patches.apply_all(fallback='warn') would run it "
            "on gathered inputs"
        ) from error
    if not leaves:
        raise error
    return run_gathered(op, args, kwargs, _first_line(error), error=error)


def run_gathered(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reason: str,
    *,
    error: BaseException | None = None,
) -> Any:
    """The fallback's computation, whatever the mode (patches that gather by nature use it):
    gather, compute on full tensors, write back / describe the outputs; counted and logged
    with ``reason``.

    Raises:
        PatchError: DTensor arguments on different meshes.
        Exception: whatever the op raises on the full plain tensors; nothing is written then.
    """
    dtensor = _dtensor_class()
    leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, dtensor)]
    placements = _placements_text(leaves)
    mesh = leaves[0].device_mesh
    if any(leaf.device_mesh != mesh for leaf in leaves):
        raise PatchError(
            f"{op}: DTensor arguments on different meshes ({placements}); redistribute them "
            "onto one mesh first"
        ) from error
    moved = 0

    def gather(value: Any) -> Any:
        nonlocal moved
        full, n = _gather(value)
        moved += n
        return full

    with torch.no_grad():
        full_args = tree_map(gather, args)
        full_kwargs = tree_map(gather, kwargs)
        written = _written_arguments(op)
        targets: list[tuple[Any, torch.Tensor]] = []
        if written:
            # Compute into copies: the caller's tensors are written only once all succeeded.
            bound_names = [a.name for a in op._schema.arguments]
            for i in written:
                name = bound_names[i]
                if i < len(args):
                    original, full = args[i], full_args[i]
                    copy = _scratch(original, full, targets)
                    full_args = (*full_args[:i], copy, *full_args[i + 1 :])
                elif name in kwargs:
                    original, full = kwargs[name], full_kwargs[name]
                    copy = _scratch(original, full, targets)
                    full_kwargs = {**full_kwargs, name: copy}
        out = op(*full_args, **full_kwargs)
        if _is_random(op):
            out = tree_map(lambda v: _broadcast_from_origin(v, mesh), out)
            for n, (target, copy) in enumerate(targets):
                targets[n] = (target, _broadcast_from_origin(copy, mesh))
        _record(op, placements, moved, reason)
        if targets:
            from dtensor_patches.handlers import shard_of

            for target, copy in targets:
                if tuple(copy.shape) != tuple(target.shape):
                    # resize_ and friends: a DTensor's global shape cannot change in place.
                    raise PatchError(
                        f"{op} changes the shape of the DTensor it writes in place "
                        f"({list(target.shape)} -> {list(copy.shape)}): a DTensor's shape "
                        "cannot change in place; use the out-of-place op"
                    ) from error

            shards = [
                (target, shard_of(copy, target.device_mesh, target.placements))
                for target, copy in targets
            ]
            for target, shard in shards:
                compat.local_tensor(target).copy_(shard)
            by_copy = {id(copy): target for target, copy in targets}

            def result(v: Any) -> Any:
                if not isinstance(v, torch.Tensor):
                    return v
                return by_copy[id(v)] if id(v) in by_copy else _describe(mesh, v, leaves)

            return tree_map(result, out)
        described = tree_map(
            lambda v: _describe(mesh, v, leaves) if isinstance(v, torch.Tensor) else v, out
        )
    if args and isinstance(args[0], dtensor) and _is_view_op(op):
        # A view cannot alias across ranks: its values are a copy, and an in-place write into
        # it is carried into the tensor it was made from (inplace_writes' tracked views).
        from dtensor_patches.patches.view_writes import _track

        return _track(described, args[0], op, tuple(args[1:]), dict(kwargs))
    return described
