"""What a patch is: its ops, its torch gate, its upstream references, what it needs and concerns,
how to apply, revert and reproduce it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dtensor_patches import state
from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.dtensors import check_internals
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches._torch.versions import release_of, torch_release
from dtensor_patches.calls import CallPredicate, needs_sharded_inputs
from dtensor_patches.dispatch import registration
from dtensor_patches.dispatch.cache_key import CacheKey
from dtensor_patches.dispatch.handler import ContextParallelHandler, Handler, LossParallelHandler
from dtensor_patches.dispatch.miss_rules import MissRule
from dtensor_patches.dispatch.registration import Registration
from dtensor_patches.dispatch.strategy import Strategy
from dtensor_patches.dispatch.tracked_views import TrackViews
from dtensor_patches.dispatch.wrappers import WrappedFunction
from dtensor_patches.errors import PatchError
from dtensor_patches.reproducers import Case, run_cases

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "REGISTRY_LOCK",
    "CacheKey",
    "ContextParallelHandler",
    "Handler",
    "LossParallelHandler",
    "MissRule",
    "Patch",
    "Registration",
    "Reproducer",
    "Strategy",
    "TrackViews",
    "WrappedFunction",
]

log = logging.getLogger("dtensor_patches")

REGISTRY_LOCK = state.LOCK
"""The one lock around every change to torch's tables (``dtensor_patches.state.LOCK``)."""

Reproducer = Callable[["DeviceMesh"], "str | None"]
"""Runs collectively on every rank of a mesh, with no patch of its own applied by the caller
(only those it ``requires``), and says what is wrong: ``None`` when the result equals the
single-device computation, else a one-line description of the failure or mismatch."""


def _release(version: Version | str | None) -> Version:
    return torch_release() if version is None else release_of(version)


@dataclass(eq=False)
class Patch:
    """One version-gated fix for a DTensor gap.

    Attributes:
        name: short identifier, used by ``only=``/``exclude=``, the CLI and
            ``DTENSOR_PATCHES_DISABLE``; names what the patch fixes, not a release.
        summary: one line on what the patch fixes.
        ops: the operators it touches, as ``"namespace.op.overload"`` strings. Every variant
            (in-place, ``out=``, other overloads) that needs the fix is listed.
        gate: torch releases the patch is for, compared against the release the running torch
            is or leads up to (``2.9.0a0+git…`` and ``2.9.1+cu130`` count as 2.9.0 and 2.9.1).
        registrations: builds the registrations to install (strategies, handlers, miss rules,
            tracked views, wrapped functions; :mod:`dtensor_patches.dispatch`). Called at
            apply time only, so importing the registry touches no torch internals.
        reproduce: the reproducer (see :data:`Reproducer`); defaults to judging ``cases``.
        cases: the triggers the default reproducer runs (:class:`~dtensor_patches.reproducers.Case`);
            benchmarks run them too.
        concerns: which recorded calls (``scan()``) are the case this patch fixes, from their
            placements (:mod:`dtensor_patches.calls`); default: any call with sharded inputs.
        requires: patches whose effect this one's reproducer needs (the tripwire applies them
            first; the registry orders them before this one).
        upstream_issue: the torch issue that reports the bug, when known.
        upstream_fix: the torch PR (and release) that fixed it, when known.
        communication: what the fix moves between ranks, against the lower bound of the
            computation (the patch table shows it; ``benchmarks/patch_costs.py`` counts it).
        replicates: ``True`` when the fix moves data to ``Replicate()`` instead of keeping a
            sharding; the patch table shows it.
        overrides_existing: ``True`` for fixes that replace a strategy torch already registers
            (wrong-result backports). Without it, an op that already has a strategy is never
            overridden and the patch is reported as skipped.
        out_variants: also register each strategy for its op's ``out=`` overload
            (``cumprod.out``, ``logsumexp.out``, ``mean.out``…) where torch has none, or where
            the patch overrides torch's. DTensor runs an ``out=`` call like the functional one
            and gives the ``out`` DTensor the output placements.
        known_unfixable: releases outside the gate that still have the bug, where this patch
            cannot work (a torch mechanism it relies on is missing there). The tripwire accepts
            the bug there and reports it as a known gap.

    Raises:
        ValueError: an invalid name, no ops, or neither ``reproduce`` nor ``cases``.
        TypeError: ``gate`` is not a ``SpecifierSet``.
    """

    name: str
    summary: str
    ops: tuple[str, ...]
    gate: SpecifierSet
    registrations: Callable[[], Sequence[Registration]]
    reproduce: Reproducer | None = None
    cases: Sequence[Case] = ()
    concerns: CallPredicate = needs_sharded_inputs
    requires: tuple[str, ...] = ()
    upstream_issue: str | None = None
    upstream_fix: str | None = None
    communication: str = ""
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
        if self.reproduce is None:
            if not self.cases:
                raise ValueError(f"patch {self.name!r} has neither a reproducer nor cases")
            cases = tuple(self.cases)
            self.reproduce = lambda mesh: run_cases(mesh, cases)

    def reproduce_on(self, mesh: DeviceMesh) -> str | None:
        """Run the reproducer on ``mesh`` (collectively, on every rank): ``None`` when the
        result equals the single-device computation, else what is wrong."""
        assert self.reproduce is not None  # filled in from ``cases`` at construction
        return self.reproduce(mesh)

    def applies_to(self, version: Version | str | None = None) -> bool:
        """Whether the gate includes ``version`` (default: the running torch).

        Pre-release, dev and local labels are dropped before comparing.
        """
        return self.gate.contains(_release(version), prereleases=True)

    def is_known_gap(self, version: Version | str | None = None) -> bool:
        """Whether ``version`` (default: the running torch) is a declared known gap."""
        if self.known_unfixable is None:
            return False
        return self.known_unfixable.contains(_release(version), prereleases=True)

    def with_gate(self, gate: SpecifierSet | str) -> Patch:
        """A copy of this patch with another gate (unapplied). Used to test the tripwires."""
        return dataclasses.replace(self, gate=SpecifierSet(str(gate)))

    @property
    def is_applied(self) -> bool:
        """Whether this patch's entries are installed (the ledger keeps the one record)."""
        return state.LEDGER.is_applied(self)

    def native_ops(self) -> list[str]:
        """The ops of this patch that torch (or someone else) already covers.

        Raises:
            PatchError: an op or a registry internal is missing.
        """
        found = []
        for name in self.ops:
            op = resolve_op(name)
            if torch_tables.has_native_strategy(op) or torch_tables.has_native_handler(op):
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
        with state.LOCK:
            if self.is_applied:
                return False
            try:
                keep_native = set() if self.overrides_existing else set(self.native_ops())
                wanted = self._wanted(list(self.registrations()), keep_native)
                registration.install(self, wanted)
            except BaseException as exc:
                if isinstance(exc, PatchError) or not isinstance(exc, Exception):
                    raise
                raise PatchError(f"patch {self.name!r} failed to install: {exc!r}") from exc
            log.info("dtensor_patches: applied %s (%s)", self.name, ", ".join(self.ops))
            return True

    def _wanted(
        self, registrations: list[Registration], keep_native: set[str]
    ) -> list[Registration]:
        """The registrations to install: those not about ops torch covers, plus the ``out=``
        strategies derived from them (see ``out_variants``).

        Raises:
            PatchError: a registration concerns an op not in ``ops``.
        """
        if any(not isinstance(r, Strategy) for r in registrations):
            check_internals()
        for r in registrations:
            stray = [op for op in r.concerns if op not in self.ops]
            if stray:
                raise PatchError(
                    f"patch {self.name!r} registers {', '.join(stray)}, which is not in its "
                    "ops list"
                )
        wanted = [r for r in registrations if not r.concerns or not set(r.concerns) <= keep_native]
        if self.out_variants:
            for r in registrations:
                if not isinstance(r, Strategy) or r.op in keep_native:
                    continue
                derived = r.out_variant(overriding=self.overrides_existing)
                if derived is not None and derived.op not in self.ops:
                    wanted.append(derived)
        return wanted

    def revert(self) -> bool:
        """Take this patch's entries out again: each op falls back to what it was before, or
        to another applied patch's entry on a shared op.

        Returns ``False`` if the patch was not applied. The patch counts as reverted even when
        clearing the caches afterwards raises (its entries are already out).

        Raises:
            PatchError: a propagation cache moved (the entries are restored regardless).
        """
        with state.LOCK:
            if not self.is_applied:
                return False
            log.info("dtensor_patches: reverting %s", self.name)
            registration.remove(self)
            return True

    def installed(self) -> list[str]:
        """The keys of every entry this patch holds now (op names, rule keys, function
        names), as strings, sorted: what the compatibility matrix records as its installs."""
        return sorted({str(key) for (_table, key) in state.LEDGER.owned(self)})
