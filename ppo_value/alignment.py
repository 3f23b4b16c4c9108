"""Temporal alignment of token values: ``values[t] = V(s_t)``.

A causal value head's output at position ``t`` has read tokens ``0..t``, so it is the value
of the state *after* token ``t``. PPO pairs values with log-probs defined as
``logprobs[t] = log p(token_t | tokens < t)``, i.e. with the state *before* token ``t``.
Right-shifting by one position (design notes §4; NVIDIA-NeMo/RL PR #2837, where this shift
aligned the DTensor critic with the Megatron-Core PPO baseline) gives ``values[t] = V(s_t)``.

Shift exactly once on the inference path (:meth:`ValueWorker.get_values`) and once on the
training path (:class:`RightShiftLossWrapper`). Masks are never shifted.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["RightShiftLossWrapper", "right_shift_values"]


def right_shift_values(values: torch.Tensor) -> torch.Tensor:
    """Shift token values right by one along the sequence dimension.

    Args:
        values: ``[B, S]`` head outputs, any floating dtype; ``values[:, t]`` is the value
            of the state after token ``t``.

    Returns:
        ``[B, S]`` tensor of the same dtype and device with ``out[:, 0] = 0`` and
        ``out[:, t] = values[:, t - 1]`` for ``t >= 1`` (the last column is dropped), so
        ``out[:, t] = V(s_t)``, the value of the state before token ``t``. Differentiable.

    Raises:
        ValueError: if ``values`` is not 2-D.
    """
    if values.dim() != 2:
        raise ValueError(
            f"right_shift_values expects [B, S] values, got shape {tuple(values.shape)}"
        )
    zeros = torch.zeros_like(values[:, :1])
    return torch.cat([zeros, values[:, :-1]], dim=1)


class _ValueLoss(Protocol):
    def __call__(self, values: torch.Tensor, *args: Any, **kwargs: Any) -> Any: ...


class RightShiftLossWrapper:
    """Wrap a value loss so that it receives right-shifted values.

    ``wrapper(values, *args, **kwargs)`` calls ``inner(right_shift_values(values), *args,
    **kwargs)``: only the first argument (the raw ``[B, S]`` head output) is shifted; masks,
    returns and old values are passed through untouched. Every other attribute is forwarded
    to the inner loss, so the wrapper can stand in for it (e.g. ``wrapper.clip_range``).
    """

    def __init__(self, inner: _ValueLoss) -> None:
        """Args: inner: the loss to wrap; its first positional argument is ``[B, S]`` values."""
        self.inner = inner

    def __call__(self, values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Shift ``values`` ([B, S]) once and call the inner loss; returns what it returns."""
        return self.inner(right_shift_values(values), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails; guard against recursion before __init__ ran.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"RightShiftLossWrapper({self.inner!r})"
