"""Micro-batch plans: token budgets and equal counts across dp ranks (plain Python)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_value import batching
from ppo_value.config import ValueConfig


def _covers(groups: list[list[int]], n: int) -> bool:
    flat = sorted(i for g in groups for i in g)
    return flat == list(range(n))


@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    slack=st.integers(0, 100),
    packed=st.booleans(),
    extra=st.integers(0, 50),
)
def test_token_budget_groups_respect_budget_and_cover(
    lengths: list[int], slack: int, packed: bool, extra: int
) -> None:
    budget = max(lengths) + slack
    groups = batching.token_budget_micro_batches(lengths, budget, packed=packed)
    assert _covers(groups, len(lengths))
    for g in groups:
        assert batching.group_cost(lengths, g, packed=packed) <= budget
    # first fit: the first sequence of a later group did not fit into an earlier one, so no
    # two packed groups fit into one budget together
    if packed and len(groups) >= 2:
        assert batching.group_cost(lengths, groups[-1] + groups[-2], packed=True) > budget
    target = len(groups) + extra
    equal = batching.equalise_micro_batches(groups, lengths, target, packed=packed)
    assert len(equal) == target
    assert _covers(equal, len(lengths))
    for g in equal:
        assert batching.group_cost(lengths, g, packed=packed) <= budget
    if target > len(lengths):
        assert sum(1 for g in equal if not g) == target - len(lengths)
    else:
        assert all(equal)


def test_budget_examples() -> None:
    lengths = [10, 3, 7, 2, 8]
    assert batching.token_budget_micro_batches(lengths, 10, packed=True) == [[0], [3, 4], [1, 2]]
    # padded: a group costs len * longest
    assert batching.token_budget_micro_batches(lengths, 16, packed=False) == [[0], [2, 4], [1, 3]]
    assert batching.equalise_micro_batches([[0, 1]], [4, 4], 4, packed=True) == [[0], [1], [], []]


def test_errors() -> None:
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens"):
        batching.token_budget_micro_batches([3, 9], 8, packed=True)
    with pytest.raises(ValueError, match=">= 1"):
        batching.token_budget_micro_batches([3], 0, packed=True)
    with pytest.raises(ValueError, match="cannot merge"):
        batching.equalise_micro_batches([[0], [1]], [1, 1], 1, packed=True)


def test_sequence_lengths() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]])
    assert batching.sequence_lengths(mask, packed=True) == [2, 2, 0]
    assert batching.sequence_lengths(mask, packed=False) == [2, 3, 0]


def test_fixed_size() -> None:
    assert batching.fixed_size_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"max_tokens_per_micro_batch": 0}, "max_tokens_per_micro_batch"),
        ({"pack_row_tokens": -3}, "pack_row_tokens"),
        ({"max_tokens_per_micro_batch": 1.5}, "max_tokens_per_micro_batch"),
    ],
)
def test_config_validation(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ValueConfig.from_dict(changes)
    assert ValueConfig(sequence_packing=True, max_tokens_per_micro_batch=512).sequence_packing
