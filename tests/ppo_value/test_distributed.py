"""The worker on a 4-rank CPU gloo group against a plain single-process model.

One :class:`dtensor_patches.testing.RankPool` (4 ranks) is shared by the module. Meshes:
dp=2 x tp=2 (+SP), dp=4, dp=1 x tp=4, all float32, compared on valid tokens within 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool
from ppo_value.config import ValueConfig, tiny_model_config
from tests.ppo_value import _ranks
from tests.ppo_value.batches import make_batch

pytestmark = pytest.mark.ppo

TOL = 1e-5


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(world_size=4, env={"OMP_NUM_THREADS": "1"}) as p:
        yield p


def _cfg(**kw: Any) -> dict[str, Any]:
    return ValueConfig(**kw).to_dict()


KV4 = tiny_model_config("qwen2", num_key_value_heads=4)


@pytest.mark.parametrize(
    ("cfg", "seq"),
    [
        (_cfg(dp=2, tp=2), 8),
        (_cfg(dp=2, tp=2), 7),  # odd length under TP=2 + SP: padded and trimmed
        (_cfg(dp=4, tp=1), 7),
        (_cfg(dp=1, tp=4, model_config=KV4), 9),  # pads 9 -> 12
        (_cfg(dp=2, tp=2, model_family="llama", model_config=tiny_model_config("llama")), 5),
    ],
    ids=["dp2tp2-even", "dp2tp2-odd", "dp4", "tp4-odd", "llama-dp2tp2-odd"],
)
def test_values_match_single_process(pool: RankPool, cfg: dict[str, Any], seq: int) -> None:
    diffs = pool.run(_ranks.values_vs_reference, cfg, make_batch(8, seq, seed=seq))
    assert max(diffs) < TOL


@pytest.mark.parametrize("seq", [3, 5, 11])
def test_odd_lengths_micro_batches_of_one(pool: RankPool, seq: int) -> None:
    """Issue 5 item 7: odd sequence lengths under TP + SP give the single-device values."""
    cfg = _cfg(dp=2, tp=2, micro_batch_size=1)
    diffs = pool.run(_ranks.values_vs_reference, cfg, make_batch(4, seq, seed=100 + seq))
    assert max(diffs) < TOL


@pytest.mark.parametrize(
    ("cfg", "micro"),
    [
        (_cfg(dp=2, tp=2, lr=1e-3), 1),
        (_cfg(dp=2, tp=2, lr=1e-3), 2),
        (_cfg(dp=2, tp=2, lr=1e-3), 4),
        (_cfg(dp=2, tp=2, optimizer="sgd", lr=0.5, max_grad_norm=None), 1),
        (_cfg(dp=2, tp=2, optimizer="sgd", lr=0.5, max_grad_norm=None), 3),
        (_cfg(dp=2, tp=2, optimizer="sgd", lr=0.5, max_grad_norm=0.05), 2),  # clipping active
        (_cfg(dp=4, tp=1, optimizer="sgd", lr=0.5, max_grad_norm=None), 1),
        (_cfg(dp=1, tp=4, optimizer="sgd", lr=0.5, model_config=KV4, value_clip=None), 2),
    ],
    ids=[
        "adamw-mb1",
        "adamw-mb2",
        "adamw-mb4",
        "sgd-mb1",
        "sgd-mb3",
        "sgd-clip-mb2",
        "sgd-dp4",
        "sgd-tp4",
    ],
)
def test_train_step_matches_single_process(pool: RankPool, cfg: dict[str, Any], micro: int) -> None:
    batch = make_batch(8, 7, seed=3)
    results = pool.run(_ranks.train_vs_reference, cfg, batch, micro)
    for r in results:
        assert r["update"] > 100 * TOL, (
            "the step must move the weights for the test to mean anything"
        )
        assert r["weight_diff"] < TOL
        assert r["loss_diff"] < 1e-6
        assert r["grad_norm_diff"] < 1e-5
        assert r["ev_diff"] < 1e-6
        assert r["clip_fraction_diff"] < 1e-9
        assert r["stats_diff"] < 1e-6
        assert r["lr"] == cfg["lr"]
        # every parameter is a DTensor on the full (dp, tp) mesh when tp > 1 (design §3)
        assert r["param_mesh_ndims"] == ([2] if cfg["tp"] > 1 else [1])
    assert len({r["loss"] for r in results}) == 1, "metrics must be identical on every rank"


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=TOL, msg=k)


@pytest.mark.parametrize("load_mesh", [(2, 2), (4, 1)], ids=["same-mesh", "dp4-from-dp2tp2"])
def test_checkpoint_round_trip(pool: RankPool, tmp_path: Path, load_mesh: tuple[int, int]) -> None:
    batch = make_batch(8, 7, seed=5)
    path = str(tmp_path / "ckpt")
    saved = pool.run(_ranks.train_and_save, _cfg(dp=2, tp=2, warmup_steps=3), batch, path)[0]
    dp, tp = load_mesh
    loaded = pool.run(_ranks.load_fresh, _cfg(dp=dp, tp=tp, warmup_steps=3, seed=42), batch, path)
    for r in loaded:
        # a different seed starts elsewhere, so the load is what makes the values match
        assert (r["values_before_load"] - saved["values"]).abs().max() > 1e-3
        torch.testing.assert_close(r["values"], saved["values"], rtol=0, atol=TOL)
        _assert_same_state(r["weights"], saved["weights"])
        _assert_same_state(r["optim"], saved["optim"])
        assert {"score.weight", "score.bias"} <= set(r["weights"])  # the head survives
        assert r["step"] == saved["step"] == 1
        assert r["lr"] == pytest.approx(saved["lr"])


def test_interrupted_save_keeps_previous_checkpoint(pool: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    r = pool.run(_ranks.interrupted_save, _cfg(dp=2, tp=2, lr=1e-2), make_batch(8, 6), path)[0]
    assert r["crashed"] and r["tmp_left"]
    assert r["moved"] > 1e-3  # training after the good save changed the values
    assert r["step"] == 1
    assert r["diff_after_crash"] < TOL
    assert r["diff_after_rename_crash"] < TOL
    assert r["clean"] == ["ckpt"]


def test_seeding(pool: RankPool) -> None:
    batch = make_batch(4, 6, seed=9)
    a = pool.run(_ranks.seeded_values, _cfg(dp=2, tp=2, seed=1), batch, 123)
    b = pool.run(_ranks.seeded_values, _cfg(dp=2, tp=2, seed=1), batch, 456)
    c = pool.run(_ranks.seeded_values, _cfg(dp=2, tp=2, seed=2), batch, 123)
    for x in a + b:
        assert torch.equal(x, a[0])
    assert (c[0] - a[0]).abs().max() > 1e-3


def test_export_hf_loads_in_transformers(pool: RankPool, tmp_path: Path) -> None:
    diffs = pool.run(
        _ranks.export_and_reload, _cfg(dp=2, tp=2, lr=1e-2), make_batch(4, 7), str(tmp_path / "hf")
    )
    assert max(diffs) < TOL
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_non_finite_gradient_skips_step(pool: RankPool) -> None:
    results = pool.run(_ranks.nonfinite_step, _cfg(dp=2, tp=2, lr=1e-2), make_batch(8, 6))
    for r in results:
        assert r["skipped"] == 1.0
        assert r["changed"] == 0.0
        assert r["step_after_bad"] == 0.0
        assert r["step_after_good"] == 1.0


def test_uneven_dp_batches_run_empty_micro_batches(pool: RankPool) -> None:
    """dp rank 0 has 3 sequences, rank 1 has 2 (micro-batches of 1): rank 1 runs an empty
    micro-batch instead of hanging (issue 22; equality: test_context_parallel.py)."""
    shapes = pool.run(_ranks.uneven_dp_batch, _cfg(dp=2, tp=2), make_batch(4, 6))
    assert shapes == [[3, 6], [3, 6], [2, 6], [2, 6]]


def test_mixed_precision(pool: RankPool) -> None:
    results = pool.run(
        _ranks.mixed_precision_run, _cfg(dp=2, tp=2, mixed_precision=True), make_batch(8, 7)
    )
    for r in results:
        assert r["dtype"] == "torch.float32"
        assert r["head_dtypes"] == ["torch.float32"]
        assert r["diff"] < 5e-2
        assert torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all()


@pytest.mark.slow
def test_seeding_across_launches(pool: RankPool) -> None:
    """A second, freshly spawned group of processes builds the same initial critic."""
    batch = make_batch(4, 7, seed=21)
    cfg = _cfg(dp=2, tp=2, seed=8)
    first = pool.run(_ranks.seeded_values, cfg, batch, 1)[0]
    with RankPool(world_size=4, env={"OMP_NUM_THREADS": "1"}) as other:
        second = other.run(_ranks.seeded_values, cfg, batch, 2)
    for values in second:
        assert torch.equal(values, first)
