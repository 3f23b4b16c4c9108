"""Helpers for reproducers: run a trigger on DTensors and compare it with plain tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compare", "failure_of"]


def failure_of(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run ``fn``; return ``(result, None)`` or ``(None, "ExcType: message")``.

    A reproducer must classify every way DTensor can fail (missing strategy, failed
    propagation, redistribution errors, assertion failures inside torch), so this catches
    broadly on purpose and returns the error as the reproducer's verdict; it never swallows it.
    """
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - the error message *is* the reproducer's result
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"{type(exc).__name__}: {first_line}"


def compare(
    got: torch.Tensor, expected: torch.Tensor, *, what: str, atol: float = 1e-6
) -> str | None:
    """``None`` when ``got`` equals ``expected`` (shape, dtype and values), else what differs."""
    if got.shape != expected.shape:
        return f"{what}: shape {tuple(got.shape)} != single-device {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"{what}: dtype {got.dtype} != single-device {expected.dtype}"
    if expected.is_floating_point():
        ok = torch.allclose(got, expected, atol=atol, rtol=1e-5, equal_nan=True)
    else:
        ok = torch.equal(got, expected)
    if not ok:
        return f"{what}: values differ from the single-device result"
    return None
