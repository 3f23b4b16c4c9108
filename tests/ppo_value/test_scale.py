"""Issue 12 (scale) on a 4-rank CPU gloo group against the single-process unpacked model:
sequence packing, token-budget micro-batches, activation checkpointing, and the gradient norm
reduced in one collective over the flattened (dp, tp) mesh. float32, 1e-5."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool
from ppo_value.config import ValueConfig, tiny_model_config
from tests.ppo_value import _ranks, _scale_ranks
from tests.ppo_value.batches import make_batch

pytestmark = pytest.mark.ppo

TOL = 1e-5


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(world_size=4, env={"OMP_NUM_THREADS": "1"}) as p:
        yield p


def _cfg(**kw: Any) -> dict[str, Any]:
    return ValueConfig(**kw).to_dict()


def long_tailed_batch(n: int, seq: int, *, seed: int) -> dict[str, torch.Tensor]:
    """``make_batch`` with lengths from 3 to ``seq`` (many short, few long)."""
    batch = make_batch(n, seq, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = (3 + (torch.rand(n, generator=g) ** 3) * (seq - 3)).round().long()
    lengths[0] = seq
    attention = (torch.arange(seq)[None] < lengths[:, None]).long()
    loss_mask = attention.clone()
    loss_mask[:, :2] = 0
    return {**batch, "attention_mask": attention, "loss_mask": loss_mask}


KV4 = tiny_model_config("qwen2", num_key_value_heads=4)


@pytest.mark.parametrize(
    ("cfg", "seq"),
    [
        (_cfg(dp=2, tp=2, sequence_packing=True), 7),  # packed rows padded to a multiple of 2
        (_cfg(dp=2, tp=2, sequence_packing=True, pack_row_tokens=8, micro_batch_size=4), 7),
        (_cfg(dp=2, tp=2, sequence_packing=True, attn_implementation="eager"), 9),
        (_cfg(dp=1, tp=4, sequence_packing=True, model_config=KV4), 9),
        (_cfg(dp=4, tp=1, sequence_packing=True), 6),
    ],
    ids=["dp2tp2-one-row", "dp2tp2-rows-of-8", "dp2tp2-eager", "tp4", "dp4"],
)
def test_packed_values_match_unpacked_reference(
    pool: RankPool, cfg: dict[str, Any], seq: int
) -> None:
    diffs = pool.run(_ranks.values_vs_reference, cfg, long_tailed_batch(8, seq, seed=seq))
    assert max(diffs) < TOL


def _check_step(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["update"] > 100 * TOL, (
            "the step must move the weights for the test to mean anything"
        )
        assert r["weight_diff"] < TOL
        assert r["loss_diff"] < 1e-6
        assert r["grad_norm_diff"] < 1e-5
        assert r["ev_diff"] < 1e-6


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg(dp=2, tp=2, lr=1e-3, sequence_packing=True, micro_batch_size=2),
        _cfg(dp=2, tp=2, optimizer="sgd", lr=0.5, max_grad_norm=0.05, sequence_packing=True),
        _cfg(
            dp=2, tp=2, optimizer="sgd", lr=0.5, activation_checkpointing=True, micro_batch_size=2
        ),
        _cfg(
            dp=2,
            tp=2,
            optimizer="sgd",
            lr=0.5,
            sequence_packing=True,
            max_tokens_per_micro_batch=12,
            activation_checkpointing=True,
        ),
    ],
    ids=["packed-adamw", "packed-sgd-clip", "activation-checkpointing", "packed-budget-ac"],
)
def test_train_step_matches_unpacked_reference(pool: RankPool, cfg: dict[str, Any]) -> None:
    batch = long_tailed_batch(8, 9, seed=3)
    _check_step(pool.run(_ranks.train_vs_reference, cfg, batch, cfg["micro_batch_size"]))


@pytest.mark.parametrize(
    ("packing", "budget", "sizes"),
    [
        (True, 9, [4, 4]),  # long sequences on dp rank 0: it plans more micro-batches
        (True, 30, [4, 4]),
        (False, 9, [4, 4]),
        (False, 20, [4, 4]),
        (True, 9, [6, 2]),  # rank 1 runs empty micro-batches to keep pace
    ],
    ids=["packed-9", "packed-30", "padded-9", "padded-20", "uneven-shards-empty-micro-batches"],
)
def test_token_budget_any_grouping_gives_the_reference_step(
    pool: RankPool, packing: bool, budget: int, sizes: list[int]
) -> None:
    batch = long_tailed_batch(8, 9, seed=11)
    # sort so that dp rank 0 holds the long sequences and rank 1 the short ones
    order = torch.argsort(batch["attention_mask"].sum(1), descending=True, stable=True)
    batch = {k: v[order] for k, v in batch.items()}
    cfg = _cfg(
        dp=2,
        tp=2,
        optimizer="sgd",
        lr=0.5,
        max_grad_norm=None,
        sequence_packing=packing,
        max_tokens_per_micro_batch=budget,
    )
    results = pool.run(_scale_ranks.uneven_shards_vs_reference, cfg, batch, sizes)
    plans = [r["plan"] for r in results]
    assert len({len(p) for p in plans}) == 1, "every rank must run the same number of micro-batches"
    for r in results:
        assert r["values_diff"] < TOL
        assert r["update"] > 100 * TOL
        assert r["weight_diff"] < TOL
        assert r["loss_diff"] < 1e-6
        assert r["grad_norm_diff"] < 1e-5
    for p in plans:
        assert sorted(i for g in p for i in g) == list(range(len([i for g in p for i in g])))
    if sizes == [6, 2]:
        assert any(g == [] for g in plans[2]), "dp rank 1 pads with empty micro-batches"
    if budget == 9:
        assert len(plans[0]) > 2, "a small budget must split the batch into several micro-batches"


def test_grad_norm_is_one_collective_without_the_flatten_warning(pool: RankPool) -> None:
    results = pool.run(
        _scale_ranks.grad_norm_collectives, _cfg(dp=2, tp=2, lr=1e-3), make_batch(8, 7, seed=4)
    )
    for r in results:
        assert r["sequential"] == []
        assert r["all_reduce_per_step"] == 1
        assert r["grad_norm_diff"] < 1e-5


def test_sequence_over_the_budget_raises_on_every_rank(pool: RankPool) -> None:
    batch = make_batch(8, 9, seed=2)
    batch["attention_mask"][:, 6:] = 0  # every sequence fits 6 tokens ...
    batch["loss_mask"][:, 6:] = 0  # (no loss outside the attention_mask: refused)
    cfg = _cfg(dp=2, tp=2, sequence_packing=True, max_tokens_per_micro_batch=6)
    messages = pool.run(_scale_ranks.too_long_on_one_rank, cfg, batch)  # ... but one of rank 0
    assert all("sequence 0 has 9 tokens" in m for m in messages[:2])
    assert all("another data-parallel rank" in m for m in messages[2:])
