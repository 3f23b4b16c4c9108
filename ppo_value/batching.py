"""Micro-batch plans: fixed-size or token-budget groups of sequences, equal in number on every
data-parallel rank.

With ``max_tokens_per_micro_batch`` the sequences of a rank's batch are grouped by length, as
verl's dynamic batch size does (``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``): longest
first, each into the first group whose cost stays within the budget (first-fit decreasing). The
cost of a group is what its forward computes: the sum of the sequence lengths when sequences
are packed, ``len(group) * longest`` when they are padded.

Every dp rank must run the same number of forward/backward passes, since FSDP2 all-gathers
parameters in each one. :func:`equalise_micro_batches` brings a rank's plan up to the largest
count over dp (all-reduced by the caller): it first splits its most expensive groups, and only
when every group holds one sequence pads with empty micro-batches, which the worker runs as a
dummy forward (and a zero-weight backward) so the collectives still match.

Because the value loss is normalised by the valid tokens of the whole batch (all micro-batches,
all dp ranks), the summed gradient does not depend on the grouping.
"""

from __future__ import annotations

import torch

__all__ = [
    "equalise_micro_batches",
    "fixed_size_micro_batches",
    "group_cost",
    "sequence_lengths",
    "token_budget_micro_batches",
]


def sequence_lengths(attention_mask: torch.Tensor, *, packed: bool) -> list[int]:
    """Per-sequence token cost of ``[B, S]`` ``attention_mask``.

    ``packed``: the number of valid tokens. Otherwise the extent a padded forward needs, the
    index of the last valid token plus one (0 for a sequence without valid tokens).
    """
    valid = attention_mask.bool()
    if packed:
        return [int(n) for n in valid.sum(dim=1).tolist()]
    cols = torch.arange(1, valid.shape[1] + 1)
    return [int(n) for n in (valid.cpu().long() * cols).amax(dim=1).tolist()]


def group_cost(lengths: list[int], group: list[int], *, packed: bool) -> int:
    """Tokens one forward of ``group`` computes: ``sum`` (packed) or ``len * max`` (padded)."""
    if not group:
        return 0
    sizes = [lengths[i] for i in group]
    return sum(sizes) if packed else len(sizes) * max(sizes)


def fixed_size_micro_batches(batch_size: int, micro_batch_size: int) -> list[list[int]]:
    """Contiguous groups of ``micro_batch_size`` sequences (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [
        list(range(start, min(start + micro_batch_size, batch_size)))
        for start in range(0, batch_size, micro_batch_size)
    ]


def token_budget_micro_batches(
    lengths: list[int], max_tokens: int, *, packed: bool
) -> list[list[int]]:
    """Group sequences so that every group's :func:`group_cost` is at most ``max_tokens``.

    Args:
        lengths: per-sequence cost from :func:`sequence_lengths`.
        max_tokens: the token budget of one micro-batch.
        packed: cost model (see :func:`group_cost`).

    Returns:
        Groups of sequence indices (each sorted), most expensive first; every index exactly once.

    Raises:
        ValueError: if ``max_tokens < 1`` or one sequence alone exceeds the budget (raise the
            budget to at least the longest sequence; sequences are never split).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = max(too_long, key=lambda x: x[1])
        raise ValueError(
            f"sequence {i} has {n} tokens, more than max_tokens_per_micro_batch={max_tokens}; "
            "raise the budget to at least the longest sequence"
        )
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g in groups:
            if group_cost(lengths, [*g, i], packed=packed) <= max_tokens:
                g.append(i)
                break
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def equalise_micro_batches(
    groups: list[list[int]], lengths: list[int], target: int, *, packed: bool
) -> list[list[int]]:
    """Bring ``groups`` to exactly ``target`` micro-batches (``target >= len(groups)``).

    Splits the most expensive group with more than one sequence in two (by alternating its
    length-sorted members) until ``target`` is reached; if every group holds a single sequence,
    appends empty groups. Splitting never raises a group's cost, so budgets still hold.

    Raises:
        ValueError: if ``target < len(groups)``.
    """
    if target < len(groups):
        raise ValueError(f"cannot merge {len(groups)} micro-batches into {target}")
    out = [list(g) for g in groups]
    while len(out) < target:
        splittable = [g for g in out if len(g) > 1]
        if not splittable:
            out.extend([] for _ in range(target - len(out)))
            break
        g = max(splittable, key=lambda g: group_cost(lengths, g, packed=packed))
        out.remove(g)
        by_len = sorted(g, key=lambda i: (-lengths[i], i))
        out.extend([sorted(by_len[0::2]), sorted(by_len[1::2])])
    return out
