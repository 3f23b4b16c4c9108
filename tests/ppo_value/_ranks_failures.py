"""Rank functions for ``test_failures.py``: bad input, bad files and failing steps on a real
2-rank gloo group. Module level, so :class:`dtensor_patches.testing.RankPool` can send them.

Each returns plain data (strings, floats, CPU tensors). Errors are caught per case and
returned as ``(type name, message)`` so one run can check several cases.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ppo_value.config import ValueConfig
from ppo_value.model import build_value_model
from ppo_value.worker import ValueWorker
from tests.ppo_value._ranks import dp_slice
from tests.ppo_value.reference import reference_train_step, reference_values

Outcome = tuple[str, str] | None  # (exception type, message), or None when no error


def _outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the error is the result under test
        return type(exc).__name__, str(exc)
    return None


def _snapshot(worker: ValueWorker) -> dict[str, Any]:
    """Everything a failed call must leave as it was, as plain CPU copies."""
    from tests.ppo_value._ranks import _full_optim_state

    return {
        "weights": worker.full_state_dict(),
        "optim": _full_optim_state(worker),
        "step": worker.step,
        "scheduler": repr(worker.scheduler.state_dict()),
        "rng": torch.get_rng_state().clone(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    tensors_equal = all(
        a[part].keys() == b[part].keys()
        and all(torch.equal(a[part][k], b[part][k]) for k in a[part])
        for part in ("weights", "optim")
    )
    return (
        tensors_equal
        and a["step"] == b["step"]
        and a["scheduler"] == b["scheduler"]
        and torch.equal(a["rng"], b["rng"])
    )


# ------------------------------------------------------------------ checkpoints (items 1, 2)
class _RunsCode:
    """Unpickling this creates the directory ``marker``: a stand-in for arbitrary code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (self.marker,))


def _truncate(file: pathlib.Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _corrupt(kind: str, ckpt: pathlib.Path, marker: str) -> None:
    if kind == "pickled_code":
        torch.save(
            {"step": 1, "scheduler": {}, "payload": _RunsCode(marker)}, ckpt / "trainer_state.pt"
        )
    elif kind == "truncated_trainer_state":
        _truncate(ckpt / "trainer_state.pt")
    elif kind == "missing_trainer_state":
        (ckpt / "trainer_state.pt").unlink()
    elif kind == "invalid_meta":
        (ckpt / "meta.json").write_text('{"step": 1, "dp"')
    elif kind == "truncated_rng":
        _truncate(ckpt / "rng_rank1.pt")
    elif kind == "truncated_shard":
        for shard in sorted((ckpt / "dcp").glob("*.distcp")):
            _truncate(shard)
    elif kind == "missing_dcp_metadata":
        (ckpt / "dcp" / ".metadata").unlink()
    elif kind not in ("other_model_2_layers", "other_model_rope"):
        raise ValueError(kind)


def bad_checkpoints(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], root: str, kinds: list[str]
) -> dict[str, dict[str, Any]]:
    """For each kind of bad checkpoint: the load's outcome and whether the worker is unchanged.

    A 1-layer worker trains, saves a good checkpoint, trains on (so a load would visibly
    change it), then loads a corrupted copy of the checkpoint for each kind; the
    ``other_model_*`` kinds load a good checkpoint of a 2-layer model / another RoPE base.
    """
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = ValueConfig.from_dict(cfg_dict)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    rootp = pathlib.Path(root)
    others = {
        "other_model_2_layers": cfg.replace(
            model_config={**cfg.model_config, "num_hidden_layers": 2}
        ),
        "other_model_rope": cfg.replace(model_config={**cfg.model_config, "rope_theta": 500.0}),
    }
    for kind, other_cfg in others.items():
        if kind in kinds:
            other = ValueWorker(other_cfg)
            other.train(local)
            other.save_checkpoint(rootp / kind)
            del other
    worker = ValueWorker(cfg)
    worker.train(local)
    good = rootp / "good"
    worker.save_checkpoint(good)
    worker.train(local)
    results: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        ckpt = rootp / kind
        marker = str(rootp / f"{kind}-code-ran")
        if rank == 0 and kind not in others:
            shutil.copytree(good, ckpt)
            _corrupt(kind, ckpt, marker)
        dist.barrier()
        before = _snapshot(worker)
        outcome = _outcome(lambda ckpt=ckpt: worker.load_checkpoint(ckpt))
        after = _snapshot(worker)
        results[kind] = {
            "outcome": outcome,
            "unchanged": _same(before, after),
            "code_ran": os.path.exists(marker),
        }
        dist.barrier()
    # A worker that never stepped: a refused load must not initialise its optimizer either.
    fresh = ValueWorker(cfg.replace(seed=cfg.seed + 3))
    weights = fresh.full_state_dict()
    for kind in ("missing_trainer_state", "truncated_shard"):
        if kind in kinds:
            outcome = _outcome(lambda kind=kind: fresh.load_checkpoint(rootp / kind))
            after = fresh.full_state_dict()
            results[kind]["fresh_unchanged"] = (
                outcome is not None
                and not fresh.optimizer.state
                and all(torch.equal(weights[k], after[k]) for k in weights)
            )
    # the worker still loads a good checkpoint afterwards
    meta = worker.load_checkpoint(good)
    results["good"] = {"step": meta["step"], "worker_step": worker.step}
    return results


# ------------------------------------------------------------------ rank-0 save failures (3)
@contextmanager
def _failing_on_rank0(method: str) -> Iterator[None]:
    """Make ``pathlib.Path.<method>`` raise on rank 0 only, like a full or read-only disk."""
    original = getattr(pathlib.Path, method)

    def failing(self: pathlib.Path, *args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device (injected)", str(self))

    if dist.get_rank() == 0:
        setattr(pathlib.Path, method, failing)
    try:
        yield
    finally:
        setattr(pathlib.Path, method, original)


def rank0_save_failures(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], root: str, stages: list[str]
) -> dict[str, Any]:
    """Save a good checkpoint, then fail one rank-0-only step of the next save per stage.

    Stages: ``mkdir`` (creating ``path.tmp``), ``write_text`` (``meta.json``), ``rename``
    (the commit), ``export`` (``export_hf``'s directory). Returns each stage's outcome per
    rank and whether the good checkpoint still loads with the values it was saved with.
    """
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    worker = ValueWorker(cfg)
    worker.train(local)
    path = pathlib.Path(root) / "ckpt"
    worker.save_checkpoint(path)
    good = worker.get_values(local)
    worker.train(local)
    results: dict[str, Any] = {}
    for stage in stages:
        if stage == "export":
            with _failing_on_rank0("mkdir"):
                outcome = _outcome(lambda: worker.export_hf(pathlib.Path(root) / "hf"))
        else:
            with _failing_on_rank0(stage):
                outcome = _outcome(lambda: worker.save_checkpoint(path))
        results[stage] = outcome
    fresh = ValueWorker(cfg.replace(seed=cfg.seed + 1))
    fresh.load_checkpoint(path)
    results["good_diff"] = float((fresh.get_values(local) - good).abs().max())
    worker.save_checkpoint(path)  # and saving works again
    results["after"] = sorted(p.name for p in pathlib.Path(root).iterdir())
    return results


# ------------------------------------------------------------------ batches (items 5, 6, 7)
def masked_garbage_vs_reference(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Train on a batch with NaN/inf at every ``loss_mask == 0`` position of ``old_values``
    and ``returns``; compare with one single-process step on the clean batch."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    masked = batch["loss_mask"] == 0
    poisoned = dict(batch)
    poisoned["returns"] = batch["returns"].masked_fill(masked, float("nan"))
    poisoned["old_values"] = batch["old_values"].masked_fill(masked, float("inf"))
    metrics = worker.train(dp_slice(poisoned, cfg.dp, cfg.tp), micro_batch_size=2)
    ref_model = build_value_model(cfg)
    ref = reference_train_step(ref_model, cfg, batch)
    after = worker.full_state_dict()
    ref_sd = ref_model.state_dict()
    return {
        "skipped": metrics["critic/skipped_step"],
        "weight_diff": max(float((after[k] - ref_sd[k]).abs().max()) for k in ref_sd),
        "loss_diff": abs(metrics["critic/loss"] - ref["loss"]),
        "grad_norm_diff": abs(metrics["critic/grad_norm"] - ref["grad_norm"]),
        "ev_diff": abs(metrics["critic/explained_var"] - ref["explained_var"]),
        "stats_diff": max(
            abs(metrics[f"critic/{k}"] - ref[k])
            for k in ("values_mean", "values_min", "values_max", "returns_mean")
        ),
    }


def bad_batches(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], cases: list[str]
) -> dict[str, Any]:
    """Each case spoils the batch (on dp rank 1 only where the data is per rank) and calls
    ``get_values`` or ``train``; returns each outcome, whether the worker is unchanged, and
    the values of a good call at the end (the group is not stuck in a collective)."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    vocab = int(worker.hf_config.vocab_size)
    dp_idx = dist.get_rank() // cfg.tp
    local = dp_slice(batch, cfg.dp, cfg.tp)
    results: dict[str, Any] = {}
    for case in cases:
        b = {k: v.clone() for k, v in local.items()}
        kwargs: dict[str, Any] = {}
        method = "train"
        spoil = dp_idx == cfg.dp - 1  # the last dp rank only
        if case == "id_too_large":
            method = "get_values"
            if spoil:
                b["input_ids"][1, 2] = vocab
        elif case == "id_negative":
            if spoil:
                b["input_ids"][0, 1] = -1
        elif case == "nan_return_at_valid":
            if spoil:
                b["returns"][1, 3] = float("nan")
                assert b["loss_mask"][1, 3] == 1
        elif case == "inf_old_value_at_valid":
            if spoil:
                b["old_values"][0, 2] = float("inf")
                assert b["loss_mask"][0, 2] == 1
        elif case == "mask_not_01":
            if spoil:
                b["loss_mask"][0, 2] = 2
        elif case.startswith("micro_"):
            method, size = case.removeprefix("micro_").rsplit("_", 1)
            kwargs["micro_batch_size"] = {"zero": 0, "negative": -1, "float": 1.5, "bool": True}[
                size
            ]
        else:
            raise ValueError(case)
        before = _snapshot(worker)
        outcome = _outcome(lambda b=b, m=method, kw=kwargs: getattr(worker, m)(b, **kw))
        results[case] = {"outcome": outcome, "unchanged": _same(before, _snapshot(worker))}
    results["values_after"] = worker.get_values(local)
    results["reference"] = dp_slice(
        {"v": reference_values(build_value_model(cfg), batch)}, cfg.dp, cfg.tp
    )["v"]
    return results


# ------------------------------------------------------------------ TP without SP (item 8)
def activation_layout(cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Values vs the single-process model, one train step vs the reference step, and the
    placement and global sequence length of the activations after the embedding and after
    the first decoder layer."""
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    seen: dict[str, Any] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, DTensor):
                placement = out.placements[-1]
                kind = (
                    f"Shard({placement.dim})" if placement.is_shard() else type(placement).__name__
                )
                seen[name] = (kind, int(out.shape[1]))
            else:
                seen[name] = ("local", int(out.shape[1]))

        return hook

    backbone = worker.model.model
    backbone.embed_tokens.register_forward_hook(record("embed_tokens"))
    backbone.layers[0].register_forward_hook(record("layer0"))
    local = dp_slice(batch, cfg.dp, cfg.tp)
    got = worker.get_values(local)
    ref = dp_slice({"v": reference_values(build_value_model(cfg), batch)}, cfg.dp, cfg.tp)["v"]
    mask = local["attention_mask"].bool()
    metrics = worker.train(local, micro_batch_size=2)
    ref_model = build_value_model(cfg)
    ref_metrics = reference_train_step(ref_model, cfg, batch)
    after = worker.full_state_dict()
    ref_sd = ref_model.state_dict()
    return {
        "values_diff": float((got - ref).abs()[mask].max()),
        "weight_diff": max(float((after[k] - ref_sd[k]).abs().max()) for k in ref_sd),
        "loss_diff": abs(metrics["critic/loss"] - ref_metrics["loss"]),
        "layout": seen,
    }


# ------------------------------------------------------------------ patch report (item 9)
def worker_with_failed_patch(cfg_dict: dict[str, Any], name: str) -> Outcome:
    """Build a worker while ``apply_all()``'s report says patch ``name`` failed."""
    import dataclasses

    import dtensor_patches
    from dtensor_patches.report import Outcome as PatchOutcome
    from dtensor_patches.report import Report, Status

    real = dtensor_patches.apply_all()

    def apply_all_with_failure(**_kwargs: Any) -> Report:
        outcomes = tuple(
            PatchOutcome(o.name, Status.FAILED, "torch moved an internal (injected)")
            if o.name == name
            else o
            for o in real
        )
        return dataclasses.replace(real, outcomes=outcomes)

    original = dtensor_patches.apply_all
    dtensor_patches.apply_all = apply_all_with_failure  # type: ignore[assignment]
    try:
        return _outcome(lambda: ValueWorker(ValueConfig.from_dict(cfg_dict)))
    finally:
        dtensor_patches.apply_all = original  # type: ignore[assignment]
