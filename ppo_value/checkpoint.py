"""Atomic sharded checkpoints with ``torch.distributed.checkpoint`` and Hugging Face export.

Layout of a checkpoint directory ``path``::

    path/dcp/                  DCP shards + .metadata (model and optimizer, FQN keyed)
    path/trainer_state.pt      step and LR-scheduler state (rank 0)
    path/rng_rank{r}.pt        CPU (and CUDA) RNG state of rank r
    path/meta.json             step, mesh shape, config; written last

A save goes to ``path.tmp`` and is committed by renames done on rank 0 after a barrier:
``path -> path.old``, ``path.tmp -> path``, then ``path.old`` is removed. A crash before the
renames leaves ``path`` untouched; a crash between them leaves ``path.old``, which
:func:`resolve_checkpoint` falls back to. DCP stores tensors by fully-qualified name with
global shapes, so a checkpoint loads at a different ``(dp, tp)`` mesh shape.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

log = logging.getLogger(__name__)

__all__ = ["export_hf", "load_checkpoint", "resolve_checkpoint", "save_checkpoint"]

_META = "meta.json"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Collectively save model, optimizer, scheduler, step and RNG to ``path`` atomically.

    Every rank must call it. ``meta`` (JSON-serialisable) is stored in ``meta.json``.
    Saving before the first optimiser step makes ``get_state_dict`` create the optimiser state
    with a zero-learning-rate step (torch behaviour), so Adam's step count starts at 1.

    Returns:
        The absolute checkpoint path.

    Raises:
        OSError: on file-system errors; the previous checkpoint at ``path`` stays valid.
    """
    final = Path(path).absolute()
    tmp = final.with_name(final.name + ".tmp")
    old = final.with_name(final.name + ".old")
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save({"step": step, "scheduler": scheduler.state_dict()}, tmp / "trainer_state.pt")
        info = {"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1}
        info.update(meta or {})
        (tmp / _META).write_text(json.dumps(info, indent=2, sort_keys=True))
    _barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        log.info("saved checkpoint step %d to %s", step, final)
    _barrier()
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """The directory to load for ``path``: ``path`` if complete, else ``path.old`` if complete
    (a save crashed between its two renames).

    Raises:
        FileNotFoundError: if neither holds a complete checkpoint (``meta.json`` present).
    """
    final = Path(path).absolute()
    if (final / _META).is_file():
        return final
    old = final.with_name(final.name + ".old")
    if (old / _META).is_file():
        log.warning("checkpoint %s incomplete or missing; using %s", final, old)
        return old
    raise FileNotFoundError(f"no complete checkpoint at {final} (no {_META})")


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Collectively load a checkpoint written by :func:`save_checkpoint` (any mesh shape).

    Restores model and optimizer (resharded to the current mesh), scheduler, and this rank's
    RNG state when the checkpoint has one for this rank.

    Returns:
        The ``meta.json`` content (with ``"step"``).

    Raises:
        FileNotFoundError: no complete checkpoint at ``path`` (see :func:`resolve_checkpoint`).
    """
    src = resolve_checkpoint(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(src / "dcp"))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    trainer = torch.load(src / "trainer_state.pt", weights_only=False)
    scheduler.load_state_dict(trainer["scheduler"])
    rng_file = src / f"rng_rank{_rank()}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        log.warning("no RNG state for rank %d in %s (different world size)", _rank(), src)
    meta: dict[str, Any] = json.loads((src / _META).read_text())
    meta["step"] = int(trainer["step"])
    _barrier()
    return meta


def export_hf(path: str | Path, *, model: nn.Module, hf_config: Any) -> Path:
    """Collectively write a consolidated ``*ForTokenClassification`` (``num_labels=1``)
    checkpoint: ``model.safetensors`` and ``config.json``, loadable with
    ``transformers.AutoModelForTokenClassification.from_pretrained(path)``. Rank 0 writes.

    Args:
        path: output directory (created).
        model: the (sharded) :class:`~ppo_value.model.ValueModel`.
        hf_config: the backbone's ``transformers`` config (copied, not modified).

    Returns:
        The absolute export path.
    """
    import copy

    from safetensors.torch import save_file

    out = Path(path).absolute()
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in full.items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = copy.deepcopy(hf_config)
        family = {"qwen2": "Qwen2", "llama": "Llama"}[cfg.model_type]
        cfg.architectures = [f"{family}ForTokenClassification"]
        cfg.num_labels = 1
        cfg.save_pretrained(str(out))
        log.info("exported %d tensors to %s", len(tensors), out)
    _barrier()
    return out
