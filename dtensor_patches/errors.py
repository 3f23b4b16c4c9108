"""Exceptions raised by dtensor_patches."""

from __future__ import annotations

__all__ = [
    "FallbackBudgetError",
    "LostWriteError",
    "MixedTensorError",
    "PatchError",
    "RankLocalCallError",
    "RankLocalReadError",
    "first_line",
]


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


class FallbackBudgetError(PatchError):
    """The fallback would gather more than its budget (per call or in total) onto every rank,
    so the call is refused before anything is gathered (``dtensor_patches.dispatch.
    fallback_budget``). The message names the op, the placements, the bytes and what avoids
    it.

    Attributes:
        op: the op and overload (``"aten._log_softmax.default"``).
        bytes_needed: bytes of full inputs the call would gather onto each rank.
    """

    def __init__(self, message: str, *, op: str, bytes_needed: int) -> None:
        super().__init__(message)
        self.op = op
        self.bytes_needed = bytes_needed


class LostWriteError(RuntimeError):
    """An in-place write into a view of a sharded DTensor cannot be carried to its base.

    Raised by the ``inplace_writes`` patch instead of letting the write land in a temporary
    (what stock DTensor does when a view of a sharded dim had to be redistributed first).
    """


class MixedTensorError(RuntimeError):
    """A plain ``torch.Tensor`` (more than one element) was passed beside DTensors, and what it
    means is not certain (torch: ``got mixed torch.Tensor and DTensor``).

    The message names both readings and the one-line way to say which is meant:
    ``torch.distributed.tensor.experimental.implicit_replication()`` when the plain tensor holds
    the same values on every rank, ``dtensor_patches.gathered_locally()`` when it is this rank's
    own data and the DTensor's full value is wanted. A ``RuntimeError``, as torch's is.

    Attributes:
        op: the op's name (``"aten.mm.default"``).
        shape: the plain tensor's shape.
    """

    def __init__(self, message: str, *, op: str, shape: tuple[int, ...]) -> None:
        super().__init__(message)
        self.op = op
        self.shape = shape


class RankLocalCallError(RuntimeError):
    """A DTensor call that must communicate was made on some ranks only, so it cannot pair with
    the other ranks: raised instead of pairing with another collective of theirs (issue 23,
    item 6). The fallback raises it for a call it would run on gathered inputs
    (``dtensor_patches.dispatch.scalar_reads.check_same_call``), on every rank of the call
    when two different calls met, or after ``DTENSOR_PATCHES_RANK_CHECK_TIMEOUT`` seconds on
    the ranks that made a call the others never make. A ``RuntimeError``.

    Attributes:
        site: ``file:line`` of the call in the caller's code.
    """

    def __init__(self, message: str, *, site: str) -> None:
        super().__init__(message)
        self.site = site


class RankLocalReadError(RankLocalCallError):
    """A ``Partial`` DTensor was read as a number (``.item()``, ``float()``, ``int()``) on some
    ranks only, so its value, which needs every rank's share, cannot be formed.

    Raised by the ``partial_item`` patch (``dtensor_patches.dispatch.scalar_reads``) instead of
    pairing the read with another collective of the other ranks: on every rank of the read
    when two different reads met, or after ``DTENSOR_PATCHES_RANK_CHECK_TIMEOUT`` seconds on
    the ranks that made a read the others never make.
    """


def first_line(error: BaseException) -> str:
    """``"ExcType: first line of the message"``: how the library quotes an error in one line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
