"""Shards of a tensor that is empty along another dim cannot be padded on 2.9: splitting,
gathering and resharding it raise, on some ranks only.

DTensor pads uneven shards to one length before a collective (``pad_tensor``: ``F.pad``).
On 2.9 ``aten.constant_pad_nd`` refuses any tensor with a zero-size dim other than the one it
pads ("The input size 0, plus negative padding 0 and 0 resulted in a negative output size";
pytorch#152750, pytorch#161014; 2.10 accepts it). So ``distribute_tensor`` of a ``[3, 0]``
tensor over ``Shard(0)`` raises, and on a 2-D mesh it raises on the ranks whose shard is empty
along one mesh dim's sharded dim and is then split along the other
(``distribute_tensor(torch.randn(5, 1), mesh_2x2, [Shard(1), Shard(0)])``: ranks 2 and 3 raise,
ranks 0 and 1 go on to the next collective and wait for ever). Gathering ``from_local``
shards of ``[2, 0]`` and ``[1, 0]`` hangs the same way on 1 rank's error.

Fix: ``pad_tensor``, where ``placement_types`` looks it up, is wrapped: an empty tensor is
padded by making the zeros of the padded shape (what ``F.pad`` gives on 2.10). Cost: one
Python frame and a ``numel()`` look per padding of an uneven shard (only on a redistribution
of uneven shards, never on a cached op's dispatch); nothing else changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, WrappedFunction

# The collectives whose uneven shards are padded (and the scatter of distribute_tensor).
OPS = (
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
)


def _pads_empty(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def pad_tensor(tensor: torch.Tensor, pad_dim: int, pad_size: int) -> torch.Tensor:
        if pad_size and tensor.numel() == 0:
            shape = list(tensor.shape)
            shape[pad_dim] += pad_size
            return tensor.new_zeros(shape)
        return original(tensor, pad_dim, pad_size)

    return pad_tensor


def _registrations() -> list[WrappedFunction]:
    return [WrappedFunction("pad_tensor", _pads_empty, "torch.distributed.tensor.placement_types")]


def reproduce(mesh: Any) -> str | None:
    """A ``[2k - 1, 0]`` tensor distributed ``Shard(0)`` over ``k`` ranks (every rank splits
    the whole tensor, so every rank raises alike: no hang), then gathered back, against the
    plain tensor's shape."""
    from torch.distributed.tensor import Shard, distribute_tensor

    parts = mesh.size()
    if parts == 1:
        return None
    full = torch.zeros(2 * parts - 1, 0)
    try:
        gathered = distribute_tensor(full, mesh, [Shard(0)]).full_tensor()
    except RuntimeError as exc:
        return (
            f"distribute_tensor of a [{2 * parts - 1}, 0] tensor over Shard(0): "
            + str(exc).splitlines()[0][:120]
        )
    return None if gathered.shape == full.shape else f"gathered shape {tuple(gathered.shape)}"


PATCH = Patch(
    name="empty_shard_padding",
    summary="uneven shards of a tensor empty along another dim are padded (2.9's F.pad refuses)",
    ops=OPS,
    gate=SpecifierSet(">=2.9,<2.10"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_issue="https://github.com/pytorch/pytorch/issues/152750",
    upstream_fix="2.10.0 (measured: constant_pad_nd accepts zero-size dims)",
    communication="none (the zeros of the padded shape, made locally)",
)
