"""Nothing lost, nothing half-done: bad files, bad batches, failing steps (issue 12).

One 2-rank CPU gloo :class:`~dtensor_patches.testing.RankPool` for the module. Each test
checks that a failed call raises the same clear error on every rank (no rank left blocked in
a collective), that the worker is exactly as it was, and that the next good call works.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool
from ppo_value.config import ValueConfig, tiny_model_config
from tests.ppo_value import _ranks_failures as rf
from tests.ppo_value.batches import make_batch

pytestmark = pytest.mark.ppo

TOL = 1e-5
ONE_LAYER = tiny_model_config("qwen2", num_hidden_layers=1)


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    # A failure that leaves a rank blocked must fail the test in minutes, not 10.
    with RankPool(world_size=2, env={"OMP_NUM_THREADS": "1"}, timeout=240) as p:
        yield p


def _cfg(**kw: Any) -> dict[str, Any]:
    return ValueConfig(**kw).to_dict()


def _same_error_everywhere(outcomes: list[rf.Outcome]) -> tuple[str, str]:
    assert all(o is not None for o in outcomes), outcomes
    assert len(set(outcomes)) == 1, f"ranks raised different errors: {outcomes}"
    first = outcomes[0]
    assert first is not None
    return first


# ---------------------------------------------------------------- checkpoints (items 1, 2)
BAD_CHECKPOINTS = {
    # kind: (file the error must name, words of the problem)
    "pickled_code": ("trainer_state.pt", "weights_only=True"),
    "truncated_trainer_state": ("trainer_state.pt", "cannot be read"),
    "missing_trainer_state": ("trainer_state.pt", "missing"),
    "invalid_meta": ("meta.json", "not valid JSON"),
    "truncated_rng": ("rng_rank1.pt", "cannot be read"),
    "truncated_shard": ("dcp", "reading"),
    "missing_dcp_metadata": (".metadata", "missing"),
    "other_model_2_layers": ("num_hidden_layers: 2 != 1", "differs from this worker's"),
    "other_model_rope": ("rope", "differs from this worker's"),
}


@pytest.fixture(scope="module")
def bad_checkpoint_results(
    pool: RankPool, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("bad-ckpt")
    cfg = _cfg(dp=2, tp=1, lr=1e-2, warmup_steps=2, model_config=ONE_LAYER)
    return pool.run(
        rf.bad_checkpoints, cfg, make_batch(4, 6, seed=2), str(root), list(BAD_CHECKPOINTS)
    )


@pytest.mark.parametrize("kind", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_is_refused_and_changes_nothing(
    bad_checkpoint_results: list[dict[str, Any]], kind: str
) -> None:
    names, problem = BAD_CHECKPOINTS[kind]
    per_rank = [r[kind] for r in bad_checkpoint_results]
    exc_type, message = _same_error_everywhere([r["outcome"] for r in per_rank])
    assert exc_type == "CheckpointError", message
    assert names in message and problem in message, message
    for r in per_rank:
        assert r["unchanged"], f"{kind}: the failed load changed the worker"
        assert not r["code_ran"], "unpickling trainer_state.pt ran code"
        assert r.get("fresh_unchanged", True), f"{kind}: the failed load changed a fresh worker"


def test_worker_still_loads_a_good_checkpoint_after_bad_ones(
    bad_checkpoint_results: list[dict[str, Any]],
) -> None:
    for r in bad_checkpoint_results:
        assert r["good"] == {"step": 1, "worker_step": 1}


def test_saved_state_files_load_without_pickle(pool: RankPool, tmp_path: Path) -> None:
    """Every ``.pt`` a save writes loads with ``weights_only=True`` (plain data only)."""
    from tests.ppo_value import _ranks

    pool.run(
        _ranks.train_and_save,
        _cfg(dp=2, tp=1, model_config=ONE_LAYER),
        make_batch(4, 5),
        str(tmp_path / "c"),
    )
    files = sorted((tmp_path / "c").glob("*.pt"))
    assert [f.name for f in files] == ["rng_rank0.pt", "rng_rank1.pt", "trainer_state.pt"]
    for f in files:
        torch.load(f, weights_only=True)


# ---------------------------------------------------------------- rank-0 save failures (3)
SAVE_STAGES = ["mkdir", "write_text", "rename", "export"]


def test_rank0_only_save_failure_raises_on_every_rank(pool: RankPool, tmp_path: Path) -> None:
    cfg = _cfg(dp=2, tp=1, lr=1e-2, model_config=ONE_LAYER)
    results = pool.run(
        rf.rank0_save_failures, cfg, make_batch(4, 6, seed=4), str(tmp_path), SAVE_STAGES
    )
    for stage in SAVE_STAGES:
        exc_type, message = _same_error_everywhere([r[stage] for r in results])
        assert exc_type == "CheckpointError", message
        assert "rank 0" in message and "No space left on device" in message, message
        step = "export_hf" if stage == "export" else "save_checkpoint"
        assert message.startswith(step), message
    for r in results:
        assert r["good_diff"] < TOL  # the previous checkpoint survived every failed save
    assert results[0]["after"] == ["ckpt"]  # the failed export left no directory


# ---------------------------------------------------------------- batches (items 5, 6, 7)
def test_masked_nan_and_inf_change_nothing(pool: RankPool) -> None:
    cfg = _cfg(dp=2, tp=1, lr=1e-2, model_config=ONE_LAYER)
    for r in pool.run(rf.masked_garbage_vs_reference, cfg, make_batch(8, 7, seed=6)):
        assert r["skipped"] == 0.0
        assert r["weight_diff"] < TOL
        assert r["loss_diff"] < 1e-6 and r["grad_norm_diff"] < 1e-5
        assert r["ev_diff"] < 1e-6 and r["stats_diff"] < 1e-6


BAD_BATCHES = {
    # case: (exception type, words the message must contain)
    "id_too_large": (
        "ValueError",
        "input_ids: token id 64 at position (1, 2) is outside the vocabulary [0, 64)",
    ),
    "id_negative": ("ValueError", "input_ids: token id -1 at position (0, 1)"),
    "nan_return_at_valid": ("ValueError", "returns is not finite at valid position (1, 3)"),
    "inf_old_value_at_valid": ("ValueError", "old_values is not finite at valid position (0, 2)"),
    "mask_not_01": ("ValueError", "loss_mask must contain only 0 and 1"),
    "micro_get_values_zero": (
        "ValueError",
        "micro_batch_size must be a positive int or None, got 0",
    ),
    "micro_train_zero": ("ValueError", "micro_batch_size must be a positive int or None, got 0"),
    "micro_train_negative": ("ValueError", "got -1"),
    "micro_get_values_negative": ("ValueError", "got -1"),
    "micro_train_float": ("ValueError", "got 1.5"),
    "micro_train_bool": ("ValueError", "got True"),
}

MESHES = {
    "dp2": _cfg(dp=2, tp=1, model_config=ONE_LAYER),
    "tp2": _cfg(dp=1, tp=2, model_config=ONE_LAYER),  # vocab-parallel embedding
}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_bad_batches_raise_the_same_clear_error_on_every_rank(pool: RankPool, mesh: str) -> None:
    """Bad data on the last dp rank only: every rank raises, nothing changes, no hang."""
    batch = make_batch(4, 6, seed=8)
    results = pool.run(rf.bad_batches, MESHES[mesh], batch, list(BAD_BATCHES))
    for case, (exc_type, words) in BAD_BATCHES.items():
        got_type, message = _same_error_everywhere([r[case]["outcome"] for r in results])
        assert got_type == exc_type and words in message, (case, message)
        assert all(r[case]["unchanged"] for r in results), case
    for r in results:
        mask = batch["attention_mask"][: r["values_after"].shape[0]].bool()
        torch.testing.assert_close(r["values_after"][mask], r["reference"][mask], rtol=0, atol=TOL)


# ---------------------------------------------------------------- TP without SP (item 8)
@pytest.mark.parametrize(
    ("sp", "layout"),
    [
        (False, {"embed_tokens": ("local", 7), "layer0": ("local", 7)}),
        (True, {"embed_tokens": ("Shard(1)", 8), "layer0": ("Shard(1)", 8)}),
    ],
    ids=["tp-only", "tp-sp"],
)
def test_sequence_parallel_flag_is_honoured(
    pool: RankPool, sp: bool, layout: dict[str, Any]
) -> None:
    cfg = _cfg(dp=1, tp=2, sequence_parallel=sp, optimizer="sgd", lr=0.5, max_grad_norm=None)
    for r in pool.run(rf.activation_layout, cfg, make_batch(4, 7, seed=10)):
        # full plain activations without SP; odd length 7 is padded to 8 only under SP
        assert r["layout"] == layout
        assert r["values_diff"] < TOL
        assert r["weight_diff"] < TOL and r["loss_diff"] < 1e-6


# ---------------------------------------------------------------- patch report (item 9)
def test_worker_refuses_to_build_when_a_needed_patch_failed(pool: RankPool) -> None:
    outcomes = pool.run(
        rf.worker_with_failed_patch, _cfg(dp=2, tp=1, model_config=ONE_LAYER), "partial_item"
    )
    exc_type, message = _same_error_everywhere(outcomes)
    assert exc_type == "PatchRequirementError"
    assert "partial_item: torch moved an internal (injected)" in message


def test_worker_builds_when_an_unneeded_patch_failed(pool: RankPool) -> None:
    assert pool.run(
        rf.worker_with_failed_patch, _cfg(dp=2, tp=1, model_config=ONE_LAYER), "nansum"
    ) == [None, None]
