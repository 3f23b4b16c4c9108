"""Rank functions for the context-parallel tests (run on every rank of a ``RankPool``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ppo_value.alignment import right_shift_values
from ppo_value.context_parallel import SequenceShard, gather_sequence
from ppo_value.packing import pack_sequences


def _cp_group(cp: int) -> Any:
    """The CP group of this rank: consecutive ranks ``cp`` at a time (every rank creates all
    groups, as ``new_group`` needs)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, cp):
        group = dist.new_group(list(range(start, start + cp)))
        if start <= rank < start + cp:
            mine = group
    return mine


def shift_across_shards(cp: int, length: int) -> dict[str, Any]:
    """Raw value of global column ``c`` is ``c + 1``; gathered and shifted, position ``t`` must
    read ``t`` (the raw value of ``t - 1``) everywhere, CP chunk boundaries included."""
    shard = SequenceShard.build(_cp_group(cp), torch.ones(2, length))
    local = (shard.columns.float() + 1).expand(2, -1).clone().requires_grad_()
    shifted = right_shift_values(gather_sequence(local, shard, dim=1))
    (shifted * torch.arange(length).float()).sum().backward()
    assert local.grad is not None
    return {
        "columns": shard.columns.tolist(),
        "shifted": shifted.detach()[0].tolist(),
        "grad": local.grad[0].tolist(),
    }


def packed_shift_across_shards(cp: int, lengths: list[int]) -> dict[str, Any]:
    """Packed documents of ``lengths`` in one row, sharded over CP: the shifted value is
    ``c`` (the raw value of column ``c - 1``) inside a document and 0 at each document's first
    token."""
    width = max(lengths)
    ids = torch.ones(len(lengths), width, dtype=torch.long)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    packed = pack_sequences(ids, mask, row_tokens=sum(lengths), multiple=2 * cp)
    shard = SequenceShard.build(_cp_group(cp), torch.ones(packed.shape), packed.segment_ids)
    local = shard.columns.float()[None] + 1
    shifted = packed.shift_values(gather_sequence(local, shard, dim=1))
    return {
        "shifted": shifted[0].tolist(),
        "starts": packed.seq_start[0].tolist(),
        "columns": shard.columns.tolist(),
    }
