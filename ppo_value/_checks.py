"""Input validation shared by the numeric modules."""

from __future__ import annotations

import torch

__all__ = [
    "as_bool_mask",
    "as_float_mask",
    "check_2d",
    "check_finite_at",
    "check_same_shape",
    "masked_sum",
]


def check_2d(name: str, x: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``x`` is a ``[B, S]`` tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be [B, S], got shape {tuple(x.shape)}")


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor is 2-D with the same shape (names in message)."""
    shapes = {}
    for name, t in tensors.items():
        check_2d(name, t)
        shapes[name] = tuple(t.shape)
    if len(set(shapes.values())) > 1:
        desc = ", ".join(f"{k}={v}" for k, v in shapes.items())
        raise ValueError(f"shape mismatch: {desc}")


def as_float_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 0/1 mask of ``dtype``; raises ``ValueError`` on values other than 0 and 1."""
    if mask.dtype == torch.bool:
        return mask.to(dtype)
    m = mask.to(dtype)
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("mask must contain only 0 and 1")
    return m


def as_bool_mask(mask: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """``mask`` as bool; raises ``ValueError`` (naming ``name``) on values other than 0 and 1."""
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{name} must contain only 0 and 1")
    return mask != 0


def check_finite_at(name: str, x: torch.Tensor, valid: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` and the first ``(b, t)`` where ``x`` is NaN or
    infinite at a ``valid`` (bool, same shape) position. Masked positions may hold anything."""
    bad = valid & ~torch.isfinite(x)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        count = int(bad.sum())
        raise ValueError(
            f"{name} is not finite at valid position {pos} ({float(x[pos])}); "
            f"{count} valid position(s) are NaN or infinite"
        )


def masked_sum(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum(x)`` over ``valid`` (bool) positions; NaN or inf at masked positions is ignored
    (``torch.where``, not a product with the mask: ``nan * 0`` is ``nan``)."""
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
