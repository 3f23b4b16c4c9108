"""The registry of patches, and ``apply_all()`` / ``revert_all()`` / ``patched()`` over it."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Collection, Iterator

from dtensor_patches import state
from dtensor_patches._text import format_gate
from dtensor_patches._torch.versions import torch_release, torch_version
from dtensor_patches.dispatch import fallback as _fallback
from dtensor_patches.errors import PatchError
from dtensor_patches.patch import Patch
from dtensor_patches.report import Outcome, Report, Status

__all__ = [
    "DISABLE_ENV",
    "RENAMED",
    "all_patches",
    "apply_all",
    "get",
    "patched",
    "plan",
    "revert_all",
]

log = logging.getLogger("dtensor_patches")

DISABLE_ENV = "DTENSOR_PATCHES_DISABLE"
"""Comma-separated patch names to switch off without code changes, or ``all``."""

RENAMED: dict[str, str] = {
    "reductions_2_9": "dim_reductions",
    "pointwise_2_10": "elementwise_strategies",
    "pointwise_gaps": "elementwise_strategies",
    "pointwise_2_11": "ne_glu_entr",
    "mse_loss": "elementwise_losses",
}
"""Former patch names -> the patch that now holds the fix. Accepted everywhere a name is
(``get``, ``only=``, ``exclude=``, ``DTENSOR_PATCHES_DISABLE``, the CLI) with a
``DeprecationWarning``, for one release."""


def all_patches() -> tuple[Patch, ...]:
    """Every registered patch, in application order.

    Raises:
        ValueError: a patch ``requires`` one that is unknown or comes after it.
    """
    from dtensor_patches.patches import BUILTIN_PATCHES

    return BUILTIN_PATCHES


def _current_name(name: str) -> str:
    new = RENAMED.get(name)
    if new is None:
        return name
    warnings.warn(
        f"dtensor_patches: patch {name!r} is now {new!r}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=4,
    )
    return new


def get(name: str) -> Patch:
    """The registered patch called ``name`` (an old name of :data:`RENAMED` warns).

    Raises:
        KeyError: no such patch (the message lists the known names).
    """
    name = _current_name(name)
    for patch in all_patches():
        if patch.name == name:
            return patch
    raise KeyError(f"no patch named {name!r}; known: {', '.join(p.name for p in all_patches())}")


def _names(names: Collection[str], where: str) -> set[str]:
    """``names`` with old names replaced by new ones.

    Raises:
        ValueError: an unknown name.
    """
    current = {_current_name(n) for n in names}
    known = {p.name for p in all_patches()}
    unknown = sorted(current - known)
    if unknown:
        raise ValueError(f"{where} names unknown patch(es) {unknown}; known: {sorted(known)}")
    return current


def _disabled_by_env() -> set[str] | None:
    """Names switched off by DTENSOR_PATCHES_DISABLE; ``None`` means all of them."""
    raw = os.environ.get(DISABLE_ENV, "").strip()
    if not raw:
        return set()
    names = {part.strip() for part in raw.split(",") if part.strip()}
    if "all" in names:
        return None
    return _names(names, f"{DISABLE_ENV}={raw!r}")


def _decide(
    patch: Patch,
    only: set[str] | None,
    exclude: set[str],
    disabled: set[str] | None,
) -> Outcome | None:
    """The outcome that needs no change to torch, or ``None`` when the patch should be applied."""
    if patch.name in exclude:
        return Outcome(patch.name, Status.EXCLUDED, "exclude=")
    if only is not None and patch.name not in only:
        return Outcome(patch.name, Status.EXCLUDED, "not in only=")
    if disabled is None or patch.name in disabled:
        return Outcome(patch.name, Status.DISABLED, f"{DISABLE_ENV}")
    if not patch.applies_to():
        return Outcome(
            patch.name,
            Status.GATED_OUT,
            f"gate {format_gate(patch.gate)} excludes {torch_release()}",
        )
    if patch.is_applied:
        return Outcome(patch.name, Status.ALREADY_APPLIED)
    if not patch.overrides_existing and len(patch.native_ops()) == len(patch.ops):
        return Outcome(
            patch.name,
            Status.SKIPPED_NATIVE,
            f"torch already has a strategy/handler for {', '.join(patch.ops)}",
        )
    return None


def _applied_reason(patch: Patch) -> str:
    native = [] if patch.overrides_existing else patch.native_ops()
    return f"left to torch: {', '.join(native)}" if native else ""


def _selection(
    only: Collection[str] | None, exclude: Collection[str]
) -> tuple[set[str] | None, set[str]]:
    if isinstance(only, str) or isinstance(exclude, str):
        raise TypeError("only= and exclude= take a collection of patch names, not a string")
    return (None if only is None else _names(only, "only=")), _names(exclude, "exclude=")


def plan(*, only: Collection[str] | None = None, exclude: Collection[str] = ()) -> Report:
    """What :func:`apply_all` would do now, without changing anything.

    Patches that would be applied are reported as ``Status.WOULD_APPLY``.
    """
    chosen, excluded = _selection(only, exclude)
    with state.LOCK:
        disabled = _disabled_by_env()
        outcomes = []
        for patch in all_patches():
            try:
                decided = _decide(patch, chosen, excluded, disabled)
            except PatchError as exc:
                decided = Outcome(patch.name, Status.FAILED, str(exc))
            outcomes.append(
                decided or Outcome(patch.name, Status.WOULD_APPLY, _applied_reason(patch))
            )
    return Report(str(torch_version()), tuple(outcomes))


def apply_all(
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    strict: bool = False,
    fallback: str | None = None,
) -> Report:
    """Apply every registered patch whose gate includes the running torch.

    Idempotent (a second call reports ``already applied`` and changes nothing, the fallback
    mode included: a call without ``fallback=`` keeps the mode an earlier call chose) and safe
    to call from several threads at once, and while other threads run DTensor ops that
    communicate on no path (ops that communicate must not run meanwhile: the patch state
    decides which collectives they make, and ranks that disagree stop pairing; see
    ``docs/known-gaps.md``). Never overrides a strategy torch already has, unless
    the patch is a wrong-result fix that exists to replace it. Each patch is all-or-nothing:
    a patch that fails leaves torch's registry exactly as it was.

    Args:
        only: apply only these patch names.
        exclude: never apply these patch names.
        strict: raise on any failure; the patches this call applied are then reverted and
            the fallback put back as it was.
        fallback: what a DTensor call that torch still refuses does (see
            :mod:`dtensor_patches.dispatch.fallback`): ``"warn"`` (the default: it runs on
            gathered inputs, logged once per op and placements, counted in
            ``dtensor_patches.fallback_report()``), ``"error"`` (a ``PatchError`` naming the op
            and the placements) or ``"off"`` (torch's own error). ``None`` keeps the mode an
            earlier ``apply_all()`` chose (since the last ``revert_all()``), else ``"warn"``.
            ``DTENSOR_PATCHES_FALLBACK`` overrides it.

    With ``DTENSOR_PATCHES_VERIFY`` set (``sample``, ``sample=0.1``, ``full``; ``,steps=N``),
    the first call also starts a run verification on this thread
    (:mod:`dtensor_patches.verify_run`): the run's DTensor calls are checked against the
    single device, mismatches logged.

    Returns:
        A :class:`~dtensor_patches.report.Report` with one outcome per registered patch.

    Raises:
        ValueError: ``only``/``exclude``/``DTENSOR_PATCHES_DISABLE`` name unknown patches, or
            an unknown fallback mode.
        PatchError: ``strict=True`` and a patch failed.
    """
    chosen, excluded = _selection(only, exclude)
    _fallback.resolve_mode(fallback)  # an unknown mode raises before anything changes
    verify_run = _verify_run_from_env()  # likewise an unreadable DTENSOR_PATCHES_VERIFY
    with state.LOCK:
        choice_before = state.FALLBACK_CHOICE.get("mode")
        fallback_mode = _fallback.resolve_mode(fallback, choice_before)
        mode_before = _fallback.mode()
        disabled = _disabled_by_env()
        outcomes: list[Outcome] = []
        newly_applied: list[Patch] = []
        for patch in all_patches():
            try:
                decided = _decide(patch, chosen, excluded, disabled)
                if decided is None:
                    reason = _applied_reason(patch)
                    patch.apply()
                    newly_applied.append(patch)
                    decided = Outcome(patch.name, Status.APPLIED, reason)
            except PatchError as exc:
                log.error("dtensor_patches: %s failed: %s", patch.name, exc)
                decided = Outcome(patch.name, Status.FAILED, str(exc))
            outcomes.append(decided)
        report = Report(str(torch_version()), tuple(outcomes))
        failures = [f"{o.name}: {o.reason}" for o in report if o.status is Status.FAILED]
        fallback_error = _install_fallback(fallback_mode)
        if fallback_error is not None:
            failures.insert(0, fallback_error)
        else:
            state.FALLBACK_CHOICE["mode"] = fallback_mode
        if strict and failures:
            for patch in reversed(newly_applied):
                patch.revert()
            _install_fallback(mode_before)
            _restore_choice(choice_before)
            raise PatchError("strict apply_all failed, nothing applied: " + "; ".join(failures))
        log.info("%s", report)
    if verify_run:
        from dtensor_patches.verify_run import start_from_env

        start_from_env()
    return report


def _verify_run_from_env() -> bool:
    """Whether ``DTENSOR_PATCHES_VERIFY`` asks for a run verification (its value is checked).

    Raises:
        ValueError: the value is not understood.
    """
    value = os.environ.get("DTENSOR_PATCHES_VERIFY", "")
    if not value.strip():
        return False
    from dtensor_patches.verify_run import parse_setting

    return parse_setting(value) is not None


def _install_fallback(mode: str) -> str | None:
    """Install the fallback in ``mode``; the error text when an internal it needs moved."""
    try:
        _fallback.install(mode)
    except PatchError as exc:
        log.error("dtensor_patches: the fallback failed to install: %s", exc)
        return f"fallback: {exc}"
    return None


def _restore_choice(choice: str | None) -> None:
    """Put back the fallback mode an argument-less ``apply_all()`` keeps (``None``: none)."""
    if choice is None:
        state.FALLBACK_CHOICE.pop("mode", None)
    else:
        state.FALLBACK_CHOICE["mode"] = choice


def _applied_patches() -> list[Patch]:
    """The applied patches, oldest first (the ledger's one record)."""
    return [owner for owner in state.LEDGER.applied() if isinstance(owner, Patch)]


def revert_all() -> list[str]:
    """Revert every applied patch, newest first, and switch the fallback off.

    Restores the exact registry entries that existed before and clears the propagation caches.
    Forgets the fallback mode chosen before: the next argument-less ``apply_all()`` uses
    ``"warn"`` again. Returns the names reverted.
    """
    with state.LOCK:
        _fallback.uninstall()
        state.FALLBACK_CHOICE.pop("mode", None)
        reverted = []
        for patch in reversed(_applied_patches()):
            if patch.revert():
                reverted.append(patch.name)
        return reverted


@contextlib.contextmanager
def patched(
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    strict: bool = False,
    fallback: str | None = None,
) -> Iterator[Report]:
    """Run a ``with`` block with exactly the selected patches applied, then restore the state
    found on entry.

    The block sees the patches ``apply_all(only=..., exclude=...)`` selects: a patch applied
    before the block that ``exclude=`` names (or ``only=`` leaves out) is reverted for the
    block and applied again on exit, so ``patched(exclude=["x"])`` means "without ``x``"
    whatever was applied earlier. Patches the block applied are reverted on exit; ones applied
    before it stay. The fallback mode before the block is restored too (and the mode a later
    argument-less ``apply_all()`` keeps).

    Raises:
        ValueError, TypeError: as :func:`apply_all` (nothing changed).
        PatchError: as :func:`apply_all` with ``strict=True`` (the patches reverted for the
            block are applied again first).
    """
    only_set, exclude_set = _selection(only, exclude)
    with state.LOCK:
        mode_before = _fallback.mode()
        choice_before = state.FALLBACK_CHOICE.get("mode")
        left_out = [
            p
            for p in _applied_patches()
            if p.name in exclude_set or (only_set is not None and p.name not in only_set)
        ]
        for patch in reversed(left_out):
            patch.revert()
    try:
        report = apply_all(only=only, exclude=exclude, strict=strict, fallback=fallback)
    except BaseException:
        _reapply(left_out)
        raise
    try:
        yield report
    finally:
        with state.LOCK:
            _fallback.install(mode_before)
            _restore_choice(choice_before)
            for name in reversed(report.applied):
                get(name).revert()
            _reapply(left_out)


def _reapply(patches: list[Patch]) -> None:
    """Apply again, oldest first, the patches a ``patched()`` block took out for its duration."""
    with state.LOCK:
        for patch in patches:
            patch.apply()
