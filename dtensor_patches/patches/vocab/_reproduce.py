"""The vocab-parallel patches' reproducer: single-device values and gradients, and no
collective as large as a shard of the logits (the bug is a gather of ``[batch, seq, vocab]``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtensor_patches.comm_bytes import CommBytes
from dtensor_patches.reproducers import compare, failure_of, randn

Trigger = Callable[..., Any]


def _outputs(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def moves_no_full_tensor(
    mesh: Any,
    cases: Sequence[tuple[str, Trigger]],
    *,
    shape: tuple[int, ...],
    extra: Callable[[], Sequence[torch.Tensor]] = tuple,
) -> str | None:
    """Run each ``(label, fn)`` as ``fn(logits, *extra())`` on plain tensors and on ``Shard(-1)``
    logits (the extra tensors replicated); ``None`` when every output equals the single device
    and the rank received fewer bytes in all of the case's collectives than an all-gather of
    the logits brings it (the other ranks' shards: ``(world - 1) / world`` of the logits, its
    own shard's size on 2 ranks), else what is wrong. Not the shard's size: a reduction's
    statistics per row (and topk's ``k`` candidates per rank) grow with the ranks while the
    shards shrink, so on 4 ranks the tiny logits here would fail a fix that moves nothing
    like the logits."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    logits = randn(*shape)
    world = mesh.size()
    gather_bytes = logits.numel() * logits.element_size() * (world - 1) // world
    for label, fn in cases:
        expected = _outputs(fn(logits.clone(), *extra()))
        dist_logits = distribute_tensor(logits, mesh, [Shard(logits.ndim - 1)])
        rest = [distribute_tensor(t, mesh, [Replicate()]) for t in extra()]
        with CommBytes() as comm:
            got, error = failure_of(lambda fn=fn, x=dist_logits, rest=rest: _outputs(fn(x, *rest)))
        if error is not None:
            return f"{label}: {error}"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            full = g.full_tensor() if hasattr(g, "full_tensor") else g
            problem = compare(full, e, what=f"{label} output {i}")
            if problem is not None:
                return problem
        if comm.received >= gather_bytes:
            return (
                f"{label}: moved {comm.received} bytes to this rank ({dict(comm.calls)}), "
                f"at least what an all-gather of the logits brings it ({gather_bytes} bytes)"
            )
    return None
