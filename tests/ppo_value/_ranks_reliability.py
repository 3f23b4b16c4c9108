"""Rank functions for ``test_reliability.py`` (issue 23, items 7, 8, 9, 18) on a real 2-rank
gloo group. Module level, so :class:`dtensor_patches.testing.RankPool` can send them.

Each returns plain data; errors are caught per case and returned as ``(type name, message)``
so that one run checks several cases and a test can compare the outcome of every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ppo_value.config import ValueConfig
from ppo_value.model import build_value_model
from ppo_value.worker import ValueWorker
from tests.ppo_value._ranks import dp_slice
from tests.ppo_value._ranks_failures import _outcome, _same, _snapshot
from tests.ppo_value.reference import reference_train_step, reference_values


# ------------------------------------------------------------ fully masked sequences (item 7)
def masked_sequences_vs_reference(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], micro_batch_size: int
) -> dict[str, Any]:
    """``get_values`` and one ``train`` step on a batch whose fully masked sequences (chosen
    by the caller) fall on one dp rank, against the single-process model on the whole batch.

    Returns the outcome of each call (``None``: it returned), the values and the differences
    to the reference (values at valid positions, weights, loss, grad norm)."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    got: dict[str, Any] = {}
    values_outcome = _outcome(
        lambda: got.update(values=worker.get_values(local, micro_batch_size=micro_batch_size))
    )
    train_outcome = _outcome(
        lambda: got.update(metrics=worker.train(local, micro_batch_size=micro_batch_size))
    )
    out: dict[str, Any] = {"values_outcome": values_outcome, "train_outcome": train_outcome}
    if values_outcome is None:
        ref = dp_slice({"v": reference_values(build_value_model(cfg), batch)}, cfg.dp, cfg.tp)
        valid = local["attention_mask"].bool()
        values = got["values"]
        diff = (values - ref["v"]).abs()[valid]
        out["values_diff"] = float(diff.max()) if diff.numel() else 0.0
        out["values_finite"] = bool(torch.isfinite(values).all())
    if train_outcome is None:
        ref_model = build_value_model(cfg)
        ref_metrics = reference_train_step(ref_model, cfg, batch)
        after = worker.full_state_dict()
        ref_sd = ref_model.state_dict()
        metrics = got["metrics"]
        out["weight_diff"] = max(float((after[k] - ref_sd[k]).abs().max()) for k in ref_sd)
        out["loss_diff"] = abs(metrics["critic/loss"] - ref_metrics["loss"])
        out["grad_norm_diff"] = abs(metrics["critic/grad_norm"] - ref_metrics["grad_norm"])
        out["skipped"] = metrics["critic/skipped_step"]
    return out


# ------------------------------------------------------------ masks packing cannot honour (18)
def _spoil_masks(case: str, b: dict[str, torch.Tensor]) -> None:
    """Spoil the masks of this rank's batch ``b`` in place (the caller picks the rank)."""
    if case == "loss_outside_attention":
        length = int(b["attention_mask"][1].sum())
        b["loss_mask"][1, length] = 1  # the first padding position
    elif case == "attention_hole":
        b["attention_mask"][0, 3] = 0  # a hole inside sequence 0 (loss_mask 0 there too)
        b["loss_mask"][0, 3] = 0
    elif case == "left_padded":
        length = int(b["attention_mask"][1].sum())
        width = b["attention_mask"].shape[1]
        for key in ("attention_mask", "loss_mask"):
            b[key][1] = b[key][1].roll(width - length)
    else:
        raise ValueError(case)


def bad_masks(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], cases: list[str]
) -> dict[str, Any]:
    """For each case, spoil the masks on the last dp rank only and call ``train`` and
    ``get_values``; return each outcome and whether the worker is unchanged, then the values
    of a good call against the single-process model (the group is not stuck)."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    spoil = dist.get_rank() // cfg.tp == cfg.dp - 1
    results: dict[str, Any] = {}
    for case in cases:
        b = {k: v.clone() for k, v in local.items()}
        if spoil:
            _spoil_masks(case, b)
        for method in ("train", "get_values"):
            before = _snapshot(worker)
            outcome = _outcome(lambda b=b, m=method: getattr(worker, m)(b))
            results[f"{case}/{method}"] = {
                "outcome": outcome,
                "unchanged": _same(before, _snapshot(worker)),
            }
    ref = dp_slice({"v": reference_values(build_value_model(cfg), batch)}, cfg.dp, cfg.tp)["v"]
    valid = local["attention_mask"].bool()
    results["good_values_diff"] = float((worker.get_values(local) - ref).abs()[valid].max())
    return results


def holes_padded_vs_reference(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Without packing an ``attention_mask`` with a hole runs as the single-process model
    does: values at valid positions and one train step against the reference."""
    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    worker = ValueWorker(cfg)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    values = worker.get_values(local)
    ref = dp_slice({"v": reference_values(build_value_model(cfg), batch)}, cfg.dp, cfg.tp)["v"]
    valid = local["attention_mask"].bool()
    metrics = worker.train(local, micro_batch_size=2)
    ref_model = build_value_model(cfg)
    ref_metrics = reference_train_step(ref_model, cfg, batch)
    after = worker.full_state_dict()
    ref_sd = ref_model.state_dict()
    return {
        "values_diff": float((values - ref).abs()[valid].max()),
        "weight_diff": max(float((after[k] - ref_sd[k]).abs().max()) for k in ref_sd),
        "loss_diff": abs(metrics["critic/loss"] - ref_metrics["loss"]),
    }


# ------------------------------------------------------------ checkpoint loads (items 8, 9)
def _groups(worker: ValueWorker) -> str:
    """The optimizer's parameter groups without their parameters (lr, betas, ...)."""
    return repr(
        [{k: v for k, v in g.items() if k != "params"} for g in worker.optimizer.param_groups]
    )


def _other_scheduler_state(kind: str) -> dict[str, Any]:
    """A plain-data scheduler state of another scheduler (``StepLR``) or of a ``LambdaLR`` over
    two parameter groups (this worker's optimizer has one)."""
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    if kind == "other_scheduler":
        opt = torch.optim.SGD(params[:1], lr=0.1)
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3).state_dict()
    opt = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=0.1)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0).state_dict()


def _craft_metadata(kind: str, dcp_dir: Any, marker: str) -> None:
    """Write a crafted ``.metadata`` (item 8): a bare pickle that runs code, or the real
    metadata carrying such an object in ``planner_data``."""
    import pickle

    from tests.ppo_value._ranks_failures import _RunsCode

    file = dcp_dir / ".metadata"
    if kind == "metadata_runs_code":
        file.write_bytes(pickle.dumps(_RunsCode(marker)))
        return
    with open(file, "rb") as f:
        metadata = pickle.load(f)  # the test's own good file
    metadata.planner_data = {"payload": _RunsCode(marker)}
    file.write_bytes(pickle.dumps(metadata))


def _craft_bytes_item(dcp_dir: Any, marker: str) -> None:
    """Point the stored bytes of a non-tensor item (``optim.param_groups.0.lr``) at a pickle
    appended to its shard that runs code when DCP's default planner ``torch.load``s it with
    ``weights_only=False`` (item 8: any other pickle a load reads)."""
    import dataclasses
    import io
    import pickle

    from tests.ppo_value._ranks_failures import _RunsCode

    file = dcp_dir / ".metadata"
    with open(file, "rb") as f:
        metadata = pickle.load(f)
    buf = io.BytesIO()
    torch.save(_RunsCode(marker), buf)
    payload = buf.getvalue()
    hits = [i for i in metadata.storage_data if i.fqn == "optim.param_groups.0.lr"]
    assert hits, sorted(i.fqn for i in metadata.storage_data)[:10]
    for index in hits:
        info = metadata.storage_data[index]
        shard = dcp_dir / info.relative_path
        offset = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(payload)
        metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    file.write_bytes(pickle.dumps(metadata))


def _corrupt_checkpoint(kind: str, ckpt: Any, marker: str) -> None:
    if kind in ("other_scheduler", "scheduler_two_groups"):
        torch.save(
            {"step": 1, "scheduler": _other_scheduler_state(kind)}, ckpt / "trainer_state.pt"
        )
    elif kind == "bad_rng_rank1":
        torch.save({"cpu": torch.zeros(16, dtype=torch.uint8)}, ckpt / "rng_rank1.pt")
    elif kind == "float_rng_rank1":
        torch.save({"cpu": torch.zeros(5056)}, ckpt / "rng_rank1.pt")
    elif kind in ("metadata_runs_code", "metadata_payload"):
        _craft_metadata(kind, ckpt / "dcp", marker)
    elif kind == "bytes_item_runs_code":
        _craft_bytes_item(ckpt / "dcp", marker)
    else:
        raise ValueError(kind)


def bad_loads(
    cfg_dict: dict[str, Any], batch: dict[str, torch.Tensor], root: str, kinds: list[str]
) -> dict[str, Any]:
    """Train, save a good checkpoint, train on; then for each kind load a copy of the good
    checkpoint that rank 0 spoiled. Returns each load's outcome, whether the worker (weights,
    optimizer state and groups, step, scheduler, RNG) is unchanged and whether code ran; then
    the values after loading the good checkpoint against those it was saved with."""
    import os
    import pathlib
    import shutil

    torch.set_num_threads(1)
    cfg = ValueConfig.from_dict(cfg_dict)
    local = dp_slice(batch, cfg.dp, cfg.tp)
    rootp = pathlib.Path(root)
    worker = ValueWorker(cfg)
    worker.train(local)
    good = rootp / "good"
    worker.save_checkpoint(good)
    saved_values = worker.get_values(local)
    worker.train(local)
    results: dict[str, Any] = {}
    for kind in kinds:
        ckpt = rootp / kind
        marker = str(rootp / f"{kind}-code-ran")
        if dist.get_rank() == 0:
            shutil.copytree(good, ckpt)
            _corrupt_checkpoint(kind, ckpt, marker)
        dist.barrier()
        before, groups = _snapshot(worker), _groups(worker)
        outcome = _outcome(lambda ckpt=ckpt: worker.load_checkpoint(ckpt))
        results[kind] = {
            "outcome": outcome,
            "unchanged": _same(before, _snapshot(worker)) and groups == _groups(worker),
            "code_ran": os.path.exists(marker),
        }
        dist.barrier()
    meta = worker.load_checkpoint(good)
    results["good"] = {
        "step": meta["step"],
        "values_diff": float((worker.get_values(local) - saved_values).abs().max()),
    }
    return results
