"""Small random batches for the worker tests."""

from __future__ import annotations

import torch


def make_batch(batch: int, seq: int, *, seed: int = 0, vocab: int = 64) -> dict[str, torch.Tensor]:
    """A right-padded batch: ``input_ids``, ``attention_mask`` (lengths in ``[seq//2, seq]``),
    ``loss_mask`` (the real tokens after a 2-token prompt), ``old_values``, ``returns``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    lengths = torch.randint(max(seq // 2, 3), seq + 1, (batch,), generator=g)
    attention = (torch.arange(seq)[None] < lengths[:, None]).long()
    loss_mask = attention.clone()
    loss_mask[:, :2] = 0
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "old_values": 0.1 * torch.randn(batch, seq, generator=g),
        "returns": torch.rand(batch, seq, generator=g),
    }
