"""Cells: an op called with one layout of its DTensor inputs, and the table of the cells that
stock torch computes wrongly on each release (issue 19).

A *cell* is what one sharding decision covers: the op overload and, for each DTensor input in
argument order (positional, then keyword), its *layout*: per mesh dim ``R`` (``Replicate()``),
``S<d>`` (``Shard(d)``, ``d`` counted from 0), ``P.<op>`` (``Partial(op)``) or ``MP``
(``_MaskPartial``), joined with ``/`` on a mesh of more than one dim; a ``~`` after ``S<d>``
marks a dim whose size the mesh dim does not divide (uneven or empty shards), which is where
many strategies go wrong. The key reads ``aten.squeeze.dim(S0~)``,
``aten.add_.Tensor(S1, R)``.

``tools/validate`` measures, on each release, which cells torch's registered strategies and
handlers get wrong (values, shape, dtype, or local shards that disagree with the spec) against
the single device, and writes them to ``data/wrong_cells.json``, each with its recorded call,
replayed alone to confirm it. The ``wrong_cells_<family>`` patches route the confirmed cells
the hand-written patches leave wrong to the fallback's computation, on the releases where
they are wrong; their tripwires (``dtensor-patches check``) replay each recorded call on stock
torch and say *stale* the day a release gets one right. :func:`dtensor_patches.verify` marks a
mismatch whose cell is in the table as known, and ``scan()`` reports recorded calls whose
cells are in it.

Pure bookkeeping: placements are read through their public attributes (``is_shard()``,
``dim``, ``reduce_op``), no private torch name is touched here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from packaging.version import Version

from dtensor_patches._torch.versions import torch_release

__all__ = [
    "WrongCell",
    "cell_key",
    "family_patch_name",
    "layout_of",
    "measured_releases",
    "release_key",
    "wrong_cells",
    "wrong_keys",
]

_TABLE = "wrong_cells.json"


def _placement_text(placement: Any, size: int | None, mesh_size: int, ndim: int) -> str:
    if placement.is_shard():
        dim = placement.dim % ndim if ndim else placement.dim
        uneven = size is not None and size % mesh_size != 0
        return f"S{dim}{'~' if uneven else ''}"
    if placement.is_replicate():
        return "R"
    if type(placement).__name__ in ("_MaskPartial", "MaskPartial"):
        return "MP"
    if placement.is_partial():
        return f"P.{getattr(placement, 'reduce_op', 'sum')}"
    return type(placement).__name__


def layout_of(placements: Sequence[Any], shape: Sequence[int], mesh_shape: Sequence[int]) -> str:
    """The layout text of one DTensor input: ``"S0~"``, ``"R/S1"``, ``"P.sum"``.

    Args:
        placements: one placement per mesh dim.
        shape: the DTensor's global shape.
        mesh_shape: the size of each mesh dim.
    """
    ndim = len(shape)
    parts = []
    for mesh_dim, placement in enumerate(placements):
        size = None
        if placement.is_shard() and ndim:
            size = int(shape[placement.dim % ndim])
        parts.append(_placement_text(placement, size, int(mesh_shape[mesh_dim]), ndim))
    return "/".join(parts)


def cell_key(op: str, layouts: Iterable[str]) -> str:
    """``"aten.squeeze.dim(S0~)"``: the op overload's name and its DTensor inputs' layouts."""
    return f"{op}({', '.join(layouts)})"


def release_key(version: Version) -> str:
    """The table's key for a torch release: ``"2.13"`` for 2.13.0 and any 2.13.x (the tables
    are measured on each minor release's first patch release)."""
    return f"{version.major}.{version.minor}"


def family_patch_name(family: str) -> str:
    """The name of the patch that routes ``family``'s cells: ``"wrong_cells_views"``."""
    slug = "".join(c if c.isalnum() else "_" for c in family.lower()).strip("_")
    return f"wrong_cells_{slug}"


@dataclass(frozen=True)
class WrongCell:
    """One cell a release's stock torch computes wrongly, as the validator recorded it.

    Attributes:
        key: the cell (:func:`cell_key`).
        op: the op overload, ``"aten.squeeze.dim"``.
        family: the op family it is reported under (reductions, views, pointwise, ...).
        problem: what differed, as :func:`~dtensor_patches.verify` said it (shape, values...).
        found_by: the ``op_db`` sample that found it: ``"<OpInfo>[<sample>] <variant>
            <placement pattern> <phase>"``.
        call: the call to replay (see ``dtensor_patches.cell_replay``), or ``None`` where it
            could not be recorded alone (then the cell has no tripwire).
        routed: ``True`` when the library's other patches leave it wrong and the patch
            ``wrong_cells_<family>`` sends it to the fallback's computation; ``False`` when a
            hand-written patch already fixes it (it is kept for the record and for ``verify``).
    """

    key: str
    op: str
    family: str
    problem: str
    found_by: str
    call: dict[str, Any] | None
    routed: bool = False


@functools.cache
def _table() -> dict[str, Any]:
    text = resources.files("dtensor_patches.data").joinpath(_TABLE).read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def wrong_cells(release: Version | None = None) -> tuple[WrongCell, ...]:
    """The cells stock torch computes wrongly on ``release`` (default: the running torch's),
    from ``data/wrong_cells.json``, on every mesh measured (1-D, then 2-D); empty for a release
    the validator has not measured.

    Raises:
        ValueError: the table is malformed.
    """
    if release is None:
        release = torch_release()
    table = _table()
    key = release_key(release)
    # The 1-D mesh's entry, then each other mesh's (a 2-D mesh's cells name one layout per
    # mesh dim, so no key of one mesh is a key of another).
    entries = [table.get("releases", {}).get(key)]
    entries += [mesh.get("releases", {}).get(key) for mesh in table.get("meshes", {}).values()]
    try:
        return tuple(
            WrongCell(
                key=c["key"],
                op=c["op"],
                family=c["family"],
                problem=c["problem"],
                found_by=c["found_by"],
                call=c.get("call"),
                routed=bool(c.get("routed", False)),
            )
            for entry in entries
            if entry is not None
            for c in entry["cells"]
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"dtensor_patches/data/{_TABLE} is malformed: {exc!r}") from exc


@functools.cache
def wrong_keys(release: Version | None = None) -> frozenset[str]:
    """The keys of :func:`wrong_cells` (cached per release)."""
    return frozenset(cell.key for cell in wrong_cells(release))


def measured_releases() -> tuple[str, ...]:
    """The releases (``"2.13"``) the table holds a measurement for."""
    return tuple(sorted(_table().get("releases", {}), key=Version))
