"""The safety net: any DTensor call that torch refuses runs correctly, counted and logged.

When DTensor's sharding propagation raises for a call (no strategy, propagation failed, a
redistribution it refuses, a data-dependent output shape), the dispatch hook hands the call to
:func:`run_fallback` instead of raising, which runs it with the gather engine
(:func:`dtensor_patches.dispatch.gather.run_gathered`: gathered inputs, one computation on
full tensors below autograd, outputs placed like the inputs of their shape, in-place targets
written shard by shard after the computation succeeded).

It runs only where torch (with the applied patches) raised: a call that torch can run is
dispatched exactly as without the library, and the decision torch caches for it is untouched.

Modes (``apply_all(fallback=...)`` or ``DTENSOR_PATCHES_FALLBACK``): ``"warn"`` (default: run
and log), ``"error"`` (raise :class:`~dtensor_patches.errors.PatchError` naming the op and the
placements), ``"off"`` (torch's own error). With the fallback on, the mixed-kind fixes
(:mod:`dtensor_patches.dispatch.mixed`) are on too.

The fallback is an owner in the ledger like a patch: installing it is all or nothing, and
removing it puts back exactly what torch had.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from dtensor_patches import state
from dtensor_patches._torch.dtensors import check_internals, dtensor_class
from dtensor_patches._torch.schemas import tree_flatten
from dtensor_patches.dispatch import fallback_budget, mixed, registration, scalar_reads
from dtensor_patches.dispatch.fallback_report import FallbackRecord, fallback_report, reset_report
from dtensor_patches.dispatch.gather import placements_text, run_gathered
from dtensor_patches.dispatch.miss_rules import ensure_hook
from dtensor_patches.errors import PatchError, first_line
from dtensor_patches.ledger import EntryKey

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
    "uninstall",
]

FALLBACK_ENV = "DTENSOR_PATCHES_FALLBACK"
"""``off``, ``warn`` or ``error``: the fallback mode, overriding ``apply_all(fallback=)``."""

MODES = ("off", "warn", "error")


class _Fallback:
    """The ledger owner of the fallback's entries."""

    name = "fallback"

    def __repr__(self) -> str:
        return "<dtensor_patches fallback>"


FALLBACK = _Fallback()


def resolve_mode(requested: str | None, previous: str | None = None) -> str:
    """The mode in effect: ``DTENSOR_PATCHES_FALLBACK`` if set, else ``requested``, else
    ``previous`` (the mode an earlier ``apply_all()`` chose, so that an argument-less call
    keeps it), else ``"warn"``.

    Raises:
        ValueError: an unknown mode (from the argument or the environment).
    """
    raw = os.environ.get(FALLBACK_ENV, "").strip().lower()
    default = previous if previous is not None else "warn"
    chosen = raw or (requested if requested is not None else default)
    if chosen not in MODES:
        where = f"{FALLBACK_ENV}={raw!r}" if raw else f"fallback={requested!r}"
        raise ValueError(f"{where}: the fallback mode is one of {', '.join(MODES)}")
    return chosen


def mode() -> str:
    """The fallback mode installed now (``"off"`` when none)."""
    return str(state.FALLBACK.get("mode", "off"))


def run_fallback(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], error: Exception) -> Any:
    """Run a call that DTensor refused (``error``) on gathered inputs.

    Raises:
        RankLocalCallError: some ranks of the mesh made another call, or none (the call is
            made on some ranks only); nothing is gathered.
        FallbackBudgetError: the call would gather more than the fallback's budget
            (:mod:`.fallback_budget`); nothing is gathered.
        PatchError: mode ``"error"`` (naming the op and the placements), or DTensors on
            different meshes (no single mesh to describe the result on).
        Exception: whatever the op raises on the full plain tensors (the error a
            single-device run would give); nothing is written then.
    """
    dtensor = dtensor_class()
    leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, dtensor)]
    if state.FALLBACK.get("mode") == "error":
        raise PatchError(
            f"{op} on DTensors {placements_text(leaves)}: torch has no way to run it "
            f"({first_line(error)}); dtensor_patches.apply_all(fallback='warn') would run it "
            "on gathered inputs"
        ) from error
    if not leaves:
        raise error
    scalar_reads.check_same_call(op, leaves)
    fallback_budget.check(op, leaves, placements_text(leaves))
    return run_gathered(op, args, kwargs, first_line(error), error=error)


@dataclass(frozen=True)
class _FallbackSetting:
    """The fallback's own table entry (``key``: ``"call"`` or ``"mode"``)."""

    key: str
    value: Any
    kind: ClassVar[str] = "fallback"

    @property
    def concerns(self) -> tuple[str, ...]:
        return ()

    def entries(self) -> Sequence[EntryKey]:
        return [(state.FALLBACK_TABLE, self.key)]

    def install(self) -> None:
        if self.key == "call":
            ensure_hook()
        state.FALLBACK[self.key] = self.value


def install(chosen: str) -> None:
    """Install the fallback in mode ``chosen`` (``"off"`` removes it). Idempotent; all or
    nothing.

    Raises:
        ValueError: unknown mode.
        PatchError: an internal the hook or a mixed-kind fix needs moved (nothing changed).
    """
    if chosen not in MODES:
        raise ValueError(f"fallback mode is one of {', '.join(MODES)}, got {chosen!r}")
    with state.LOCK:
        if chosen == "off":
            uninstall()
            return
        if state.LEDGER.is_applied(FALLBACK):
            if mode() == chosen:
                return
            uninstall()
        check_internals()
        registration.install(
            FALLBACK,
            [
                *mixed.registrations(),
                _FallbackSetting("plain_checked", True),
                _FallbackSetting("mode", chosen),
                _FallbackSetting("call", run_fallback),
            ],
        )


def uninstall() -> None:
    """Remove the fallback and the mixed-kind fixes (torch's own errors again)."""
    with state.LOCK:
        if state.LEDGER.is_applied(FALLBACK):
            registration.remove(FALLBACK)


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
