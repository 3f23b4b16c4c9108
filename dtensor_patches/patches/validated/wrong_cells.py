"""The cells stock torch computes wrongly with no error, found by the strategy validator
(``tools/validate``), routed to the fallback's computation on the releases where they are wrong
(issue 19).

A cell (:mod:`dtensor_patches.cells`) is an op with one layout of its DTensor inputs, e.g.
``aten.squeeze.dim(S0~)``. ``data/wrong_cells.json`` holds, per release, every cell the
validator found wrong on stock torch; those that the hand-written patches leave wrong are
marked ``routed``. There is one patch per op family, ``wrong_cells_<family>``, gated to the
releases where its family has routed cells.

Condition and cost: an any-op miss rule, consulted before every other rule (``ANY_OP_FIRST``:
the routed cells are those the other rules get wrong). On a miss it looks the op up in a dict of the routed
ops of the running release (one dict lookup for every other op, on misses only: cached calls
never reach it); for a routed op it builds the cell key from the schema's specs (a few
microseconds) and, for a routed cell, runs the call through the fallback's computation
(``dispatch.gather.run_gathered``: inputs gathered, the op run once on full tensors, each
output placed back; all-or-nothing: nothing is written until the op succeeded on the full
tensors). A diverted decision is not cached, so only calls of routed cells pay it.

Tripwire: the reproducer replays every recorded call of the family's routed cells on stock
torch (:func:`dtensor_patches.cell_replay.replay`): it reports the bug while every one is
still wrong; as soon as one gives the single-device result it reports none (``dtensor-patches
check``: *stale*) and warns naming that cell (``check -v``): re-run the validator and
regenerate the table. A cell recorded on a 2x2 mesh is replayed on a 2x2 mesh of the
tripwire's ranks when there are 4 (``check --world-size 4``); on 2 ranks it is not judged
(the tripwire says so), and ``tests/test_cells.py`` replays every routed 2x2 cell on 4 ranks
instead, on every release in CI.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import dtensor_types
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.cells import (
    cell_key,
    family_patch_name,
    layout_of,
    measured_releases,
    wrong_cells,
)
from dtensor_patches.dispatch.miss_rules import ANY_OP_FIRST, DivertedCall, NativeDecision
from dtensor_patches.patch import MissRule, Patch

__all__ = ["PATCHES"]


def _specs(values: Any, spec_type: type, out: list[Any]) -> list[Any]:
    for value in values:
        if isinstance(value, (list, tuple)):
            _specs(value, spec_type, out)
        elif isinstance(value, spec_type):
            out.append(value)
    return out


def schema_cell(schema: Any) -> str:
    """The cell key of an op schema (its DTensor specs in argument order)."""
    spec_type = dtensor_types().DTensorSpec
    specs = _specs(schema.args_schema, spec_type, [])
    _specs(schema.kwargs_schema.values(), spec_type, specs)
    return cell_key(
        str(schema.op),
        (layout_of(s.placements, s.shape, s.mesh.shape) for s in specs),
    )


@functools.cache
def _routed(family: str) -> dict[Any, frozenset[str]]:
    """op overload -> the routed cell keys of ``family`` on the running release (keyed by the
    op object: the rule looks it up on every miss, a hash of the object and nothing else)."""
    table: dict[Any, set[str]] = {}
    for cell in wrong_cells():
        if cell.routed and cell.family == family:
            table.setdefault(resolve_op(cell.op), set()).add(cell.key)
    return {op: frozenset(keys) for op, keys in table.items()}


def _rule_for(family: str) -> Callable[[Any, NativeDecision], DivertedCall | None]:
    routed = _routed(family)

    def rule(schema: Any, native: NativeDecision) -> DivertedCall | None:
        keys = routed.get(schema.op)
        if keys is None:
            return None
        key = schema_cell(schema)
        if key not in keys:
            return None

        def run(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            from dtensor_patches.dispatch import gather

            return gather.run_gathered(
                op_call, tuple(args), dict(kwargs), f"known wrong cell {key}"
            )

        return run

    rule.__qualname__ = f"wrong_cells_{family}"
    return rule


def _registrations(family: str) -> Callable[[], list[MissRule]]:
    def build() -> list[MissRule]:
        return [MissRule(ANY_OP_FIRST, _rule_for(family))]

    return build


def _replay_mesh(recorded: list[int], mesh: Any) -> Any:
    """The mesh to replay a call recorded on a mesh of shape ``recorded``: the tripwire's own,
    or one of that shape over the same ranks (a 2x2 mesh when ``check`` runs 4 ranks); ``None``
    when the world has another number of ranks."""
    from dtensor_patches.testing import grid_mesh

    if list(recorded) == list(mesh.shape):
        return mesh
    try:
        return grid_mesh(tuple(recorded))
    except ValueError:  # grid_mesh's own check: the world has another number of ranks
        return None


def _reproducer(family: str) -> Callable[[Any], str | None]:
    def reproduce(mesh: Any) -> str | None:
        from dtensor_patches.cell_replay import replay

        cells = [c for c in wrong_cells() if c.routed and c.family == family and c.call]
        if not cells:
            return None
        wrong = []
        not_judged: set[str] = set()
        for cell in cells:
            recorded = cell.call["mesh"]  # type: ignore[index]
            target = _replay_mesh(recorded, mesh)
            if target is None:
                not_judged.add("x".join(map(str, recorded)))
                continue
            problem = replay(cell.call, target)  # type: ignore[arg-type]
            if problem is not None and problem.startswith("raises PatchError"):
                # With the patch on: the library's clear error where no DTensor result can
                # be right (a write that would change a DTensor's shape), not a wrong value.
                continue
            if problem is None:
                warnings.warn(
                    f"{cell.key} gives the single-device result on this release: re-run "
                    "tools/validate and regenerate data/wrong_cells.json",
                    stacklevel=1,
                )
                return None
            wrong.append(f"{cell.key}: {problem}")
        if not wrong and not_judged:
            # Every routed cell of the family here was recorded on a mesh this world cannot
            # form (``check --world-size 4`` judges 2x2 cells, ``--world-size 2`` the 1-D
            # ones; tests/test_cells.py replays both in CI). Unjudged is neither stale nor
            # ineffective: stock says why it was not judged, the patched run has nothing wrong.
            from dtensor_patches import state

            name = family_patch_name(family)  # also a copy under another gate (``--gate``)
            if any(getattr(p, "name", None) == name for p in state.LEDGER.applied()):
                return None
            return (
                f"{len(cells)} cell(s) recorded on a {'/'.join(sorted(not_judged))} mesh: not "
                f"judged on {mesh.size()} ranks"
            )
        if not wrong:
            return None
        return f"{len(wrong)} cell(s) wrong, e.g. {wrong[0]}"

    return reproduce


def _families() -> dict[str, list[str]]:
    """family -> the releases (``"2.13"``) where it has routed cells."""
    from packaging.version import Version

    out: dict[str, list[str]] = {}
    for release in measured_releases():
        for cell in wrong_cells(Version(release)):
            if cell.routed and release not in out.setdefault(cell.family, []):
                out[cell.family].append(release)
    return out


def _gate(releases: list[str]) -> SpecifierSet:
    """``>=first,<after last`` minus the measured releases in between without cells."""
    from packaging.version import Version

    ordered = sorted(releases, key=Version)
    last = Version(ordered[-1])
    parts = [f">={ordered[0]}", f"<{last.major}.{last.minor + 1}"]
    for release in measured_releases():
        if Version(ordered[0]) < Version(release) < last and release not in releases:
            parts.append(f"!={release}.*")
    return SpecifierSet(",".join(parts))


def _exact_cells_only(call: Any) -> bool:
    """``scan()`` judges these patches' calls by their exact cells (``data/wrong_cells.json``),
    never by the op alone: an op with one wrong cell has many right ones."""
    return False


def _patch(family: str, releases: list[str]) -> Patch:
    from packaging.version import Version

    ops = sorted(
        {c.op for r in releases for c in wrong_cells(Version(r)) if c.routed and c.family == family}
    )
    return Patch(
        name=family_patch_name(family),
        summary=f"{family}: cells torch's own strategies get wrong (measured by tools/validate), "
        "sent to the fallback's computation",
        ops=tuple(ops),
        gate=_gate(releases),
        registrations=_registrations(family),
        reproduce=_reproducer(family),
        concerns=_exact_cells_only,
        # Measured with it (tools/validate's stock runs keep it): replays of shards empty
        # along another dim would hang on 2.9 without it.
        requires=("empty_shard_padding",),
        upstream_fix="none recorded: measured per release by tools/validate",
        communication="the fallback's: every input gathered, for the routed cells only",
        replicates=True,
        # torch has a strategy for every one of these ops: only some of its cells are wrong.
        overrides_existing=True,
    )


PATCHES: tuple[Patch, ...] = tuple(
    _patch(family, releases) for family, releases in sorted(_families().items())
)
"""One patch per op family with routed cells on some release, in the order of the families."""
