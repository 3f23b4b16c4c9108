"""Golden values for the V(s_t) right shift and the loss wrapper."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ppo_value.alignment import RightShiftLossWrapper, right_shift_values


def test_right_shift_golden() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    expected = torch.tensor([[0.0, 1.0, 2.0], [0.0, 4.0, 5.0]])
    out = right_shift_values(values)
    assert torch.equal(out, expected)
    assert out.shape == values.shape and out.dtype == values.dtype


def test_right_shift_single_column_and_dtype() -> None:
    out = right_shift_values(torch.tensor([[7.0]], dtype=torch.float64))
    assert torch.equal(out, torch.zeros(1, 1, dtype=torch.float64))


def test_right_shift_is_differentiable() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    right_shift_values(values).sum().backward()
    # the last column is dropped, so it gets no gradient
    assert values.grad is not None
    assert torch.equal(values.grad, torch.tensor([[1.0, 1.0, 0.0]]))


@pytest.mark.parametrize("shape", [(3,), (2, 3, 1)])
def test_right_shift_rejects_non_2d(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        right_shift_values(torch.zeros(shape))


class _RecordingLoss:
    clip_range = 0.25

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, values: torch.Tensor, mask: torch.Tensor, *, scale: float = 1.0) -> str:
        self.calls.append((values.clone(), mask.clone(), scale))
        return "inner-result"

    def describe(self) -> str:
        return "recording"


def test_wrapper_shifts_values_once_and_not_the_mask() -> None:
    inner = _RecordingLoss()
    wrapper = RightShiftLossWrapper(inner)
    values = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([[0, 1, 1]])
    assert wrapper(values, mask, scale=2.0) == "inner-result"
    ((seen_values, seen_mask, scale),) = inner.calls
    assert torch.equal(seen_values, torch.tensor([[0.0, 1.0, 2.0]]))
    assert torch.equal(seen_mask, mask)
    assert scale == 2.0


def test_wrapper_forwards_attributes() -> None:
    inner = _RecordingLoss()
    wrapper = RightShiftLossWrapper(inner)
    assert wrapper.clip_range == 0.25
    assert wrapper.describe() == "recording"
    with pytest.raises(AttributeError):
        _ = wrapper.does_not_exist
