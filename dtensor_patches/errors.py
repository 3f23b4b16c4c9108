"""Exceptions raised by dtensor_patches."""

from __future__ import annotations

__all__ = ["PatchError"]


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
