"""What a patch is: its ops, its torch gate, its upstream references, how to apply, revert and reproduce it."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dtensor_patches import compat
from dtensor_patches.errors import PatchError

__all__ = ["Handler", "MissRule", "Patch", "Registration", "Strategy"]

log = logging.getLogger("dtensor_patches")

# One lock for every change to torch's registry: patches may share torch's dicts.
REGISTRY_LOCK = threading.RLock()


@dataclass(frozen=True)
class Strategy:
    """Register ``fn(op_schema) -> OpStrategy | TupleStrategy`` as ``op``'s sharding strategy.

    ``schema_info`` is a ``RuntimeSchemaInfo`` naming the non-tensor arguments that change the
    decision (dims, flags); without it the propagation cache reuses one decision for all of them.
    """

    op: str
    fn: Callable[[Any], Any]
    schema_info: Any = None

    def install(self) -> None:
        compat.register_strategy(compat.resolve_op(self.op), self.fn, self.schema_info)


@dataclass(frozen=True)
class Handler:
    """Route ``op`` on DTensors to ``fn(op_call, args, kwargs)``, before sharding propagation.

    For ops that fail inside shape propagation (data-dependent output shapes), where no
    strategy is ever consulted.
    """

    op: str
    fn: Callable[..., object]

    def install(self) -> None:
        compat.register_custom_handler(compat.resolve_op(self.op), self.fn)


@dataclass(frozen=True)
class MissRule:
    """Consult ``fn(op_schema, native)`` when a call of ``op`` meets sharding propagation
    without a cached decision (see ``compat.register_miss_rule``).

    ``native`` is torch's own decision (a ``compat.NativeDecision``, computed on demand).
    ``fn`` returns ``None`` to keep it (cached as usual: later calls with that schema stay on
    torch's fast path) or a function ``(op_call, args, kwargs) -> output`` that runs the call
    instead (never cached). For fixes that only some calls of a common op need: the condition
    is checked once per distinct schema, not on every call.
    """

    op: str  # "namespace.op.overload", or compat.ANY_OP for a rule that sees every op
    fn: Callable[[Any, Any], Any]

    def key(self) -> Any:
        """The miss-rule table key: the op, or ``compat.any_op_key(fn)`` for every op."""
        return compat.any_op_key(self.fn) if self.op == compat.ANY_OP else _key(self.op)

    def install(self) -> None:
        compat.register_miss_rule(self.key(), self.fn)


def _key(name: str) -> Any:
    return compat.resolve_op(name)


def _keys_of(registration: Any) -> list[Any]:
    """The registry keys a registration changes: its op's, or what it declares itself with a
    ``keys()`` method (registrations of entries not keyed by an op, e.g. a torch function
    that a patch wraps)."""
    if isinstance(registration, MissRule):
        return [registration.key()]
    keys = getattr(registration, "keys", None)
    return list(keys()) if callable(keys) else [_key(registration.op)]


Registration = Strategy | Handler | MissRule

# A reproducer runs collectively on every rank of a mesh, with no patch of its own applied
# by the caller, and says what is wrong: ``None`` when the result is correct (equal to the
# single-device computation), otherwise a one-line description of the failure or mismatch.
Reproducer = Callable[[Any], "str | None"]


@dataclass(eq=False)
class Patch:
    """One version-gated fix for a DTensor gap.

    Attributes:
        name: short identifier, used by ``only=``/``exclude=``, the CLI and
            ``DTENSOR_PATCHES_DISABLE``.
        summary: one line on what the patch fixes.
        ops: the operators it touches, as ``"namespace.op.overload"`` strings. Every variant
            (in-place, ``out=``, other overloads) that needs the fix is listed.
        gate: torch releases the patch is for, compared against
            :func:`dtensor_patches.compat.torch_release` (pre-release, dev and local labels
            dropped, so ``2.9.0a0+git…`` and ``2.9.1+cu130`` count as 2.9.0 and 2.9.1).
        registrations: builds the strategies/handlers to install. Called at apply time only,
            so importing the registry touches no torch internals.
        reproduce: the reproducer (see ``Reproducer``): runs on a multi-rank mesh, returns
            ``None`` when the result is right and a description of the bug otherwise.
        upstream_issue: the torch issue that reports the bug, when known.
        upstream_fix: the torch PR (and release) that fixed it, when known.
        replicates: ``True`` when the fix moves data to ``Replicate()`` instead of keeping a
            sharding; the README's patch table shows it.
        overrides_existing: ``True`` for fixes that replace a strategy torch already registers
            (wrong-result backports). Without it, an op that already has a strategy is never
            overridden and the patch is reported as skipped.
        out_variants: also register each strategy for its op's ``out=`` overload
            (``cumprod.out``, ``logsumexp.out``, ``mean.out``…, found by
            :func:`dtensor_patches.compat.out_variant`) where torch has none, or where the patch
            overrides torch's. DTensor runs an ``out=`` call like the functional one and gives
            the ``out`` DTensor the output placements.
        known_unfixable: releases outside the gate that still have the bug, where this patch
            cannot work (a torch mechanism it relies on is missing there). The tripwire accepts
            the bug there and reports it as a known gap; the README lists it.
    """

    name: str
    summary: str
    ops: tuple[str, ...]
    gate: SpecifierSet
    registrations: Callable[[], Sequence[Registration]]
    reproduce: Reproducer
    upstream_issue: str | None = None
    upstream_fix: str | None = None
    replicates: bool = False
    overrides_existing: bool = False
    out_variants: bool = True
    known_unfixable: SpecifierSet | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"patch name must be a non-empty identifier, got {self.name!r}")
        if not self.ops:
            raise ValueError(f"patch {self.name!r} lists no ops")
        if not isinstance(self.gate, SpecifierSet):
            raise TypeError(f"patch {self.name!r}: gate must be a packaging SpecifierSet")

    def applies_to(self, version: Version | str | None = None) -> bool:
        """Whether the gate includes ``version`` (default: the running torch).

        Pre-release, dev and local labels are dropped before comparing.
        """
        if version is None:
            release = compat.torch_release()
        else:
            release = Version(Version(str(version)).base_version)
        return self.gate.contains(release, prereleases=True)

    def is_known_gap(self, version: Version | str | None = None) -> bool:
        """Whether ``version`` (default: the running torch) is a declared known gap."""
        if self.known_unfixable is None:
            return False
        release = (
            compat.torch_release()
            if version is None
            else Version(Version(str(version)).base_version)
        )
        return self.known_unfixable.contains(release, prereleases=True)

    def with_gate(self, gate: SpecifierSet | str) -> Patch:
        """A copy of this patch with another gate (unapplied). Used to test the tripwires."""
        return dataclasses.replace(self, gate=SpecifierSet(str(gate)))

    @property
    def is_applied(self) -> bool:
        """Whether this patch's entries are installed (``compat`` keeps the one record)."""
        return compat.is_applied(self)

    def native_ops(self) -> list[str]:
        """The ops of this patch that torch (or someone else) already covers.

        Raises:
            PatchError: an op or a registry internal is missing.
        """
        found = []
        for name in self.ops:
            op = compat.resolve_op(name)
            if compat.has_native_strategy(op) or compat.has_native_handler(op):
                found.append(name)
        return found

    def apply(self) -> bool:
        """Install the patch. Returns ``False`` if it was already applied (nothing changes).

        Ops that torch already supports (a strategy or handler is registered) are left alone,
        unless ``overrides_existing``. Every private internal the patch's handlers use at call
        time is checked first, so a release that moved one fails here, not mid-training.
        All-or-nothing: on any failure every entry the patch changed is put back (other
        patches' entries on shared ops stay) and the caches are cleared; an ``Exception``
        becomes :class:`PatchError`, ``KeyboardInterrupt``/``SystemExit`` propagate as they are.

        Raises:
            PatchError: building or installing a registration failed (torch left untouched).
        """
        with REGISTRY_LOCK:
            if self.is_applied:
                return False
            # Ops torch already covers are left to torch, unless this patch exists to replace
            # a wrong upstream strategy.
            keep_native = set() if self.overrides_existing else set(self.native_ops())
            try:
                registrations = list(self.registrations())
                if any(not isinstance(r, Strategy) for r in registrations):
                    compat.check_call_time_internals()
                for registration in registrations:
                    if registration.op not in self.ops and registration.op != compat.ANY_OP:
                        raise PatchError(
                            f"patch {self.name!r} registers {registration.op}, "
                            "which is not in its ops list"
                        )
                derived = self._out_variant_registrations(registrations, keep_native)
                wanted = [r for r in registrations if r.op not in keep_native] + derived
                changed: list[Any] = []
                for registration in wanted:
                    changed += compat.install_owned(
                        self, _keys_of(registration), registration.install
                    )
                compat.clear_sharding_caches()
                compat.mark_applied(self, changed)
            except BaseException as exc:
                compat.remove_owner(self)
                compat.clear_sharding_caches()
                if isinstance(exc, PatchError) or not isinstance(exc, Exception):
                    raise
                raise PatchError(f"patch {self.name!r} failed to install: {exc!r}") from exc
            log.info("dtensor_patches: applied %s (%s)", self.name, ", ".join(self.ops))
            return True

    def _out_variant_registrations(
        self, registrations: Sequence[Registration], keep_native: set[str]
    ) -> list[Strategy]:
        """Strategies for the ``out=`` overloads of this patch's strategy ops (see
        ``out_variants``); ops listed in ``ops`` are the patch's own business."""
        if not self.out_variants:
            return []
        derived = []
        for registration in registrations:
            if not isinstance(registration, Strategy) or registration.op in keep_native:
                continue
            name = compat.out_variant(registration.op)
            if name is None or name in self.ops:
                continue
            op = compat.resolve_op(name)
            if compat.has_single_dim_strategy(op):
                continue  # would be ignored by DTensor (2.11+): torch's stays in charge
            if compat.has_native_strategy(op) and not self.overrides_existing:
                continue
            derived.append(Strategy(name, registration.fn, registration.schema_info))
        return derived

    def revert(self) -> bool:
        """Take this patch's entries out again: each op falls back to what it was before, or
        to another applied patch's entry on a shared op.

        Returns ``False`` if the patch was not applied. The patch counts as reverted even when
        clearing the caches afterwards raises (its entries are already out).

        Raises:
            PatchError: a propagation cache moved (the entries are restored regardless).
        """
        with REGISTRY_LOCK:
            if not self.is_applied:
                return False
            compat.remove_owner(self)
            log.info("dtensor_patches: reverted %s", self.name)
            compat.clear_sharding_caches()
            return True
