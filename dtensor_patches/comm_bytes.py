"""Bytes a rank receives in collectives, counted in a dispatch mode as ``CommDebugMode`` counts
collectives, for checking a strategy's traffic against the lower bound of its computation.

The count is what the collective delivers to this rank: an all-reduce or broadcast its
tensor; an all-gather its output (every rank's input); a reduce-scatter or all-to-all its
output. That is the quantity a hand-written version is judged by (a ring all-reduce sends
about twice its tensor, the same factor for every layout).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

__all__ = ["CommBytes"]

_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")


# The collectives of the functional (``_c10d_functional``) and in-place (``c10d``) op sets.
_COLLECTIVES = frozenset(
    {
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all_single",
        "broadcast",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "_allgather_base_",
        "_reduce_scatter_base_",
        "allgather_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "allreduce_",
        "allreduce_coalesced_",
        "alltoall_",
        "alltoall_base_",
        "broadcast_",
        "gather_",
        "scatter_",
        "reduce_",
        "reduce_scatter_",
        "reduce_scatter_tensor_coalesced_",
    }
)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def received_bytes(name: str, args: tuple[Any, ...]) -> int:
    """Bytes the collective ``name`` (an op name such as ``"all_gather_into_tensor"`` or
    ``"allreduce_"``) with arguments ``args`` delivers to the calling rank."""
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        return _nbytes(args[0]) * int(args[1])  # (input, group_size, group_name)
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        return _nbytes(args[0]) // max(int(args[2]), 1)  # (input, op, group_size, group)
    # functional all_reduce / broadcast give back their input's size; c10d's allgather,
    # reduce_scatter and alltoall take the output tensor(s) first.
    return _nbytes(args[0])


def _mode_base() -> type:
    from dtensor_patches._torch.modes import dispatch_mode_class

    return dispatch_mode_class()


class CommBytes:
    """Count, in a ``with`` block on this rank, the collectives issued and the bytes each one
    delivers to this rank, DTensor's own redistributions and plain ``torch.distributed`` calls
    alike (the same ops ``CommDebugMode`` counts; this needs no NumPy).

    Attributes (during and after the block):
        received: total bytes received, over every collective seen.
        largest: the most bytes a single collective delivered.
        calls: collectives issued, per op name (``"all_reduce"``, ``"all_gather_into_tensor"``,
            ``"allreduce_"``...).
        by_op: bytes per op name.

    Raises:
        PatchError: torch's dispatch-mode class moved.
    """

    def __init__(self) -> None:
        self.received = 0
        self.largest = 0
        self.calls: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()
        self._mode: Any = None

    def note(self, name: str, args: tuple[Any, ...]) -> None:
        """Record one collective ``name`` with arguments ``args``."""
        moved = received_bytes(name, args)
        self.received += moved
        self.largest = max(self.largest, moved)
        self.calls[name] += 1
        self.by_op[name] += moved

    def __enter__(self) -> CommBytes:
        self._mode = _counting_mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def _counting_mode(counter: CommBytes) -> Any:
    from torch.distributed.tensor import DTensor

    class _Counting(_mode_base()):  # type: ignore[misc]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            # Let DTensor run first, so that its redistributions reach this mode as the
            # collectives they issue (as CommDebugMode does).
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            if getattr(func, "namespace", None) in _NAMESPACES:
                name = func.name().split("::", 1)[-1]
                if name in _COLLECTIVES:
                    counter.note(name, tuple(args))
            return func(*args, **(kwargs or {}))

    return _Counting()
