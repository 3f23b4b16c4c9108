"""All ranks agree on whether a step succeeded.

A step that fails on some ranks only (a rank-0-only file write, a batch that is bad on one
dp rank) would otherwise leave the other ranks blocked in their next collective until the
process-group timeout (30 minutes by default). :func:`agree` is a collective: every rank says
whether its part of the step failed, and if any did, every rank raises the same error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["agree", "describe"]


def describe(exc: BaseException) -> str:
    """``"TypeName: message"`` for an error, as it travels between ranks."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(
    error: BaseException | None,
    *,
    what: str,
    exc_type: type[Exception] = RuntimeError,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Collective over ``group`` (default: the whole world): raise on every rank if any failed.

    Costs one 1-element all-reduce when every rank succeeded; on failure also one
    ``all_gather_object`` of the error texts.

    Args:
        error: this rank's error, or ``None`` if its part of the step succeeded.
        what: the step, for the message (e.g. ``"save_checkpoint: writing meta.json"``).
        exc_type: the type raised on every rank; it is built from one message string.
        group: the process group that must agree.

    Raises:
        exc_type: ``"{what}: rank R: {error}"`` (the error's type name is kept unless it is an
            ``exc_type`` already) naming the first failing rank (lowest rank),
            and the other failing ranks if any; the local error, if any, is the ``__cause__``.
            Without an initialised process group, ``error`` is wrapped the same way.
    """
    text = None
    if error is not None:
        text = str(error) if isinstance(error, exc_type) else describe(error)
    if not dist.is_available() or not dist.is_initialized():
        if text is not None:
            raise exc_type(f"{what}: {text}") from error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return
    mine = None if text is None else (dist.get_rank(), text)
    gathered: list[tuple[int, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    failures = sorted(f for f in gathered if f is not None)
    rank, first = failures[0]
    message = f"{what}: rank {rank}: {first}"
    if len(failures) > 1:
        message += f" (failed on ranks {[r for r, _ in failures]})"
    raise exc_type(message) from error
