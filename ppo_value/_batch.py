"""Validation of the batches and arguments :class:`ppo_value.worker.ValueWorker` receives.

Runs on each rank before any collective; the worker then has every rank agree
(:func:`ppo_value._agree.agree`), so bad data on one dp rank is one clear ``ValueError`` on all
ranks instead of an error on one and a hang in a collective on the others.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ppo_value._checks import as_bool_mask, check_finite_at

__all__ = ["INFER_KEYS", "TRAIN_KEYS", "check_batch", "check_micro_batch_size"]

INFER_KEYS = ("input_ids", "attention_mask")
TRAIN_KEYS = ("input_ids", "attention_mask", "loss_mask", "old_values", "returns")


def check_micro_batch_size(value: int | None, default: int) -> int:
    """``value``, or ``default`` when it is ``None``.

    Raises:
        ValueError: ``value`` is not a positive int (0 used to mean the default silently, and a
            negative size skipped every micro-batch).
    """
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"micro_batch_size must be a positive int or None, got {value!r}")
    return value


def _check_loss_within_attention(loss: torch.Tensor, attention: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``loss_mask`` (bool ``[B, S]``) is 1 where ``attention_mask``
    (bool) is 0: a loss on a position that is no token of the sequence. The padded forward
    computes a meaningless value there and packing none (0), so the two would train
    differently (issue 23 item 18)."""
    outside = loss & ~attention
    if bool(outside.any()):
        pos = tuple(int(i) for i in outside.nonzero()[0])
        raise ValueError(
            f"loss_mask is 1 at position {pos} where attention_mask is 0 "
            f"({int(outside.sum())} such position(s)); a loss needs a token of the sequence: "
            "set loss_mask to 0 wherever attention_mask is 0"
        )


def _check_right_padded(attention: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every row of ``attention`` (bool ``[B, S]``) is right-padded:
    its 1s, then only 0s. Packing takes a sequence's tokens as one run with positions
    ``0..L-1``; the padded forward counts columns, so a hole or left padding would give other
    positions, values and gradients packed than padded (issue 23 item 18)."""
    rises = attention[:, 1:] & ~attention[:, :-1]  # a 0 followed by a 1
    if bool(rises.any()):
        b = int(rises.any(dim=1).nonzero()[0])
        row = attention[b]
        zero = int((~row).nonzero()[0])
        one = zero + int(row[zero:].nonzero()[0])
        raise ValueError(
            f"attention_mask of sequence {b} is not right-padded (0 at column {zero} before a 1 "
            f"at column {one}; {int(rises.any(dim=1).sum())} such sequence(s)): sequence "
            "packing needs each sequence's tokens first and padding after them (holes and left "
            "padding would change the positions); right-pad the batch or set "
            "sequence_packing=False"
        )


def check_batch(
    batch: Mapping[str, torch.Tensor],
    keys: tuple[str, ...],
    vocab_size: int,
    *,
    packed: bool = False,
) -> int:
    """Check a ``get_values`` (``INFER_KEYS``) or ``train`` (``TRAIN_KEYS``) batch.

    Every tensor ``[B, S]`` of one shape and non-empty; ``input_ids`` integer token ids in
    ``[0, vocab_size)``; masks 0/1; ``loss_mask`` 0 wherever ``attention_mask`` is 0;
    ``old_values`` and ``returns`` floating and finite where ``loss_mask`` is 1 (NaN/inf at
    masked positions is allowed and ignored downstream). With ``packed`` (sequence packing)
    every ``attention_mask`` row is right-padded: no hole, no left padding. A sequence without
    any token is allowed.

    Returns:
        ``B``.

    Raises:
        ValueError: naming the key (and the position for out-of-vocabulary ids, non-finite
            values and a ``loss_mask`` outside the ``attention_mask``; the sequence and columns
            for a mask packing cannot honour).
    """
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"batch is missing keys {missing}; needs {list(keys)}")
    not_tensors = [k for k in keys if not isinstance(batch[k], torch.Tensor)]
    if not_tensors:
        raise ValueError(f"batch values must be torch.Tensor; not for {not_tensors}")
    shape = tuple(batch[keys[0]].shape)
    if len(shape) != 2:
        raise ValueError(f"{keys[0]} must be [B, S], got {shape}")
    bad = {k: tuple(batch[k].shape) for k in keys if tuple(batch[k].shape) != shape}
    if bad:
        raise ValueError(f"all batch tensors must have shape {shape}; got {bad}")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"empty batch of shape {shape}")
    ids = batch["input_ids"]
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {ids.dtype}")
    outside = (ids < 0) | (ids >= vocab_size)
    if bool(outside.any()):
        pos = tuple(int(i) for i in outside.nonzero()[0])
        raise ValueError(
            f"input_ids: token id {int(ids[pos])} at position {pos} is outside the vocabulary "
            f"[0, {vocab_size}) ({int(outside.sum())} id(s) outside)"
        )
    masks = {k: as_bool_mask(batch[k], k) for k in ("attention_mask", "loss_mask") if k in keys}
    if "loss_mask" in masks:
        _check_loss_within_attention(masks["loss_mask"], masks["attention_mask"])
    if packed:
        _check_right_padded(masks["attention_mask"])
    for key in ("old_values", "returns"):
        if key in keys:
            if not batch[key].dtype.is_floating_point:
                raise ValueError(f"{key} must be a floating tensor, got {batch[key].dtype}")
            check_finite_at(key, batch[key], masks["loss_mask"])
    return shape[0]
