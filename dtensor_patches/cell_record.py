"""A DTensor call as data (a *record*): captured where :func:`dtensor_patches.verify` finds a
mismatch (``keep_calls=True``), stored in ``data/wrong_cells.json`` by ``tools/validate``, and
replayed by a cell's tripwire (:mod:`dtensor_patches.cell_replay`; issue 19).

The record holds the op's name and every argument: a DTensor input as its full (global) value,
dtype and layout (:func:`dtensor_patches.cells.layout_of`, 1-D and N-D meshes), a plain tensor
as its value, and Python numbers, bools, strings, ``None``, dtypes and lists of them as
themselves. A replay rebuilds each DTensor on the given mesh from its full value: ``Shard`` and
``Replicate`` cut on each rank (``dispatch.shards.distributed_locally``, no communication);
``Partial(sum)`` as the full value divided by the mesh size on every rank, ``Partial(avg)`` as
the full value on every rank, ``Partial(max)`` / ``Partial(min)`` as the full value on mesh
coordinate 0 and one less / more elsewhere. Calls
with a ``_MaskPartial`` input, complex values, or more than :data:`MAX_ELEMENTS` elements are
not recorded (``capture`` returns ``None``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch

from dtensor_patches._torch.dtensors import dtensor_class
from dtensor_patches.cells import layout_of

__all__ = ["MAX_ELEMENTS", "NotRecordable", "capture", "decode", "partial_local", "placements_of"]

MAX_ELEMENTS = 4096
"""The most tensor elements a recorded call holds (keeps the shipped table small)."""


_REBUILDABLE = re.compile(r"R|S\d+~?|P\.(sum|avg|max|min)")


class NotRecordable(Exception):
    """The call holds a value the record cannot hold."""


def _number(value: float) -> Any:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _encode(value: Any, full: Any, mesh_shape: list[int] | None) -> Any:
    dtensor = dtensor_class()
    if isinstance(value, torch.Tensor):
        tensor = full if isinstance(value, dtensor) else value
        if tensor.is_complex() or tensor.layout != torch.strided:
            raise NotRecordable("complex or non-strided tensor")
        record: dict[str, Any] = {
            "tensor": [_number(float(v)) for v in tensor.detach().reshape(-1).tolist()]
            if tensor.is_floating_point()
            else tensor.detach().reshape(-1).tolist(),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
        }
        if isinstance(value, dtensor):
            mesh = list(value.device_mesh.shape)
            if mesh_shape is not None and mesh_shape and mesh_shape != mesh:
                raise NotRecordable("DTensors on different meshes")
            if mesh_shape is not None and not mesh_shape:
                mesh_shape.extend(mesh)
            layout = layout_of(value.placements, value.shape, mesh)
            if not all(_REBUILDABLE.fullmatch(part) for part in layout.split("/")):
                raise NotRecordable(f"layout {layout} (only R, S<d>, P.<op> are rebuilt)")
            record["layout"] = layout
        return record
    if isinstance(value, torch.dtype):
        return {"dtype_value": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return {"list": [_encode(v, f, mesh_shape) for v, f in zip(value, full, strict=True)]}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": _number(value)}
    raise NotRecordable(f"argument of type {type(value).__name__}")


def capture(
    op: str, args: Any, kwargs: Any, full_args: Any, full_kwargs: Any
) -> dict[str, Any] | None:
    """The record of the call ``op(*args, **kwargs)`` (``full_*``: the same trees with every
    DTensor replaced by its full value), or ``None`` where it cannot be recorded."""
    mesh_shape: list[int] = []
    try:
        encoded_args = [_encode(a, f, mesh_shape) for a, f in zip(args, full_args, strict=True)]
        encoded_kwargs = {k: _encode(v, full_kwargs[k], mesh_shape) for k, v in kwargs.items()}
    except (NotRecordable, ValueError):
        return None
    elements = _elements(encoded_args) + _elements(list(encoded_kwargs.values()))
    if elements > MAX_ELEMENTS or not mesh_shape:
        return None
    return {"op": op, "mesh": mesh_shape, "args": encoded_args, "kwargs": encoded_kwargs}


def _elements(records: list[Any]) -> int:
    total = 0
    for record in records:
        if isinstance(record, dict) and "tensor" in record:
            total += len(record["tensor"])
        elif isinstance(record, dict) and "list" in record:
            total += _elements(record["list"])
    return total


def _float(value: Any) -> float:
    return float(value)  # also "nan", "inf", "-inf"


def placements_of(layout: str) -> list[Any]:
    """The placements (one per mesh dim) of a layout text (``"S0~/P.sum"``).

    Raises:
        ValueError: a part is not ``R``, ``S<d>`` or ``P.<op>`` (``_MaskPartial`` cannot be
            rebuilt from a full value).
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    out: list[Any] = []
    for part in layout.split("/"):
        if part == "R":
            out.append(Replicate())
        elif part.startswith("S"):
            out.append(Shard(int(part[1:].rstrip("~"))))
        elif part.startswith("P."):
            out.append(Partial(part[2:]))
        else:
            raise ValueError(f"layout {layout!r}: cannot rebuild {part!r}")
    return out


def partial_local(full: torch.Tensor, placements: Sequence[Any], mesh: Any) -> torch.Tensor:
    """This rank's share of ``full`` under ``placements``' ``Partial`` mesh dims (see the module
    doc: sum divides, avg repeats, max/min offset the other coordinates)."""
    local = full
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_partial():
            continue
        op = placement.reduce_op
        first = coordinate[mesh_dim] == 0
        if op == "sum":
            local = local / mesh.size(mesh_dim) if local.is_floating_point() else local
            if not local.is_floating_point() and not first:
                local = torch.zeros_like(local)
        elif op == "max" and not first:
            local = local - 1
        elif op == "min" and not first:
            local = local + 1
    return local


def decode(value: Any, mesh: Any) -> Any:
    """A recorded argument as a value on ``mesh``: DTensors rebuilt from their full value and
    layout (see the module doc), every rank at once."""
    from torch.distributed.tensor import DTensor, Replicate

    from dtensor_patches.dispatch.shards import distributed_locally, shard_of

    if isinstance(value, dict):
        if "tensor" in value:
            dtype = getattr(torch, value["dtype"])
            data = (
                [_float(v) for v in value["tensor"]] if dtype.is_floating_point else value["tensor"]
            )
            full = torch.tensor(data, dtype=dtype).reshape(value["shape"])
            layout = value.get("layout")
            if layout is None:
                return full
            placements = placements_of(layout)
            if not any(p.is_partial() for p in placements):
                return distributed_locally(full, mesh, placements)
            # Shard first (a replicated spec with the shards' dims), then the partial shares.
            plain = [Replicate() if p.is_partial() else p for p in placements]
            local = partial_local(shard_of(full, mesh, plain).contiguous(), placements, mesh)
            return DTensor.from_local(
                local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
            )
        if "dtype_value" in value:
            return getattr(torch, value["dtype_value"])
        if "list" in value:
            return [decode(v, mesh) for v in value["list"]]
        if "float" in value:
            return _float(value["float"])
    return value
