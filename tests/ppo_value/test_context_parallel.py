"""Context parallelism of the critic against the single-device critic (issue 22).

Values, loss, grad norm and every parameter gradient (one SGD step of lr 0.5: the weight change
is the gradient) with dp=1 x cp=2 (2 ranks), dp=1 x cp=2 x tp=2 + SP and dp=2 x cp=2 (4 ranks),
packing on and off, odd lengths; the right shift at every CP chunk boundary under head-tail
sharding and at every packed-document boundary; a batch of 7 sequences on dp=2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool
from ppo_value.config import ValueConfig
from ppo_value.context_parallel import SequenceShard, load_balanced_columns
from tests.ppo_value import _cp_ranks, _ranks
from tests.ppo_value.batches import make_batch

pytestmark = pytest.mark.ppo

TOL = 1e-5
SGD = {"optimizer": "sgd", "lr": 0.5, "max_grad_norm": None}


@pytest.fixture(scope="module")
def pool2() -> Iterator[RankPool]:
    with RankPool(world_size=2, env={"OMP_NUM_THREADS": "1"}) as p:
        yield p


@pytest.fixture(scope="module")
def pool4() -> Iterator[RankPool]:
    with RankPool(world_size=4, env={"OMP_NUM_THREADS": "1"}) as p:
        yield p


def _cfg(**kw: Any) -> dict[str, Any]:
    return ValueConfig(**kw).to_dict()


def test_load_balanced_columns_are_head_tail_chunks() -> None:
    # 2 * cp = 4 chunks of 3 columns: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert load_balanced_columns(12, 2, 0).tolist() == [0, 1, 2, 9, 10, 11]
    assert load_balanced_columns(12, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    every = torch.cat([load_balanced_columns(16, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    with pytest.raises(ValueError, match="multiple of 2 \\* cp"):
        load_balanced_columns(10, 3, 0)


def test_mask_is_the_single_device_mask_rows() -> None:
    """The CP mask of a rank equals the rows of the global causal, document and padding mask
    at its columns (plus the diagonal for padding queries), also for a chunk against a prefix
    of the keys."""
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2]])
    shard = SequenceShard(
        group=None,
        cp=2,
        rank=1,
        length=8,
        columns=load_balanced_columns(8, 2, 1),
        to_global=torch.arange(8),
        valid=valid.bool(),
        segment_ids=segments,
    )
    t = torch.arange(8)
    full = (t[None] <= t[:, None]) & (segments[0][:, None] == segments[0][None]) & valid.bool()
    full |= torch.eye(8, dtype=torch.bool)
    assert torch.equal(shard.mask()[0, 0], full[shard.columns])
    assert shard.chunk_starts == (2, 4) == tuple(shard.columns[:: shard.chunk].tolist())
    assert torch.equal(shard.mask(slice(2, 4), 6)[0, 0], full[shard.columns[2:4], :6])
    additive = dataclasses.replace(shard, mask_dtype=torch.float32).mask()[0, 0]
    assert torch.equal(additive == 0, full[shard.columns])
    assert float(additive.min()) == torch.finfo(torch.float32).min


@pytest.mark.parametrize("length", [8, 12])
def test_shift_at_every_cp_chunk_boundary(pool2: RankPool, length: int) -> None:
    results = pool2.run(_cp_ranks.shift_across_shards, 2, length)
    for r in results:
        assert r["shifted"] == [float(t) for t in range(length)]  # raw(t - 1) = t, 0 at t = 0
        # d/d raw(c) of sum_t t * shifted(t) is c + 1 for c < T - 1 and 0 for the last column.
        # Every CP rank computes the same loss and the gather's backward sums them onto each
        # column's owner: cp times one loss's gradient (FSDP2's mean over dp x cp divides it out)
        expected = [2.0 * (c + 1) if c < length - 1 else 0.0 for c in r["columns"]]
        assert r["grad"] == expected
    # rank 0's second chunk starts at 3 * T / 4: its value comes from rank 1's last column
    assert results[0]["columns"][length // 4] == 3 * length // 4
    assert results[1]["columns"][-1] == 3 * length // 4 - 1


def test_shift_at_every_cp_chunk_boundary_cp4(pool4: RankPool) -> None:
    for r in pool4.run(_cp_ranks.shift_across_shards, 4, 16):
        assert r["shifted"] == [float(t) for t in range(16)]


def test_packed_documents_never_borrow_across_boundaries(pool2: RankPool) -> None:
    # documents of 3, 5, 2 and 4 tokens in one row of 16 (padded from 14): boundaries at
    # columns 3, 8, 10 and the padding at 14; CP chunks of 4 split documents mid-way
    for r in pool2.run(_cp_ranks.packed_shift_across_shards, 2, [3, 5, 2, 4]):
        for c, (value, start) in enumerate(zip(r["shifted"], r["starts"], strict=True)):
            assert value == (0.0 if start else float(c)), c


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("seq", [9, 8])
def test_cp2_values_and_step_match_single_device(pool2: RankPool, packing: bool, seq: int) -> None:
    cfg = _cfg(dp=1, cp=2, sequence_packing=packing, **SGD)
    batch = make_batch(4, seq, seed=seq)
    assert pool2.run(_ranks.values_vs_reference, cfg, batch)[0] < TOL
    r = pool2.run(_ranks.train_vs_reference, cfg, batch, 2)[0]
    assert r["weight_diff"] < TOL and r["update"] > 1e-3
    assert r["loss_diff"] < TOL and r["grad_norm_diff"] < TOL and r["stats_diff"] < TOL


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(
    "layout", [{"dp": 1, "cp": 2, "tp": 2}, {"dp": 2, "cp": 2, "tp": 1}], ids=["cp2tp2", "dp2cp2"]
)
def test_4_rank_layouts_match_single_device(
    pool4: RankPool, layout: dict[str, int], packing: bool
) -> None:
    cfg = _cfg(**layout, sequence_packing=packing, **SGD)
    batch = make_batch(6, 11, seed=11)  # odd length: padded to a multiple of 2 * cp * tp
    assert max(pool4.run(_ranks.values_vs_reference, cfg, batch)) < TOL
    r = pool4.run(_ranks.train_vs_reference, cfg, batch, 2)[0]
    assert r["weight_diff"] < TOL and r["update"] > 1e-3
    assert r["loss_diff"] < TOL and r["grad_norm_diff"] < TOL and r["ev_diff"] < 1e-4


@pytest.mark.parametrize(
    ("micro", "budget"),
    [(1, None), (2, None), (4, None), (4, 12)],
    ids=["mb1", "mb2", "mb4", "budget"],
)
def test_batch_of_7_on_dp2(pool4: RankPool, micro: int, budget: int | None) -> None:
    """dp=2 does not divide 7: dp rank 0 holds 4 sequences, rank 1 holds 3 (and runs an empty
    micro-batch where it has fewer); with fixed-size micro-batches and with a token budget, the
    step equals the single device's."""
    cfg = _cfg(dp=2, tp=2, max_tokens_per_micro_batch=budget, **SGD)
    batch = make_batch(7, 6, seed=7)
    assert max(pool4.run(_ranks.values_vs_reference, cfg, batch)) < TOL
    r = pool4.run(_ranks.train_vs_reference, cfg, batch, micro)[0]
    assert r["weight_diff"] < TOL and r["update"] > 1e-3 and r["loss_diff"] < TOL


def test_cp_config_rejects_other_attention() -> None:
    with pytest.raises(ValueError, match="cp=2 needs attn_implementation='sdpa'"):
        ValueConfig(cp=2, attn_implementation="eager")
    assert ValueConfig(dp=2, cp=2, tp=2).world_size == 8
