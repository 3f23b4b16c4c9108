"""How ``verify()`` compares one DTensor result with the same op's result on full tensors:
exact for integer, bool and index results, ``torch.allclose`` for floating ones."""

from __future__ import annotations

from typing import Any

import torch

from dtensor_patches._torch.dtensors import dtensor_class, full_value

__all__ = ["compare"]


def _exact(x: torch.Tensor) -> bool:
    return not (x.is_floating_point() or x.is_complex())


def compare(got: Any, expected: Any, atol: float, rtol: float) -> tuple[str, float | None] | None:
    """``None`` when ``got`` (a DTensor, compared by its full value, or a plain value) equals
    ``expected`` (the single-device result), else ``(problem, largest difference)``.

    Raises:
        PatchError: an internal that gathering a DTensor needs moved.
    """
    dtensor = dtensor_class()
    if isinstance(got, dtensor):
        got = full_value(got)
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        if got.shape != expected.shape:
            return f"shape {list(got.shape)} != single-device {list(expected.shape)}", None
        if got.dtype != expected.dtype:
            return f"dtype {got.dtype} != single-device {expected.dtype}", None
        if got.numel() == 0:
            return None
        if _exact(expected):
            if torch.equal(got, expected):
                return None
            diff = (
                (got.double() - expected.double()).abs().max().item()
                if got.dtype != torch.bool
                else 1.0
            )
            return "values differ (exact dtype)", float(diff)
        if torch.allclose(got, expected, atol=atol, rtol=rtol, equal_nan=True):
            return None
        diff = (got - expected).abs().nan_to_num(float("inf")).max().item()
        return "values differ", float(diff)
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        return f"{type(got).__name__} != single-device {type(expected).__name__}", None
    if isinstance(expected, float) and isinstance(got, float):
        if abs(got - expected) <= atol + rtol * abs(expected) or (
            got != got and expected != expected
        ):
            return None
        return f"{got!r} != single-device {expected!r}", abs(got - expected)
    if type(got) is not type(expected) and not (
        isinstance(got, (int, bool)) and isinstance(expected, (int, bool))
    ):
        return f"{got!r} ({type(got).__name__}) != single-device {expected!r}", None
    if got != expected:
        diff = abs(got - expected) if isinstance(got, (int, float)) else None
        return f"{got!r} != single-device {expected!r}", diff
    return None
