"""Reliability of the critic's packing paths and checkpoint loads (issue 23, items 7, 8, 9, 18).

One 2-rank CPU gloo :class:`~dtensor_patches.testing.RankPool` for the module, with a timeout
that fails a test whose ranks are left blocked in a collective. Each test compares the worker
with the single-process model on the whole batch, or checks the documented promise: the same
clear error on every rank, the worker exactly as it was, no code run from a crafted file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dtensor_patches.testing import RankPool
from ppo_value.config import ValueConfig, tiny_model_config
from tests.ppo_value import _ranks_reliability as rr
from tests.ppo_value.batches import make_batch

pytestmark = pytest.mark.ppo

TOL = 1e-5
ONE_LAYER = tiny_model_config("qwen2", num_hidden_layers=1)


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    # A rank left blocked in a collective must fail the test in minutes, not hang it.
    with RankPool(world_size=2, env={"OMP_NUM_THREADS": "1"}, timeout=180) as p:
        yield p


def _cfg(**kw: Any) -> dict[str, Any]:
    return ValueConfig(**{"dp": 2, "tp": 1, "model_config": ONE_LAYER, **kw}).to_dict()


def _same_error_everywhere(outcomes: list[Any]) -> tuple[str, str]:
    assert all(o is not None for o in outcomes), outcomes
    assert len(set(outcomes)) == 1, f"ranks raised different errors: {outcomes}"
    first: tuple[str, str] = outcomes[0]
    return first


# ------------------------------------------------------------ fully masked sequences (item 7)
MASKED_CONFIGS = {
    "packed": {"sequence_packing": True},
    "packed-budget": {"sequence_packing": True, "max_tokens_per_micro_batch": 12},
    "packed-eager": {"sequence_packing": True, "attn_implementation": "eager"},
    "padded": {},
}


@pytest.mark.parametrize("masked", ["micro_batch", "dp_rank"])
@pytest.mark.parametrize("config", list(MASKED_CONFIGS))
def test_fully_masked_sequences_on_one_dp_rank_train_as_one_process(
    pool: RankPool, config: str, masked: str
) -> None:
    """dp rank 1 gets a micro-batch (or its whole shard) of sequences without any token: no
    rank raises or hangs, and values and the step equal the single-process step on the whole
    batch (issue 23 item 7: packing raised ``row_tokens must be >= 1`` on rank 1 only, while
    rank 0 waited in FSDP2's all-gather)."""
    batch = make_batch(8, 6, seed=11)
    rows = slice(4, 6) if masked == "micro_batch" else slice(4, 8)  # dp rank 1 holds 4..7
    for key in ("attention_mask", "loss_mask"):
        batch[key][rows] = 0
    results = pool.run(rr.masked_sequences_vs_reference, _cfg(**MASKED_CONFIGS[config]), batch, 2)
    for r in results:
        assert r["values_outcome"] is None and r["train_outcome"] is None, r
        assert r["values_diff"] < TOL and r["values_finite"]
        assert r["skipped"] == 0.0
        assert r["weight_diff"] < TOL
        assert r["loss_diff"] < 1e-6 and r["grad_norm_diff"] < 1e-5


# ------------------------------------------------------------ masks packing cannot honour (18)
BAD_MASKS = {
    # config: cases that must be refused
    "packed": ["loss_outside_attention", "attention_hole", "left_padded"],
    "padded": ["loss_outside_attention"],
}
MASK_ERRORS = {
    "loss_outside_attention": "loss_mask is 1 at position (1, ",
    "attention_hole": "attention_mask of sequence 0 is not right-padded",
    "left_padded": "attention_mask of sequence 1 is not right-padded",
}


@pytest.mark.parametrize("config", list(BAD_MASKS))
def test_masks_packing_cannot_honour_are_refused_on_every_rank(pool: RankPool, config: str) -> None:
    """``loss_mask = 1`` where ``attention_mask = 0`` (a loss on a position the model does not
    see), and under packing an ``attention_mask`` with a hole or left padding (packed positions
    restart at 0 where the padded forward counts columns), on the last dp rank only: the same
    ``ValueError`` on every rank, for ``train`` and ``get_values``, the worker unchanged, and
    the next good call equal to the single-process model (issue 23 item 18: packed and padded
    silently trained differently)."""
    cfg = _cfg(sequence_packing=config == "packed")
    batch = make_batch(4, 7, seed=12)
    batch["attention_mask"][:, :5] = 1  # every sequence has tokens 0..4 (room for a hole)
    results = pool.run(rr.bad_masks, cfg, batch, BAD_MASKS[config])
    for case in BAD_MASKS[config]:
        for method in ("train", "get_values"):
            key = f"{case}/{method}"
            if method == "get_values" and case == "loss_outside_attention":
                # get_values takes no loss_mask: nothing to refuse
                assert all(r[key]["outcome"] is None for r in results), key
                continue
            exc_type, message = _same_error_everywhere([r[key]["outcome"] for r in results])
            assert exc_type == "ValueError", (key, message)
            assert message.startswith(f"{method}: rank 1: "), (key, message)
            assert MASK_ERRORS[case] in message, (key, message)
            assert all(r[key]["unchanged"] for r in results), key
    for r in results:
        assert r["good_values_diff"] < TOL


def test_attention_hole_without_packing_runs_as_one_process(pool: RankPool) -> None:
    """The padded path keeps accepting a hole and computes what the single-process model
    does (the refusal above is for packing only)."""
    batch = make_batch(8, 7, seed=13)
    batch["attention_mask"][:, :5] = 1
    batch["attention_mask"][[1, 6], 2] = 0  # one hole on each dp rank
    batch["loss_mask"] *= batch["attention_mask"]
    for r in pool.run(rr.holes_padded_vs_reference, _cfg(), batch):
        assert r["values_diff"] < TOL
        assert r["weight_diff"] < TOL and r["loss_diff"] < 1e-6


# ------------------------------------------------------------ checkpoint loads (items 8, 9)
BAD_LOADS = {
    # kind: (the file the error names, words of the problem)
    "other_scheduler": ("trainer_state.pt", "does not fit this worker's LambdaLR"),
    "scheduler_two_groups": ("trainer_state.pt", "2 items != 1"),
    "bad_rng_rank1": ("rng_rank1.pt", "RNG state cannot be restored"),
    "float_rng_rank1": ("rng_rank1.pt", "RNG state cannot be restored"),
    "metadata_runs_code": (".metadata", "refused, no code may run"),
    "metadata_payload": (".metadata", "global os.makedirs is not allowed"),
    "bytes_item_runs_code": ("stored item optim.param_groups.0.lr: refused", "weights_only"),
}


@pytest.fixture(scope="module")
def bad_load_results(pool: RankPool, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    root = tmp_path_factory.mktemp("bad-loads")
    cfg = _cfg(lr=1e-2, warmup_steps=2)
    return pool.run(rr.bad_loads, cfg, make_batch(4, 6, seed=14), str(root), list(BAD_LOADS))


@pytest.mark.parametrize("kind", list(BAD_LOADS))
def test_bad_checkpoint_load_changes_nothing_on_every_rank(
    bad_load_results: list[Any], kind: str
) -> None:
    """Item 9: another scheduler's ``trainer_state.pt`` raised ``KeyError`` after the weights,
    optimizer state and groups were overwritten; a bad ``rng_rank1.pt`` raised on rank 1 only,
    after its state changed, while rank 0 returned. Item 8: a crafted ``.metadata`` or stored
    bytes item ran code (DCP unpickles both with plain ``pickle``). Now: the same
    ``CheckpointError`` on every rank naming the file, nothing changed, no code run."""
    name, problem = BAD_LOADS[kind]
    per_rank = [r[kind] for r in bad_load_results]
    for r in per_rank:
        assert not r["code_ran"], f"{kind}: loading the checkpoint ran code"
    exc_type, message = _same_error_everywhere([r["outcome"] for r in per_rank])
    assert exc_type == "CheckpointError", message
    assert name in message and problem in message, message
    assert len(message) < 1200, message  # one clear message, not a traceback
    for r in per_rank:
        assert r["unchanged"], f"{kind}: the failed load changed the worker"


def test_good_checkpoint_still_loads_after_bad_ones(bad_load_results: list[Any]) -> None:
    for r in bad_load_results:
        assert r["good"]["step"] == 1
        assert r["good"]["values_diff"] < TOL


class _Calls:
    """Unpickling this calls ``fn(*args)``: how a crafted pickle runs code."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.call = (fn, args)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.call


def _crafted(name: str, marker: Path) -> object:
    import builtins
    import os

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    return {
        "os.makedirs": _Calls(os.makedirs, str(marker)),
        "builtins.exec": _Calls(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
        "builtins.getattr": _Calls(getattr, "x", "upper"),
        "torch.load": _Calls(torch.load, str(marker)),
        "torch.save": _Calls(torch.save, 1, str(marker)),
        "FileSystemReader": _Calls(FileSystemReader, str(marker)),
    }[name]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.parametrize(
    "name",
    [
        "os.makedirs",
        "builtins.exec",
        "builtins.getattr",
        "torch.load",
        "torch.save",
        "FileSystemReader",
    ],
)
def test_metadata_allowlist_refuses_other_globals(tmp_path: Path, name: str) -> None:
    """Item 8, one process: ``.metadata`` pickles naming a global outside the allowlist (also
    torch functions and DCP classes that are not metadata records, alone or nested in real
    metadata) are refused before anything is called."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from ppo_value._safe_dcp import UnsafeCheckpointError, read_metadata

    marker = tmp_path / "code-ran"
    dcp.save({"w": torch.ones(2), "lr": 0.5}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    real = read_metadata(tmp_path / "ok" / ".metadata")  # a real file passes
    assert "w" in real.state_dict_metadata and "lr" in real.state_dict_metadata
    for payload in (_crafted(name, marker), real):
        if payload is real:
            real.planner_data = {"x": [_crafted(name, marker)]}
        file = tmp_path / ".metadata"
        file.write_bytes(pickle.dumps(payload))
        with pytest.raises(UnsafeCheckpointError, match="is not allowed in DCP metadata"):
            read_metadata(file)
        assert not marker.exists()


def test_metadata_pickle_may_not_set_attributes_of_an_allowed_class(tmp_path: Path) -> None:
    """``BUILD`` with a slot state on an allowed class object is ``setattr`` on the class: it
    is refused and undone (DCP's classes stay as they were)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from ppo_value._safe_dcp import UnsafeCheckpointError, read_metadata

    original_eq = Metadata.__eq__
    file = tmp_path / ".metadata"
    file.write_bytes(
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"  # push the class
        b"N}(X\x07\x00\x00\x00evilkeyK\x01X\x06\x00\x00\x00__eq__ctorch\nSize\nu"
        b"\x86b."  # BUILD (None, {"evilkey": 1, "__eq__": torch.Size}) on it
    )
    with pytest.raises(UnsafeCheckpointError, match="sets attributes of the class"):
        read_metadata(file)
    assert not hasattr(Metadata, "evilkey")
    assert Metadata.__eq__ is original_eq
