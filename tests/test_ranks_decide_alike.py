"""Ranks whose Python hash seeds differ (as under ``torchrun``, where each draws its own) make
one sharding decision with ``apply_all()``: ``torch.vdot`` of operands pending on a mesh dim,
on a 2x2 mesh and on a 1-D mesh of 4, gives the single-device value on every release.

The ranks here get seeds 0, 7, 7, 0 (every mesh dim group of a 2x2 mesh holds both): on stock
2.14.1 and 2.15.0 a process seeded 7 reduces the other ``vdot`` operand than one seeded 0, so
without ``ranks_decide_alike`` the ranks' shares do not add up to the product (measured: wrong
there, right on 2.11 to 2.13, where no tie follows set order for ``vdot``; 2.9 and 2.10 have
no strategy for it, and the fallback computes it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from packaging.version import Version

from dtensor_patches.testing import RankPool

SEEDS = (0, 7, 7, 0)


@pytest.fixture(scope="module")
def seeded_pool4() -> Iterator[RankPool]:
    """Four ranks of their own, seeded :data:`SEEDS` (the shared pools inherit one seed or
    none, so whether their ranks disagree is a draw)."""
    with RankPool(4, timeout=120, hash_seeds=SEEDS) as pool:
        yield pool


# name -> (mesh shape, placements of both operands per mesh dim).
_CASES: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "shard_then_pending": ((2, 2), ("S0", "P")),
    "pending_then_shard": ((2, 2), ("P", "S0")),
    "pending_on_both": ((2, 2), ("P", "P")),
    "pending_1d": ((4,), ("P",)),
}


def _vdot_on_ranks(name: str, patched: bool) -> dict[str, float]:
    from torch.distributed.tensor import DTensor, Partial, Shard

    import dtensor_patches as dp
    from dtensor_patches.testing import grid_mesh

    shape, layout = _CASES[name]
    mesh = grid_mesh(shape)
    coords = mesh.get_coordinate()
    a_full = torch.randn(8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    b_full = torch.randn(8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def placed(full: torch.Tensor, seed: int) -> DTensor:
        # Pending shares that add up to the value: random on every rank but the last of each
        # pending mesh dim group, which holds the rest.
        local = full
        for dim, p in enumerate(layout):
            if p == "S0":
                local = local.chunk(mesh.size(dim))[coords[dim]]
        noise = torch.Generator().manual_seed(seed)
        for dim, p in enumerate(layout):
            if p == "P":
                shares = [
                    torch.randn(local.shape, generator=noise, dtype=local.dtype)
                    for _ in range(mesh.size(dim) - 1)
                ]
                shares.append(local - sum(shares))
                local = shares[coords[dim]]
        placements = [Shard(0) if p == "S0" else Partial() for p in layout]
        return DTensor.from_local(local, mesh, placements, run_check=False)

    a, b = placed(a_full, 3), placed(b_full, 4)
    # The fallback computes what a release refuses (vdot has no strategy before 2.11).
    with dp.patched(only=["ranks_decide_alike"] if patched else []):
        value = torch.vdot(a, b).full_tensor().item()
    return {"value": value, "expected": torch.vdot(a_full, b_full).item()}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_vdot_with_ranks_seeded_apart(seeded_pool4: RankPool, name: str) -> None:
    results = seeded_pool4.run(_vdot_on_ranks, name, True)
    for r in results:
        assert r["value"] == pytest.approx(r["expected"], rel=1e-9, abs=1e-12), results


def test_stock_ranks_seeded_apart_disagree_on_vdot(seeded_pool4: RankPool) -> None:
    """The cases above still exercise a disagreement: on stock 2.14 and 2.15 (measured) the
    ranks seeded apart reduce different operands, and the value is wrong."""
    from dtensor_patches._torch.versions import torch_release

    if torch_release() < Version("2.14"):
        pytest.skip("no tie follows set order for vdot before 2.14 (measured)")
    results = seeded_pool4.run(_vdot_on_ranks, "shard_then_pending", False)
    assert results[0]["value"] != pytest.approx(results[0]["expected"], rel=1e-6), results


def _seed_and_a_hash() -> tuple[str | None, int]:
    import os

    return os.environ.get("PYTHONHASHSEED"), hash("sum")


def test_hash_seeds_reach_each_rank_and_leave_this_process_alone(seeded_pool4: RankPool) -> None:
    import os

    before = os.environ.get("PYTHONHASHSEED")
    results = seeded_pool4.run(_seed_and_a_hash)
    assert [seed for seed, _ in results] == [str(s) for s in SEEDS]
    # Ranks seeded alike hash a string alike; seeded apart, differently.
    assert results[0][1] == results[3][1] and results[1][1] == results[2][1]
    assert results[0][1] != results[1][1]
    assert os.environ.get("PYTHONHASHSEED") == before


def test_hash_seeds_must_be_one_per_rank() -> None:
    with pytest.raises(ValueError, match="3 seeds for 2 ranks"):
        RankPool(2, hash_seeds=(0, 1, 2))
