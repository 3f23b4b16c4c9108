"""Input validation shared by the numeric modules."""

from __future__ import annotations

import torch

__all__ = ["as_float_mask", "check_2d", "check_same_shape"]


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
