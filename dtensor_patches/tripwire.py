"""Tripwires: is each patch's gate still true on the running torch?

For every patch, in fresh spawned processes with no patch applied, on a real multi-rank CPU
gloo mesh:

1. run its reproducer on stock torch: is the bug present?
2. compare with the gate: gate includes this torch but the bug is gone -> **stale** (upstream
   fixed it: narrow the gate or remove the patch); gate excludes this torch but the bug is
   present -> **gate too narrow**;
3. where the gate includes this torch, apply the patch alone and run the reproducer again: it
   must now match the single-device result -> otherwise **ineffective**. Then revert.

A patch that ``requires`` others (its reproducer needs their effect) has them applied for both
runs, where their gates include this torch.

With ``fallback_alone=True`` each reproducer that fails on stock torch runs once more with only
the fallback installed (no patch): :attr:`TripwireResult.fallback_alone` says whether the
fallback alone gives the single-device result, so a patch that adds nothing over it but speed
is known. It never changes a verdict: the verdicts are judged with the fallback off.

Torch's warnings during a tripwire (Python warnings such as ``index_reduce() is in beta``, and
what torch logs, such as ``CPU process group does not support alltoall yet``) are not printed:
they are recorded in :attr:`TripwireResult.warnings`, and ``dtensor-patches check -v`` shows
them.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtensor_patches.testing import RankPool

__all__ = [
    "FallbackAlone",
    "TripwireResult",
    "Verdict",
    "WithPatch",
    "gather_result",
    "judge",
    "run_one",
    "run_tripwires",
    "start_pool",
    "with_required",
]


class Verdict(str, enum.Enum):
    """A tripwire's verdict; only ``OK`` passes."""

    OK = "ok"
    STALE = "stale"
    GATE_TOO_NARROW = "gate too narrow"
    INEFFECTIVE = "ineffective"

    @property
    def passed(self) -> bool:
        return self is Verdict.OK


class FallbackAlone(str, enum.Enum):
    """What the reproducer gave with only the fallback on (no patch applied)."""

    FIXED = "fixed"  # the single-device result: the patch adds only speed
    STILL_WRONG = "still wrong"  # ``after_fallback`` says what
    NOT_NEEDED = "not needed"  # stock torch already gives the single-device result
    NOT_RUN = "not run"  # not asked for (``fallback_alone=False``)


class WithPatch(str, enum.Enum):
    """What the reproducer gave with the patch applied."""

    FIXED = "fixed"  # the single-device result
    STILL_WRONG = "still wrong"  # ``after_patch`` says what
    NOT_RUN = "not run"  # the gate excludes this torch, so the patch was not applied


@dataclass(frozen=True)
class TripwireResult:
    """One patch's tripwire on the running torch.

    ``bug``: what the reproducer reported on stock torch (``None``: the single-device result).
    ``after_patch``: what it reported with the patch applied, when that was still wrong;
    ``None`` otherwise: :attr:`with_patch` tells ``fixed`` from ``not run``.
    ``warnings``: torch's warnings on the ranks while it ran (``"Category: message"``, each
    once); ``seconds``: wall time of this patch's run on the mesh.
    ``fallback_alone``: what the reproducer gave with only the fallback on
    (:class:`FallbackAlone`); ``after_fallback``: what was still wrong then, else ``None``.
    """

    patch: str
    torch_version: str
    gate: str
    in_gate: bool
    bug: str | None
    after_patch: str | None
    verdict: Verdict
    message: str
    warnings: tuple[str, ...] = ()
    seconds: float = 0.0
    fallback_alone: FallbackAlone = FallbackAlone.NOT_RUN
    after_fallback: str | None = None

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    @property
    def with_patch(self) -> WithPatch:
        if not self.in_gate:
            return WithPatch.NOT_RUN
        return WithPatch.FIXED if self.after_patch is None else WithPatch.STILL_WRONG

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: adds ``stock`` (``"bug"``/``"correct"``) and ``with_patch``
        (``"fixed"``/``"still wrong"``/``"not run"``), so no ``null`` is ambiguous."""
        data = asdict(self)
        data["verdict"] = self.verdict.value
        data["fallback_alone"] = self.fallback_alone.value
        data["warnings"] = list(self.warnings)
        data["stock"] = "correct" if self.bug is None else "bug"
        data["with_patch"] = self.with_patch.value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TripwireResult:
        """The inverse of :meth:`to_dict` (derived keys are ignored)."""
        return cls(
            patch=data["patch"],
            torch_version=data["torch_version"],
            gate=data["gate"],
            in_gate=data["in_gate"],
            bug=data["bug"],
            after_patch=data["after_patch"],
            verdict=Verdict(data["verdict"]),
            message=data["message"],
            warnings=tuple(data.get("warnings", ())),
            seconds=float(data.get("seconds", 0.0)),
            fallback_alone=FallbackAlone(data.get("fallback_alone", FallbackAlone.NOT_RUN.value)),
            after_fallback=data.get("after_fallback"),
        )


def judge(
    *,
    patch: str,
    torch_version: str,
    in_gate: bool,
    bug: str | None,
    after_patch: str | None,
    known_gap: bool = False,
) -> tuple[Verdict, str]:
    """The verdict and its message, from what the reproducer saw with and without the patch.

    ``known_gap``: the release is one the patch declares it cannot fix
    (``Patch.known_unfixable``): the bug is expected there, outside the gate; its absence
    means upstream fixed it and the declaration is stale.
    """
    if known_gap and not in_gate:
        if bug is None:
            return Verdict.STALE, (
                f"{patch}: torch {torch_version} is listed as a known gap but gives the "
                "single-device result: drop it from known_unfixable"
            )
        return Verdict.OK, (
            f"{patch}: known gap on torch {torch_version} (the patch cannot work there): {bug}"
        )
    if in_gate and bug is None:
        return Verdict.STALE, (
            f"{patch}: upstream fixed it in torch {torch_version} (the reproducer gives the "
            "single-device result without the patch): narrow the gate / remove the patch"
        )
    if not in_gate and bug is not None:
        return Verdict.GATE_TOO_NARROW, (
            f"{patch}: gate too narrow: torch {torch_version} is outside the gate but still "
            f"has the bug ({bug})"
        )
    if in_gate and after_patch is not None:
        return Verdict.INEFFECTIVE, (
            f"{patch}: the patch does not fix the bug on torch {torch_version}: {after_patch}"
        )
    if in_gate:
        return Verdict.OK, f"{patch}: bug present on torch {torch_version} and fixed by the patch"
    return Verdict.OK, f"{patch}: not needed on torch {torch_version}, and the gate excludes it"


def _agree(results: Sequence[str | None]) -> str | None:
    """Combine the per-rank reproducer results: a bug on any rank is a bug."""
    for rank, result in enumerate(results):
        if result is not None:
            return result if len(results) == 1 else f"[rank {rank}] {result}"
    return None


def _warning_lines(caught: Iterable[warnings.WarningMessage]) -> list[str]:
    lines: list[str] = []
    for w in caught:
        text = str(w.message).strip()
        line = f"{w.category.__name__}: {text.splitlines()[0] if text else ''}"
        if line not in lines:
            lines.append(line)
    return lines


class _Recorder(logging.Handler):
    """Keeps the warnings torch logs (``CPU process group does not support alltoall yet``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().strip()
        self.lines.append(f"{record.name}: {text.splitlines()[0] if text else ''}")


@contextlib.contextmanager
def _torch_logs_recorded() -> Iterator[_Recorder]:
    # torch's loggers print through handlers of their own (on ``torch`` and some children);
    # swap them for the recorder while a tripwire runs, then put them back.
    recorder = _Recorder()
    # The fallback's own log (``dtensor_patches.fallback``, used by patches that gather by
    # nature, such as ``as_strided``) is recorded the same way rather than printed.
    names = ["torch", "dtensor_patches"] + [
        name
        for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith("torch.") and isinstance(logger, logging.Logger) and logger.handlers
    ]
    saved: dict[str, tuple[list[logging.Handler], bool]] = {}
    for name in names:
        logger = logging.getLogger(name)
        saved[name] = (logger.handlers[:], logger.propagate)
        top = name in ("torch", "dtensor_patches")
        logger.handlers = [recorder] if top or saved[name][0] else []
        if name == "dtensor_patches":
            logger.propagate = False
    try:
        yield recorder
    finally:
        for name, (handlers, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers = handlers
            logger.propagate = propagate


def _on_rank(
    names: Sequence[str], gates: Mapping[str, str], fallback_alone: bool = False
) -> list[dict[str, object]]:
    from dtensor_patches.dispatch import fallback

    # Runs on every rank of a RankPool; the reproducers are collective.
    out = []
    for name in names:
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught, _torch_logs_recorded() as logs:
            warnings.simplefilter("always")
            # With the fallback off: a patch is never called needed or fixed because of it.
            with fallback.disabled():
                row = _one_patch(name, gates, fallback_alone)
        lines = _warning_lines(caught)
        lines += [line for line in dict.fromkeys(logs.lines) if line not in lines]
        row["warnings"] = lines
        row["seconds"] = time.perf_counter() - start
        out.append(row)
    return out


@contextlib.contextmanager
def with_required(patch: Any) -> Iterator[None]:
    """The patches ``patch`` requires applied (those whose gate includes this torch) for the
    block, and reverted after it if the block applied them."""
    from dtensor_patches import registry

    applied = []
    try:
        for name in patch.requires:
            needed = registry.get(name)
            if needed.applies_to() and needed.apply():
                applied.append(needed)
        yield
    finally:
        for needed in reversed(applied):
            needed.revert()


def _one_patch(name: str, gates: Mapping[str, str], fallback_alone: bool) -> dict[str, Any]:
    from dtensor_patches import registry
    from dtensor_patches._torch.versions import torch_version
    from dtensor_patches.dispatch import fallback
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    version = str(torch_version())
    patch = registry.get(name)
    if name in gates:
        patch = patch.with_gate(gates[name])
    reproduce = patch.reproduce_on
    in_gate = patch.applies_to()
    after_patch = None
    alone, after_fallback = FallbackAlone.NOT_RUN, None
    with with_required(patch):
        bug = gather_result(reproduce(mesh))
        if in_gate:
            patch.apply()
            try:
                after_patch = gather_result(reproduce(mesh))
            finally:
                patch.revert()
        if fallback_alone:
            alone = FallbackAlone.NOT_NEEDED
            if bug is not None:
                fallback.install("warn")
                try:
                    after_fallback = gather_result(reproduce(mesh))
                finally:
                    fallback.uninstall()
                alone = FallbackAlone.FIXED if after_fallback is None else FallbackAlone.STILL_WRONG
    verdict, message = judge(
        patch=name,
        torch_version=version,
        in_gate=in_gate,
        bug=bug,
        after_patch=after_patch,
        known_gap=patch.is_known_gap(),
    )
    return {
        "patch": name,
        "torch_version": version,
        "gate": str(patch.gate),
        "in_gate": in_gate,
        "bug": bug,
        "after_patch": after_patch,
        "verdict": verdict.value,
        "message": message,
        "fallback_alone": alone.value,
        "after_fallback": after_fallback,
    }


# registry.DISABLE_ENV, spelled out: importing the registry imports torch, and the ranks
# should start before this process spends a second on that.
_DISABLE_ENV = "DTENSOR_PATCHES_DISABLE"


def gather_result(result: str | None) -> str | None:
    """Every rank's reproducer result (:func:`~dtensor_patches.rank_texts.gather_texts`),
    combined by :func:`_agree` (collective)."""
    from dtensor_patches.rank_texts import gather_texts

    return _agree(gather_texts(result))


def start_pool(world_size: int = 2, *, timeout: float = 600.0) -> RankPool:
    """Start the ranks the tripwires run on, without waiting for them to be ready.

    The ranks import torch and join their gloo process group while the caller goes on; the
    first :func:`run_tripwires` call on the pool waits for them. Start-up warnings are kept
    in ``pool.startup_warnings`` instead of being printed. The caller closes the pool.

    Raises:
        ValueError: ``world_size < 2``.
    """
    from dtensor_patches.testing import RankPool

    if world_size < 2:
        raise ValueError(f"tripwires need a multi-rank mesh, world_size >= 2, got {world_size}")
    # The ranks apply patches one at a time themselves; the env switch must not hide any.
    return RankPool(world_size, env={_DISABLE_ENV: ""}, timeout=timeout, wait=False, quiet=True)


def run_tripwires(
    names: Sequence[str] | None = None,
    *,
    world_size: int = 2,
    gate_overrides: Mapping[str, str] | None = None,
    timeout: float = 600.0,
    pool: RankPool | None = None,
    on_result: Callable[[TripwireResult], None] | None = None,
    fallback_alone: bool = False,
) -> list[TripwireResult]:
    """Run the tripwires of ``names`` (default: every registered patch) in fresh processes.

    Args:
        names: patch names; unknown names raise ``KeyError``.
        world_size: ranks in the CPU gloo mesh (>= 2 to exercise real sharding); ignored when
            ``pool`` is given.
        gate_overrides: ``{name: specifier}`` to check a different gate than the registered
            one (how the tests prove a widened or narrowed gate trips).
        timeout: seconds for one patch's run (and for the ranks' start-up).
        pool: ranks from :func:`start_pool` to run on (left open); default: a pool started
            and closed by this call.
        on_result: called with each result as soon as it is known (progress output).
        fallback_alone: also run each reproducer that fails on stock torch with only the
            fallback on (:attr:`TripwireResult.fallback_alone`); verdicts do not change.

    Raises:
        KeyError: an unknown patch name.
        ValueError: ``world_size < 2``.
        dtensor_patches.testing.RankError: a rank crashed (the traceback is attached).
    """
    from dtensor_patches import registry

    if pool is None and world_size < 2:
        raise ValueError(f"tripwires need a multi-rank mesh, world_size >= 2, got {world_size}")
    selected = [p.name for p in registry.all_patches()] if names is None else list(names)
    for name in selected:
        registry.get(name)
    gates = dict(gate_overrides or {})
    for name in gates:
        registry.get(name)
    own = pool is None
    if pool is None:
        pool = start_pool(world_size, timeout=timeout)
    try:
        results = []
        for name in selected:
            result = run_one(pool, name, gates, fallback_alone=fallback_alone)
            results.append(result)
            if on_result is not None:
                on_result(result)
        return results
    finally:
        if own:
            pool.close()


def run_one(
    pool: RankPool,
    name: str,
    gates: Mapping[str, str] | None = None,
    *,
    fallback_alone: bool = False,
) -> TripwireResult:
    """Run one patch's tripwire on ``pool``; warnings from every rank are merged.

    Raises:
        dtensor_patches.testing.RankError: a rank crashed.
    """
    per_rank = pool.run(_on_rank, [name], dict(gates or {}), fallback_alone)
    row = dict(per_rank[0][0])
    merged: list[str] = []
    for rank_rows in per_rank:
        for line in rank_rows[0]["warnings"]:  # type: ignore[union-attr]
            if line not in merged:
                merged.append(line)
    row["warnings"] = merged
    return TripwireResult.from_dict(row)
