"""What ``verify()`` checks across ranks before it gathers anything for a call: that every rank
agrees on each DTensor input's global spec, and that each plain tensor beside DTensors (taken
as ``Replicate()`` under ``implicit_replication()``) holds the same values on every rank.

A DTensor built with ``from_local`` on shards of different lengths without ``shape=`` leaves
the ranks disagreeing on its global shape (issue 18); the next collective over it aborts gloo
or mis-sizes. ``verify()`` cannot gather such an input to check the op, so it raises
:class:`~dtensor_patches.verify_report.VerifyError` naming the input before anything runs.
A plain tensor that differs between ranks is reported as a mismatch (a silent wrong: DTensor
took it as the same value everywhere).

Cost, per checked call: one all-gather of 32 integers per mesh dim longer than 1 (the first
DTensor input's mesh; two for calls of more than 30 tensors), and a checksum of each plain
tensor argument.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch

from dtensor_patches.mesh_rows import gather_rows

__all__ = ["PLAIN_DIFFERS", "SPEC_DIFFERS", "rank_disagreement"]

SPEC_DIFFERS = 1
PLAIN_DIFFERS = 2


def _spec_code(x: Any) -> int:
    text = f"{tuple(x.shape)} {tuple(x.stride())} {tuple(map(str, x.placements))} {x.dtype}"
    return zlib.crc32(text.encode())


def _value_code(t: torch.Tensor) -> int:
    data = t.detach().contiguous().cpu()
    if data.dtype in (torch.bfloat16, torch.float16):
        data = data.float()  # NumPy has no bfloat16; the values survive the widening
    return zlib.crc32(data.numpy().tobytes()) if data.numel() else 0


def rank_disagreement(dtensors: Sequence[Any], plain: Sequence[torch.Tensor]) -> tuple[int, str]:
    """``(flags, text)``: ``flags`` 0 when every rank of the first DTensor's mesh agrees on each
    DTensor input's (shape, stride, placements, dtype) and on each plain tensor's values; else
    the bits :data:`SPEC_DIFFERS` and :data:`PLAIN_DIFFERS` (checked only where the specs
    agree) with a description. Every rank of the mesh gets the same ``flags``. Collective."""
    if not dtensors:
        return 0, ""
    mesh = dtensors[0].device_mesh
    specs = [_spec_code(x) for x in dtensors]
    values = [_value_code(t) for t in plain]
    flag = 0
    detail = ""
    for mesh_dim in reversed(range(mesh.ndim)):
        if mesh.size(mesh_dim) == 1:
            continue
        table = gather_rows(mesh, mesh_dim, [flag, len(specs), *specs, *values])
        for row in table:
            flag |= row[0]
        if any(row[1 : 2 + len(specs)] != table[0][1 : 2 + len(specs)] for row in table):
            flag |= SPEC_DIFFERS
            detail = detail or (
                f"the ranks along mesh dim {mesh_dim} disagree on the global spec of the "
                "DTensor inputs (shape, stride, placements, dtype): this rank has "
                + "; ".join(f"{tuple(x.shape)} {tuple(x.placements)}" for x in dtensors)
            )
        elif any(row[2 + len(specs) :] != table[0][2 + len(specs) :] for row in table):
            flag |= PLAIN_DIFFERS
            detail = detail or (
                f"a plain tensor beside DTensors differs between the ranks along mesh dim "
                f"{mesh_dim} (shapes {[list(t.shape) for t in plain]}): DTensor took it as "
                "Replicate(), the same on every rank"
            )
    if flag and not detail:
        detail = "another rank of the mesh found its inputs disagreeing (see its report)"
    return flag, detail
