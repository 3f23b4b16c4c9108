"""Tripwires: is each patch's gate still true on the running torch?

For every patch, in fresh spawned processes with no patch applied, on a real multi-rank CPU
gloo mesh:

1. run its reproducer on stock torch: is the bug present?
2. compare with the gate: gate includes this torch but the bug is gone -> **stale** (upstream
   fixed it: narrow the gate or remove the patch); gate excludes this torch but the bug is
   present -> **gate too narrow**;
3. where the gate includes this torch, apply the patch alone and run the reproducer again: it
   must now match the single-device result -> otherwise **ineffective**. Then revert.

All of that runs with the fallback (:mod:`dtensor_patches.fallback`) off, so a patch is never
called needed or fixed because of it. On request (``fallback_alone=True``, and
:func:`run_fallback_alone` for ``dtensor-patches list --json``) the reproducer runs once more
with only the fallback on (no patch): ``fallback_alone`` says whether the fallback by itself
would have given the single-device result (informational, never part of the verdict).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["TripwireResult", "Verdict", "judge", "run_fallback_alone", "run_tripwires"]


class Verdict(str, enum.Enum):
    OK = "ok"
    STALE = "stale"
    GATE_TOO_NARROW = "gate too narrow"
    INEFFECTIVE = "ineffective"

    @property
    def passed(self) -> bool:
        return self is Verdict.OK


@dataclass(frozen=True)
class TripwireResult:
    """One patch's tripwire on the running torch.

    ``bug``: what the reproducer reported on stock torch (``None``: correct result).
    ``after_patch``: what it reported with the patch applied (``None``: fixed; not run when
    the gate excludes this torch).
    ``fallback_alone``: what it reported on stock torch with only the fallback on (``None``:
    the fallback alone gives the single-device result); informational, never part of the
    verdict.
    """

    patch: str
    torch_version: str
    gate: str
    in_gate: bool
    bug: str | None
    after_patch: str | None
    verdict: Verdict
    message: str
    fallback_alone: str | None = "not run"

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["verdict"] = self.verdict.value
        return data


def judge(
    *, patch: str, torch_version: str, in_gate: bool, bug: str | None, after_patch: str | None
) -> tuple[Verdict, str]:
    """The verdict and its message, from what the reproducer saw with and without the patch."""
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


def _on_rank(
    names: Sequence[str], gates: Mapping[str, str], with_fallback_alone: bool = False
) -> list[dict[str, object]]:
    # Runs on every rank of a RankPool; the reproducers are collective.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_patches import compat, fallback, registry

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    version = str(compat.torch_version())
    with fallback.disabled():
        return [
            _judge_on_rank(registry.get(name), name, gates, mesh, version, with_fallback_alone)
            for name in names
        ]


def _fallback_alone(patch: Any, mesh: Any) -> str | None:
    """The reproducer on stock torch with only the fallback on (then off again)."""
    from dtensor_patches import fallback

    fallback.install("warn")
    try:
        return _gather(patch.reproduce(mesh))
    finally:
        fallback.uninstall()


def _judge_on_rank(
    patch: Any,
    name: str,
    gates: Mapping[str, str],
    mesh: Any,
    version: str,
    with_fallback_alone: bool,
) -> dict[str, object]:
    if name in gates:
        patch = patch.with_gate(gates[name])
    in_gate = patch.applies_to()
    bug = _gather(patch.reproduce(mesh))
    after_patch = None
    if in_gate:
        patch.apply()
        try:
            after_patch = _gather(patch.reproduce(mesh))
        finally:
            patch.revert()
    verdict, message = judge(
        patch=name, torch_version=version, in_gate=in_gate, bug=bug, after_patch=after_patch
    )
    return TripwireResult(
        patch=name,
        torch_version=version,
        gate=str(patch.gate),
        in_gate=in_gate,
        bug=bug,
        after_patch=after_patch,
        verdict=verdict,
        message=message,
        fallback_alone=_fallback_alone(patch, mesh) if with_fallback_alone else "not run",
    ).to_dict()


def _gather(result: str | None) -> str | None:
    import torch.distributed as dist

    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    return _agree(everyone)


def run_tripwires(
    names: Sequence[str] | None = None,
    *,
    world_size: int = 2,
    gate_overrides: Mapping[str, str] | None = None,
    timeout: float = 600.0,
    fallback_alone: bool = False,
) -> list[TripwireResult]:
    """Run the tripwires of ``names`` (default: every registered patch) in fresh processes.

    Args:
        names: patch names; unknown names raise ``KeyError``.
        world_size: ranks in the CPU gloo mesh (>= 2 to exercise real sharding).
        gate_overrides: ``{name: specifier}`` to check a different gate than the registered
            one (how the tests prove a widened or narrowed gate trips).
        timeout: seconds for the whole run.
        fallback_alone: also run each reproducer with only the fallback on
            (``TripwireResult.fallback_alone``; otherwise ``"not run"``).

    Raises:
        KeyError: an unknown patch name.
        ValueError: ``world_size < 2``.
        dtensor_patches.testing.RankError: a rank crashed (the traceback is attached).
    """
    from dtensor_patches import registry
    from dtensor_patches.registry import DISABLE_ENV
    from dtensor_patches.testing import RankPool

    if world_size < 2:
        raise ValueError(f"tripwires need a multi-rank mesh, world_size >= 2, got {world_size}")
    selected = [p.name for p in registry.all_patches()] if names is None else list(names)
    for name in selected:
        registry.get(name)
    gates = dict(gate_overrides or {})
    for name in gates:
        registry.get(name)
    # The ranks apply patches one at a time themselves; the env switch must not hide any.
    with RankPool(world_size, env={DISABLE_ENV: ""}, timeout=timeout) as pool:
        per_rank = pool.run(_on_rank, selected, gates, fallback_alone)
    return [
        TripwireResult(**{**row, "verdict": Verdict(row["verdict"])})  # type: ignore[arg-type]
        for row in per_rank[0]
    ]


def _fallback_alone_on_rank(names: Sequence[str]) -> dict[str, str | None]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dtensor_patches import fallback, registry

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with fallback.disabled():
        return {name: _fallback_alone(registry.get(name), mesh) for name in names}


def run_fallback_alone(
    names: Sequence[str] | None = None, *, world_size: int = 2, timeout: float = 600.0
) -> dict[str, str | None]:
    """Each patch's reproducer on stock torch with only the fallback on, in fresh processes:
    ``{name: None}`` where the fallback alone gives the single-device result, else what the
    reproducer reported (a wrong value, or an error the fallback cannot reach).

    Raises:
        KeyError: an unknown patch name.
        dtensor_patches.testing.RankError: a rank crashed.
    """
    from dtensor_patches import registry
    from dtensor_patches.fallback import FALLBACK_ENV
    from dtensor_patches.registry import DISABLE_ENV
    from dtensor_patches.testing import RankPool

    selected = [p.name for p in registry.all_patches()] if names is None else list(names)
    for name in selected:
        registry.get(name)
    with RankPool(world_size, env={DISABLE_ENV: "", FALLBACK_ENV: ""}, timeout=timeout) as pool:
        return pool.run(_fallback_alone_on_rank, selected)[0]
