"""Context parallelism (CP) for the critic: each micro-batch's sequence split over ``cp`` ranks.

Layout: the (padded) sequence of length ``T`` is cut into ``2 * cp`` equal chunks and CP rank
``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (head-tail load balancing, the sharding torch's
``context_parallel()`` uses for causal attention: every rank gets the same share of the causal
mask's work). Everything before attention (embedding, norms, MLP, TP + SP inside each CP rank)
runs on the local ``T / cp`` tokens with their global positions.

Attention gathers keys and values from the CP group (in global order) and runs each of the
rank's two chunks of queries against the keys up to that chunk's end, with a mask built per
layer from global column indices (additive in the compute dtype): causal, within one packed
document (segment ids), and only on valid keys. That is how a
document or padding mask survives CP; torch's ring attention (``context_parallel()``, which
:mod:`dtensor_patches.patches.nn.context_parallel_cpu` makes run on CPU) computes each key block
with ``is_causal`` only and cannot honour either. The gather's backward sums the key/value
gradients of every rank's queries back onto their owner (a reduce-scatter).

Values: the head's local ``[B, T / cp]`` outputs are gathered back to ``[B, T]`` in global order
before the ``V(s_t)`` right shift, so the value at the first position of a CP chunk comes from
the last position of the chunk before it in the global order (under head-tail sharding, not the
rank before it), and a packed document never borrows across its boundary. Every CP rank then
holds the whole micro-batch's values and computes the same loss; the gather's backward sums
the ``cp`` identical gradients, which FSDP2's mean over the ``dp x cp`` ranks divides out again.
Per layer and micro-batch CP moves the keys and values once (all-gather) and their gradients
once (reduce-scatter); the values ``[B, T]`` once each way.

Refs: Llama 3 (arXiv:2407.21783 §3.3.2, all-gather CP for document masks); torch's head-tail
load balancer (``torch.distributed.tensor.experimental._context_parallel._load_balancer``);
NVIDIA-NeMo/RL#2951 and the review of #2837 (the right shift across CP shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "SequenceShard",
    "gather_sequence",
    "load_balanced_columns",
    "register_attention",
]

ATTENTION_IMPLEMENTATION = "ppo_value_cp_sdpa"
"""The ``transformers`` attention implementation the critic's layers use under CP."""


def load_balanced_columns(length: int, cp: int, rank: int) -> torch.Tensor:
    """The global sequence columns CP rank ``rank`` holds, in its local order.

    Args:
        length: ``T``, a multiple of ``2 * cp``.
        cp: the CP degree.
        rank: this rank's index in the CP group, ``0 <= rank < cp``.

    Returns:
        ``[T / cp]`` int64: chunk ``rank`` then chunk ``2 * cp - 1 - rank`` of ``2 * cp``.

    Raises:
        ValueError: ``length`` not a multiple of ``2 * cp``, or ``rank`` out of range.
    """
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in a CP group of {cp}")
    if length % (2 * cp):
        raise ValueError(f"sequence length {length} is not a multiple of 2 * cp = {2 * cp}")
    chunk = length // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail_start = (2 * cp - 1 - rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 in rank order; backward sums each rank's gradient of every piece
    back onto its owner (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        local = local.contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        # all_gather_single is the 2.13+ name; all_gather_into_tensor warns there from 2.13
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        mine = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        # reduce_scatter_single is the 2.13+ name (gloo has the collective from 2.9 on)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(mine, grad, group=ctx.group)
        return mine, None, None


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of a CP-sharded micro-batch, the maps between the two orders, and what
    attention needs to mask its keys.

    Attributes:
        group: the CP process group.
        cp: the CP degree.
        rank: this rank's index in ``group``.
        length: ``T``, the padded global sequence length (a multiple of ``2 * cp``).
        columns: ``[T / cp]`` int64, the global columns held here (:func:`load_balanced_columns`).
        to_global: ``[T]`` int64, for the rank-order concatenation of every rank's columns, the
            index of each global column in it (the inverse permutation).
        valid: ``[B, T]`` bool, the keys that are tokens (padding is False).
        segment_ids: ``[B, T]`` int64 packed-document ids, or ``None`` (one sequence per row).
        mask_dtype: ``torch.bool`` or the floating dtype of the additive masks attention gets.
    """

    group: Any
    cp: int
    rank: int
    length: int
    columns: torch.Tensor
    to_global: torch.Tensor
    valid: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    mask_dtype: torch.dtype = torch.bool

    @classmethod
    def build(
        cls,
        group: Any,
        valid: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        mask_dtype: torch.dtype = torch.bool,
    ) -> SequenceShard:
        """The shard of ``[B, T]`` rows for this rank of ``group``.

        Args:
            group: the CP process group.
            valid: ``[B, T]`` 0/1 or bool, the keys that are tokens.
            segment_ids: ``[B, T]`` int64 packed-document ids, or ``None``.
            mask_dtype: see :attr:`mask_dtype`.

        Raises:
            ValueError: ``T`` is not a multiple of ``2 * cp``.
        """
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        length, device = int(valid.shape[1]), valid.device
        order = torch.cat([load_balanced_columns(length, cp, r) for r in range(cp)])
        return cls(
            group=group,
            cp=cp,
            rank=rank,
            length=length,
            columns=load_balanced_columns(length, cp, rank).to(device),
            to_global=torch.argsort(order).to(device),
            valid=valid.bool(),
            segment_ids=segment_ids,
            mask_dtype=mask_dtype,
        )

    @property
    def chunk(self) -> int:
        """Columns per chunk: ``T / (2 * cp)``."""
        return self.length // (2 * self.cp)

    @property
    def chunk_starts(self) -> tuple[int, int]:
        """The first global column of this rank's two chunks (head, then tail)."""
        return self.rank * self.chunk, (2 * self.cp - 1 - self.rank) * self.chunk

    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's columns of a global ``tensor`` (``T`` along ``dim``)."""
        return tensor.index_select(dim, self.columns.to(tensor.device))

    def mask(self, rows: slice = slice(None), keys: int | None = None) -> torch.Tensor:
        """The mask of this rank's queries ``rows`` (local indices) against keys ``[0, keys)``.

        Causal in the global order, within one segment, on valid keys; each query also sees
        itself, so no row is empty (a padding query's output is meaningless either way, and a
        real token's row is unchanged).

        Returns:
            ``[B, 1, rows, keys]`` in :attr:`mask_dtype`: True = attend for ``torch.bool``,
            else additive (0 = attend, the dtype's lowest value = masked).

        Raises:
            ValueError: the shard was built without ``valid``.
        """
        if self.valid is None:
            raise ValueError(
                "SequenceShard.mask needs the shard's valid keys (SequenceShard.build)"
            )
        keys = self.length if keys is None else keys
        queries = self.columns[rows].to(self.valid.device)
        key_index = torch.arange(keys, device=self.valid.device)
        allowed = (key_index[None, :] <= queries[:, None])[None] & self.valid[:, None, :keys]
        if self.segment_ids is not None:
            query_segments = self.segment_ids.index_select(1, queries)
            allowed &= query_segments[:, :, None] == self.segment_ids[:, None, :keys]
        allowed = (allowed | (key_index[None, :] == queries[:, None])[None])[:, None]
        if self.mask_dtype == torch.bool:
            return allowed
        additive = torch.zeros(allowed.shape, dtype=self.mask_dtype, device=allowed.device)
        return additive.masked_fill_(~allowed, torch.finfo(self.mask_dtype).min)


def gather_sequence(local: torch.Tensor, shard: SequenceShard, dim: int) -> torch.Tensor:
    """Every rank's columns of ``local`` (``T / cp`` along ``dim``), in the global order.

    Differentiable: the backward hands each rank the sum over all ranks of the gradient of
    its own columns. Collective over ``shard.group``.

    Returns:
        ``local`` with ``T`` along ``dim``.
    """
    moved = local.movedim(dim, 0)
    gathered = _GatherSequence.apply(moved, shard.group, shard.cp)
    ordered = gathered.index_select(0, shard.to_global.to(gathered.device))
    return ordered.movedim(0, dim)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    cp_shard: SequenceShard | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """``transformers`` attention under CP: ``query`` ``[B, H, T / cp, D]`` of this rank against
    keys/values ``[B, Hkv, T / cp, D]`` gathered to ``[B, Hkv, T, D]``, through
    ``transformers``' own SDPA attention.

    Each of the rank's two chunks attends only to the keys up to its own end (the rest is
    masked anyway), so the work is that of causal attention, balanced over the ranks by the
    head-tail layout; its mask (:meth:`SequenceShard.mask`, ``[B, 1, T / (2 cp), end]``) is
    built here, per layer, and dropped after it: no ``T / cp x T`` mask is kept for the whole
    forward. ``attention_mask`` is ignored (the critic passes ``None``). Returns
    ``([B, T / cp, H, D], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cp_shard is None:
        raise ValueError(
            f"attention implementation {ATTENTION_IMPLEMENTATION!r} needs the cp_shard keyword "
            "(the critic passes it under context parallelism)"
        )
    key = gather_sequence(key, cp_shard, dim=2)
    value = gather_sequence(value, cp_shard, dim=2)
    chunk = cp_shard.chunk
    outputs = []
    for i, start in enumerate(cp_shard.chunk_starts):  # host integers: no device sync
        end = start + chunk  # this chunk's last key + 1
        rows = slice(i * chunk, (i + 1) * chunk)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, rows],
            key[:, :, :end],
            value[:, :, :end],
            cp_shard.mask(rows, end),
            **kwargs,
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def register_attention() -> str:
    """Register the CP attention with ``transformers`` (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, _attention)
    return ATTENTION_IMPLEMENTATION
