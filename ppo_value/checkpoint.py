"""Atomic sharded checkpoints with ``torch.distributed.checkpoint`` and Hugging Face export.

Layout of a checkpoint directory ``path``::

    path/dcp/                  DCP shards + .metadata (model and optimizer, FQN keyed)
    path/trainer_state.pt      step and LR-scheduler state (rank 0; plain data only)
    path/rng_rank{r}.pt        CPU (and CUDA) RNG state of rank r
    path/meta.json             step, mesh shape, config, model architecture; written last

A save goes to ``path.tmp`` and is committed by renames done on rank 0:
``path -> path.old``, ``path.tmp -> path``, then ``path.old`` is removed. A crash before the
renames leaves ``path`` untouched; a crash between them leaves ``path.old``, which
:func:`resolve_checkpoint` falls back to. DCP stores tensors by fully-qualified name with
global shapes, so a checkpoint loads at a different ``(dp, tp)`` mesh shape.

Every step that runs on some ranks only (rank 0's directory, file and rename steps) ends in
an agreement among all ranks (:func:`ppo_value._agree.agree`): if it failed anywhere, every
rank raises the same :class:`CheckpointError` at once instead of the others blocking until the
process-group timeout.

A load validates everything before it changes anything: the files are present and readable,
``.pt`` files are read with ``torch.load(weights_only=True)`` and DCP's pickled ``.metadata``
and stored non-tensor items through :mod:`ppo_value._safe_dcp` (an allowlist of DCP's
metadata classes, ``weights_only=True``), so no code runs from a crafted file; ``meta.json``
is valid, the scheduler state loads into this scheduler and every rank's
RNG state into a probe generator, and the checkpoint's model (architecture and parameter names
and shapes) equals the one it is loaded into; every rank agrees on the outcome, so a bad file
is the same :class:`CheckpointError` on every rank. The DCP shards are then read into fresh buffers and
copied into the model and optimizer only when every read succeeded, so a failed load leaves
the worker exactly as it was.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ppo_value._agree import agree, describe
from ppo_value._safe_dcp import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    read_metadata,
)

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "export_hf",
    "load_checkpoint",
    "model_architecture",
    "resolve_checkpoint",
    "save_checkpoint",
]

_META = "meta.json"
_TRAINER = "trainer_state.pt"

#: ``transformers`` config keys that decide the parameters or the forward of the supported
#: families; a checkpoint only loads into a model with the same values (those present).
_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and the problem.

    On a failed save the previous checkpoint at the path stays valid; on a failed load the
    model, optimizer, scheduler and RNG are unchanged.
    """


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _step(what: str, fn: Callable[[], None] | None) -> None:
    """Run ``fn`` on this rank (``None``: nothing to do here), then agree on all ranks."""
    error: BaseException | None = None
    if fn is not None:
        try:
            fn()
        # Any error is raised again on every rank by agree(); DCP's CheckpointException
        # derives from BaseException, not Exception.
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            error = exc
    agree(error, what=what, exc_type=CheckpointError)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def model_architecture(hf_config: Any) -> dict[str, Any]:
    """The architecture of a ``transformers`` config as plain JSON data (the keys of
    ``_ARCH_KEYS`` it has), stored in ``meta.json`` and compared on load."""
    data = hf_config.to_dict()
    return json.loads(json.dumps({k: data[k] for k in _ARCH_KEYS if k in data}))


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
        CheckpointError: on every rank, when any rank failed a step (file-system errors, a
            DCP write error); names the step, the first failing rank and its error. The
            previous checkpoint at ``path`` stays valid.
    """
    final = Path(path).absolute()
    tmp = final.with_name(final.name + ".tmp")
    old = final.with_name(final.name + ".old")
    rank = _rank()
    is_rank0 = rank == 0

    def make_tmp() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def write_shards() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")

    def write_rank0_files() -> None:
        trainer = {"step": int(step), "scheduler": scheduler.state_dict()}
        torch.save(trainer, tmp / _TRAINER)
        # Refuse now, not at load time, anything that needs more than plain data to read.
        torch.load(tmp / _TRAINER, weights_only=True)
        info = {"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1}
        info.update(meta or {})
        (tmp / _META).write_text(json.dumps(info, indent=2, sort_keys=True))

    def commit() -> None:
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    _step(f"save_checkpoint: creating {tmp}", make_tmp if is_rank0 else None)
    _step(f"save_checkpoint: writing the shards and RNG state to {tmp}", write_shards)
    _step(
        f"save_checkpoint: writing {tmp / _TRAINER} and {tmp / _META}",
        write_rank0_files if is_rank0 else None,
    )
    _step(f"save_checkpoint: committing {tmp} as {final}", commit if is_rank0 else None)
    if is_rank0:
        log.info("saved checkpoint step %d to %s", step, final)
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


def _load_plain(file: Path) -> Any:
    """``torch.load(weights_only=True)``; a file that needs pickled code is an error."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"{file}: cannot be read as plain tensors and containers ({describe(exc)}); "
            "it is loaded with torch.load(weights_only=True), which refuses arbitrary pickled "
            "objects"
        ) from exc


def _read_meta(src: Path) -> dict[str, Any]:
    file = src / _META
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable or not valid JSON ({describe(exc)})") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    return meta


def _read_trainer_state(src: Path) -> dict[str, Any]:
    file = src / _TRAINER
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    trainer = _load_plain(file)
    step = trainer.get("step") if isinstance(trainer, dict) else None
    if (
        not isinstance(trainer, dict)
        or not isinstance(step, int)
        or isinstance(step, bool)
        or step < 0
        or not isinstance(trainer.get("scheduler"), dict)
    ):
        raise CheckpointError(
            f"{file}: expected {{'step': int >= 0, 'scheduler': dict}}, got "
            f"{sorted(trainer) if isinstance(trainer, dict) else type(trainer).__name__}"
        )
    return trainer


def _kind(value: Any) -> str:
    """The kind of a plain state value, for comparing two scheduler states' structure."""
    if value is None or isinstance(value, bool | str | dict | torch.Tensor):
        return type(value).__name__ if value is not None else "None"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "list"
    return type(value).__name__


def _structure_diff(saved: Any, here: Any, where: str) -> list[str]:
    """Where ``saved`` does not have the structure of ``here``: the same dict keys, the same
    kinds of values (numbers, bools, strings, None, tensors), the same list lengths."""
    if _kind(saved) != _kind(here):
        return [f"{where}: {_kind(saved)} != {_kind(here)}"]
    if isinstance(here, dict):
        missing = sorted(map(str, set(here) - set(saved)))
        extra = sorted(map(str, set(saved) - set(here)))
        diff = []
        if missing:
            diff.append(f"{where}: keys missing {missing}")
        if extra:
            diff.append(f"{where}: unexpected keys {extra}")
        for key in sorted(set(here) & set(saved), key=str):
            diff += _structure_diff(saved[key], here[key], f"{where}[{key!r}]")
        return diff
    if isinstance(here, list | tuple):
        if len(saved) != len(here):
            return [f"{where}: {len(saved)} items != {len(here)}"]
        diff = []
        for i, (a, b) in enumerate(zip(saved, here, strict=True)):
            diff += _structure_diff(a, b, f"{where}[{i}]")
        return diff
    return []


def _check_scheduler_state(
    file: Path, state: dict[str, Any], scheduler: torch.optim.lr_scheduler.LRScheduler
) -> None:
    """Refuse a scheduler state this ``scheduler`` cannot load as it is: another scheduler's
    (other keys), or one of another number of parameter groups, then load it into a probe
    copy (the optimizer shared, not changed; the rest copied), so that the real load after
    the model and optimizer changed cannot fail (issue 23 item 9: a ``StepLR`` state raised
    ``KeyError`` in ``LambdaLR.load_state_dict`` after the weights were overwritten).

    Raises:
        CheckpointError: naming ``file``, the scheduler class and the differences.
    """
    name = type(scheduler).__name__
    diff = _structure_diff(state, scheduler.state_dict(), "scheduler")
    if diff:
        raise CheckpointError(
            f"{file}: the scheduler state does not fit this worker's {name} "
            f"(checkpoint != worker): {'; '.join(diff[:4])}"
        )
    probe = copy.copy(scheduler)
    probe.__dict__ = {
        k: v if k == "optimizer" else copy.deepcopy(v) for k, v in scheduler.__dict__.items()
    }
    try:
        probe.load_state_dict(copy.deepcopy(state))
        probe.get_last_lr()
    except Exception as exc:
        raise CheckpointError(
            f"{file}: the scheduler state cannot be loaded into this worker's {name} "
            f"({describe(exc)})"
        ) from exc


def _read_rng(src: Path) -> dict[str, Any] | None:
    """This rank's RNG state, checked by restoring it into probe generators (a state torch
    would refuse raised on this rank only, after the rest of the worker had changed)."""
    file = src / f"rng_rank{_rank()}.pt"
    if not file.is_file():
        return None
    rng = _load_plain(file)
    if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
        raise CheckpointError(f"{file}: expected {{'cpu': tensor, ...}} RNG state")
    if "cuda" in rng and not isinstance(rng["cuda"], torch.Tensor):
        raise CheckpointError(f"{file}: the 'cuda' RNG state is not a tensor")
    try:
        torch.Generator(device="cpu").set_state(rng["cpu"])
    except Exception as exc:
        raise CheckpointError(
            f"{file}: the 'cpu' RNG state cannot be restored ({describe(exc)})"
        ) from exc
    if "cuda" in rng and torch.cuda.is_available():
        # what torch.cuda.set_rng_state checks: a byte tensor of the current state's size
        # (not probed on a CUDA generator: the CI machines have no GPU to test that on)
        cur, new = torch.cuda.get_rng_state(), rng["cuda"]
        if new.dtype != cur.dtype or new.numel() != cur.numel():
            raise CheckpointError(
                f"{file}: the 'cuda' RNG state cannot be restored (expected a {cur.dtype} "
                f"tensor of {cur.numel()} elements, got {new.dtype} of {new.numel()})"
            )
    return rng


def _check_architecture(src: Path, meta: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    saved = meta.get("model")
    if saved is None:  # written before meta.json recorded it; the DCP check still applies
        return
    keys = sorted(set(saved) | set(expected))
    diff = [
        f"{k}: {saved.get(k)!r} != {expected.get(k)!r}"
        for k in keys
        if saved.get(k) != expected.get(k)
    ]
    if diff:
        raise CheckpointError(
            f"{src / _META}: the checkpoint's model differs from this worker's "
            f"(checkpoint != worker): {'; '.join(diff)}"
        )


def _check_model_tensors(src: Path, model_sd: Mapping[str, Any]) -> None:
    """The DCP metadata holds exactly this model's parameters, with the same global shapes."""
    file = src / "dcp" / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    try:
        metadata = read_metadata(file)
    except UnsafeCheckpointError as exc:
        raise CheckpointError(f"{file}: refused, no code may run from a checkpoint: {exc}") from exc
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"{file}: unreadable ({describe(exc)})") from exc
    saved = {
        k[len("model.") :]: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    here = {k: tuple(v.shape) for k, v in model_sd.items()}
    missing = sorted(set(here) - set(saved))
    extra = sorted(set(saved) - set(here))
    shapes = [
        f"{k} {saved[k]} != {here[k]}"
        for k in sorted(set(saved) & set(here))
        if saved[k] != here[k]
    ]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameter(s) of this model missing, e.g. {missing[:3]}")
        if extra:
            parts.append(f"{len(extra)} parameter(s) this model lacks, e.g. {extra[:3]}")
        if shapes:
            parts.append(f"shapes differ (checkpoint != worker): {shapes[:3]}")
        raise CheckpointError(
            f"{src / 'dcp'}: the checkpoint's model does not match this worker's: "
            + "; ".join(parts)
        )


def _dcp_failure(exc: CheckpointException) -> str:
    """The first rank's error of a DCP ``CheckpointException`` in one line (its own text is
    every rank's traceback), and the ranks that failed."""
    failures = dict(getattr(exc, "failures", None) or {})
    if not failures:
        return describe(exc)
    first = failures[min(failures)]
    error = first[0] if isinstance(first, tuple) else first
    return f"{describe(error)} (DCP failed on ranks {sorted(failures)})"


def _fresh_buffers(obj: Any) -> Any:
    """Same structure with new, uninitialised tensors (DTensors keep their placements)."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _fresh_buffers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fresh_buffers(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fresh_buffers(v) for v in obj)
    return copy.deepcopy(obj)


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    architecture: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Collectively load a checkpoint written by :func:`save_checkpoint` (any mesh shape).

    Validates first (files present and readable, ``.pt`` files as plain data with
    ``weights_only=True``, ``meta.json``, the model's architecture and parameter names and
    global shapes, a scheduler state this ``scheduler`` loads, an RNG state torch restores),
    on every rank, then reads the DCP shards into fresh buffers (transiently one more copy of
    this rank's model and optimizer shards), and only then restores model and optimizer
    (resharded to the current mesh), scheduler, and this rank's RNG state when the checkpoint
    has one for this rank.

    Args:
        architecture: :func:`model_architecture` of the model loaded into; compared with the
            one in ``meta.json`` (``None`` skips that comparison, not the parameter check).

    Returns:
        The ``meta.json`` content (with ``"step"``).

    Raises:
        FileNotFoundError: no complete checkpoint at ``path`` (see :func:`resolve_checkpoint`).
        CheckpointError: a file is missing, unreadable, unsafe or invalid, or the checkpoint
            is of another model; names the file and the problem. Raised on every rank, and
            nothing was changed.
    """
    resolved: list[Path] = []
    error: BaseException | None = None
    try:
        resolved.append(resolve_checkpoint(path))
    except FileNotFoundError as exc:
        error = exc
    agree(error, what="load_checkpoint", exc_type=FileNotFoundError)
    src = resolved[0]

    found: dict[str, Any] = {}

    def validate() -> None:
        found["meta"] = _read_meta(src)
        found["trainer"] = _read_trainer_state(src)
        _check_scheduler_state(src / _TRAINER, found["trainer"]["scheduler"], scheduler)
        found["rng"] = _read_rng(src)
        if architecture is not None:
            _check_architecture(src, found["meta"], architecture)
        # get_model_state_dict, not get_state_dict: the latter initialises an optimizer that
        # has never stepped (a zero-lr step), which a refused load must not do.
        _check_model_tensors(src, get_model_state_dict(model))

    _step("load_checkpoint", validate)
    never_stepped = not optimizer.state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": _fresh_buffers(model_sd), "optim": _fresh_buffers(optim_sd)}

    def read_shards() -> None:
        # metadata through the allowlist, stored bytes items with weights_only=True: DCP's
        # own reader and planner unpickle both without restriction (issue 23 item 8)
        try:
            dcp.load(
                state,
                checkpoint_id=str(src / "dcp"),
                storage_reader=SafeFileSystemReader(src / "dcp"),
                planner=SafeLoadPlanner(),
            )
        except CheckpointException as exc:
            raise CheckpointError(_dcp_failure(exc)) from exc

    try:
        _step(f"load_checkpoint: reading {src / 'dcp'}", read_shards)
    except CheckpointError:
        if never_stepped:  # undo get_state_dict's initialisation of the optimizer state
            optimizer.state.clear()
        raise
    # Everything is read and checked: from here on nothing is expected to fail.
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    trainer = found["trainer"]
    scheduler.load_state_dict(trainer["scheduler"])
    rng = found["rng"]
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        log.warning("no RNG state for rank %d in %s (different world size)", _rank(), src)
    meta: dict[str, Any] = found["meta"]
    meta["step"] = int(trainer["step"])
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

    Raises:
        CheckpointError: on every rank, when rank 0 failed to write.
    """
    from safetensors.torch import save_file

    out = Path(path).absolute()
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )

    def write() -> None:
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in full.items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = copy.deepcopy(hf_config)
        family = {"qwen2": "Qwen2", "llama": "Llama"}[cfg.model_type]
        cfg.architectures = [f"{family}ForTokenClassification"]
        cfg.num_labels = 1
        cfg.save_pretrained(str(out))
        log.info("exported %d tensors to %s", len(tensors), out)

    _step(f"export_hf: writing {out}", write if _rank() == 0 else None)
    return out
