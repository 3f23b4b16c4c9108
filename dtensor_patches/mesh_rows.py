"""Small integer rows exchanged between the ranks of one mesh dim: what ``from_local`` of uneven
shards and ``verify()``'s cross-rank checks need (local shapes, spec checksums, error flags).

Rows may differ in length between ranks (a caller's mistake that the exchange must report,
not turn into a gloo abort): each row travels in a fixed-width slot with its length, and only
when some rank's row does not fit is a second, wide enough exchange made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["gather_rows"]

_WIDTH = 32  # integers per slot: shapes (ndim + a few) and a call's inputs fit in one exchange


def gather_rows(mesh: Any, mesh_dim: int, row: Sequence[int]) -> list[list[int]]:
    """Every row of the ranks along ``mesh_dim`` of ``mesh`` (this rank's among them), in mesh
    coordinate order, each with its own length. Collective over that mesh dim's group: one
    all-gather of ``32`` int64 (two when a row is longer than 30).

    Raises:
        RuntimeError: from ``torch.distributed`` (no process group, a rank gone).
    """
    import torch.distributed as dist

    parts = mesh.size(mesh_dim)
    group = mesh.get_group(mesh_dim)
    device = torch.device(mesh.device_type)
    values = [int(mesh.get_local_rank(mesh_dim)), len(row), *(int(v) for v in row)]

    def exchange(width: int) -> list[list[int]]:
        mine = torch.zeros(width, dtype=torch.int64, device=device)
        kept = values[:width]
        mine[: len(kept)] = torch.tensor(kept, dtype=torch.int64, device=device)
        slots = [torch.empty_like(mine) for _ in range(parts)]
        dist.all_gather(slots, mine, group=group)
        return [slot.tolist() for slot in slots]

    table = exchange(_WIDTH)
    longest = max(slot[1] for slot in table)
    if longest + 2 > _WIDTH:  # every rank sees the same table, so all of them exchange again
        table = exchange(longest + 2)
    table.sort(key=lambda slot: slot[0])
    return [slot[2 : 2 + slot[1]] for slot in table]
