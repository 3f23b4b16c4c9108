"""Exceptions raised by dtensor_patches."""

from __future__ import annotations

__all__ = ["LostWriteError", "PatchError"]


class PatchError(RuntimeError):
    """A patch could not be applied or reverted, or a torch internal it needs is missing.

    Attributes:
        internal: dotted name of the private torch API that was missing or changed, when the
            failure comes from one (e.g. ``"torch._C._clear_DTensor_sharding_propagator_cache"``).
            ``None`` for other failures.
    """

    def __init__(self, message: str, *, internal: str | None = None) -> None:
        super().__init__(message)
        self.internal = internal


class LostWriteError(RuntimeError):
    """An in-place write into a view of a sharded DTensor cannot be carried to its base.

    Raised by the ``inplace_writes`` patch instead of letting the write land in a temporary
    (what stock DTensor does when a view of a sharded dim had to be redistributed first).
    """
