"""Sequence packing: the sequences of a micro-batch concatenated into a few rows.

A right-padded ``[B, S]`` micro-batch of rollouts whose lengths range from tens to thousands of
tokens spends most of its compute on padding. :func:`pack_sequences` takes the valid tokens of
each sequence (``attention_mask == 1``, in order), places whole sequences into rows of at most
``row_tokens`` tokens (first-fit decreasing), and returns a :class:`PackedBatch` ``[R, T]``:

- every sequence gets position ids ``0..L-1`` (its own RoPE positions);
- every sequence attends only to itself: a block-diagonal causal mask (:meth:`PackedBatch.
  attention_mask`) for the ``sdpa`` / ``eager`` implementations, or no mask and the position ids
  alone for the varlen kernels of the ``flash_attention_*`` implementations, which
  ``transformers`` detects from position ids that restart at 0;
- ``T`` is padded to a multiple of ``multiple`` (the TP degree under sequence parallelism);
  the padding tail of a row is a segment of its own, so no row of the attention mask is empty
  (an all-masked row would give NaN in ``sdpa`` and through it NaN gradients).

:meth:`PackedBatch.shift_values` applies the ``V(s_t)`` right shift per sequence (position 0 of
every sequence gets 0, nothing crosses a packed boundary; design notes §4) and
:meth:`PackedBatch.unpack` scatters packed ``[R, T]`` values back to ``[B, S]``.

Upstream context: packing for DTensor value models is NVIDIA-NeMo/RL PR #3320 (open);
``transformers`` detects packed rows from position ids in ``masking_utils`` and the flash
attention integration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["VARLEN_IMPLEMENTATIONS", "PackedBatch", "pack_sequences"]

#: ``attn_implementation`` values whose kernels take packed rows from position ids (varlen).
VARLEN_IMPLEMENTATIONS: tuple[str, ...] = ("flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class PackedBatch:
    """Packed rows of one micro-batch and the maps back to ``[B, S]``.

    Attributes:
        input_ids: ``[R, T]`` int64; padding tails hold ``pad_token_id``.
        position_ids: ``[R, T]`` int64, restarting at 0 at every sequence (and padding tail).
        segment_ids: ``[R, T]`` int64, equal within one sequence of a row, distinct otherwise.
        seq_start: ``[R, T]`` bool, True at the first token of every segment.
        src_index: ``[N]`` int64, flat ``b * S + s`` index of every valid source token.
        dst_index: ``[N]`` int64, flat ``r * T + t`` index of the same token in the rows.
        batch_shape: ``(B, S)`` of the source micro-batch.
        num_valid_tokens: ``N``, the real (non-padding) tokens in the rows.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    seq_start: torch.Tensor
    src_index: torch.Tensor
    dst_index: torch.Tensor
    batch_shape: tuple[int, int]
    num_valid_tokens: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(R, T)``."""
        return (int(self.input_ids.shape[0]), int(self.input_ids.shape[1]))

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same packing with every tensor on ``device``."""
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            segment_ids=self.segment_ids.to(device),
            seq_start=self.seq_start.to(device),
            src_index=self.src_index.to(device),
            dst_index=self.dst_index.to(device),
            batch_shape=self.batch_shape,
            num_valid_tokens=self.num_valid_tokens,
        )

    def attention_mask(self, implementation: str) -> torch.Tensor | None:
        """The 4-D mask that ``transformers`` takes as-is for ``implementation``.

        Returns:
            ``None`` for :data:`VARLEN_IMPLEMENTATIONS` (position ids carry the boundaries);
            a bool ``[R, 1, T, T]`` block-diagonal causal mask (True = attend) for ``sdpa`` and
            others; for ``eager`` the same as an additive float32 mask (0 or the float32
            minimum), since eager attention adds the mask to the scores.
        """
        if implementation in VARLEN_IMPLEMENTATIONS:
            return None
        t = self.input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=self.input_ids.device).tril()
        same = self.segment_ids[:, :, None] == self.segment_ids[:, None, :]
        mask = (same & causal)[:, None]
        if implementation == "eager":
            additive = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
            return additive.masked_fill(~mask, torch.finfo(torch.float32).min)
        return mask

    def shift_values(self, packed: torch.Tensor) -> torch.Tensor:
        """Right-shift ``[R, T]`` head outputs by one within each sequence.

        ``out[r, t] = packed[r, t - 1]`` inside a sequence and ``0`` at its first token, so
        ``out`` is ``V(s_t)`` and no value crosses a packed boundary. Differentiable.

        Raises:
            ValueError: if ``packed`` is not ``[R, T]``.
        """
        if tuple(packed.shape) != self.shape:
            raise ValueError(f"packed values must be {self.shape}, got {tuple(packed.shape)}")
        shifted = torch.cat([torch.zeros_like(packed[:, :1]), packed[:, :-1]], dim=1)
        return torch.where(self.seq_start, torch.zeros_like(shifted), shifted)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Scatter ``[R, T]`` per-token values back to ``[B, S]``; 0 where the source was masked.

        Differentiable in ``packed``; keeps its dtype and device.

        Raises:
            ValueError: if ``packed`` is not ``[R, T]``.
        """
        if tuple(packed.shape) != self.shape:
            raise ValueError(f"packed values must be {self.shape}, got {tuple(packed.shape)}")
        b, s = self.batch_shape
        flat = packed.new_zeros(b * s)
        flat = flat.index_put((self.src_index,), packed.reshape(-1)[self.dst_index])
        return flat.view(b, s)


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices per row; longest first, each into the first row it fits."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    for row in rows:
        row.sort()  # source order within a row: deterministic and easy to read
    return rows


def pack_sequences(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    row_tokens: int | None = None,
    multiple: int = 1,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Pack the valid tokens of each sequence of ``[B, S]`` ids into rows.

    Args:
        input_ids: ``[B, S]`` int64 token ids.
        attention_mask: ``[B, S]`` 0/1 (or bool); the 1s of a row are that sequence's tokens,
            taken in order. Rows without any 1 contribute nothing (their values unpack to 0).
        row_tokens: most tokens per packed row; ``None`` puts every sequence in one row. A
            value below the longest sequence is raised to it (a sequence is never split).
        multiple: the row length ``T`` is padded up to a multiple of this (the TP degree under
            sequence parallelism).
        pad_token_id: id written into padding tails.

    Returns:
        A :class:`PackedBatch` on the device of ``input_ids``.

    Raises:
        ValueError: on mismatched or non-2-D shapes, ``multiple < 1`` or ``row_tokens < 1``.
    """
    if input_ids.dim() != 2 or tuple(input_ids.shape) != tuple(attention_mask.shape):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must be equal [B, S] shapes"
        )
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if row_tokens is not None and row_tokens < 1:
        raise ValueError(f"row_tokens must be >= 1 or None, got {row_tokens}")
    b, s = (int(n) for n in input_ids.shape)
    valid = attention_mask.bool()
    lengths = [int(n) for n in valid.sum(dim=1).tolist()]
    seqs = [i for i in range(b) if lengths[i] > 0]
    capacity = max([lengths[i] for i in seqs] + [row_tokens or sum(lengths), 1])
    rows = [
        [seqs[j] for j in row]
        for row in _first_fit_decreasing([lengths[i] for i in seqs], capacity)
    ]
    if not rows:  # nothing valid at all: one row of padding keeps the forward well-formed
        rows = [[]]
    used = max(sum(lengths[i] for i in row) for row in rows)
    t = max(used, 1)
    t += (-t) % multiple
    n_rows = len(rows)
    ids = torch.full((n_rows, t), pad_token_id, dtype=input_ids.dtype)
    pos = torch.zeros((n_rows, t), dtype=torch.long)
    seg = torch.zeros((n_rows, t), dtype=torch.long)
    start = torch.zeros((n_rows, t), dtype=torch.bool)
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    cpu_ids = input_ids.cpu()
    cpu_valid = valid.cpu()
    segment = 0
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            cols = torch.nonzero(cpu_valid[i]).flatten()
            n = int(cols.numel())
            ids[r, col : col + n] = cpu_ids[i, cols]
            pos[r, col : col + n] = torch.arange(n)
            seg[r, col : col + n] = segment
            start[r, col] = True
            src.append(i * s + cols)
            dst.append(r * t + col + torch.arange(n))
            segment += 1
            col += n
        if col < t:  # padding tail: its own segment, positions from 0
            pos[r, col:] = torch.arange(t - col)
            seg[r, col:] = segment
            start[r, col] = True
            segment += 1
    empty = torch.zeros(0, dtype=torch.long)
    device = input_ids.device
    return PackedBatch(
        input_ids=ids,
        position_ids=pos,
        segment_ids=seg,
        seq_start=start,
        src_index=torch.cat(src) if src else empty,
        dst_index=torch.cat(dst) if dst else empty,
        batch_shape=(b, s),
        num_valid_tokens=sum(lengths),
    ).to(device)
