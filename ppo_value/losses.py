"""Clipped PPO value loss, normalised by a global count of valid tokens.

Formula (design notes §4; Schulman et al. 2017 and the OpenAI baselines / TRL value clip)::

    v_clip   = clamp(v, v_old - c, v_old + c)
    per_tok  = max((v - R)^2, (v_clip - R)^2)
    loss     = 0.5 * sum(per_tok * mask) / N

where ``N`` is the number of valid tokens in the *whole* optimisation batch (all
micro-batches on all data-parallel ranks). With that ``N`` the summed micro-batch losses, and so
the gradients, do not depend on how the batch is split. The clip fraction is the share of valid
tokens where the clipped term is strictly larger (i.e. where clipping changed the loss).

Masked positions influence neither the loss nor its gradient, whatever ``old_values`` and
``returns`` hold there (NaN and inf included): inputs are selected with ``torch.where`` before
any arithmetic, so no ``nan * 0`` reaches the sum or the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_value._checks import as_bool_mask, check_finite_at, check_same_shape, masked_sum

__all__ = ["ClippedValueLoss", "ValueLossOutput", "clipped_value_loss"]


@dataclass
class ValueLossOutput:
    """Result of :func:`clipped_value_loss`.

    Attributes:
        loss: scalar, differentiable: ``0.5 * sum(per_tok * mask) / N``.
        loss_sum: scalar, detached: ``0.5 * sum(per_tok * mask)`` (to reduce across ranks).
        clipped_tokens: scalar, detached: valid tokens where the clipped term was larger.
        valid_tokens: scalar, detached: ``mask.sum()`` of this call (local, not ``N``).
        values: ``[B, S]``, detached: the values the loss saw (for metrics, no second shift).
    """

    loss: torch.Tensor
    loss_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    valid_tokens: torch.Tensor
    values: torch.Tensor

    @property
    def clip_fraction(self) -> float:
        """``clipped_tokens / valid_tokens`` of this call (local), as a Python float."""
        return float(self.clipped_tokens / self.valid_tokens.clamp_min(1))


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_range: float | None,
    num_valid_tokens: float | torch.Tensor | None = None,
) -> ValueLossOutput:
    """Clipped value loss over valid tokens.

    Args:
        values: ``[B, S]`` float, current ``V(s_t)`` (already right-shifted), differentiable.
        old_values: ``[B, S]`` float, ``V(s_t)`` from the rollout (``get_values``).
        returns: ``[B, S]`` float, return targets ``R_t``.
        mask: ``[B, S]`` bool or 0/1, valid tokens (never shifted).
        clip_range: ``c``; ``None`` disables clipping (plain ``0.5 * (v - R)^2``).
        num_valid_tokens: the normaliser ``N`` (global valid-token count across micro-batches
            and dp ranks). ``None`` uses this call's ``mask.sum()``.

    Returns:
        :class:`ValueLossOutput`; the loss is float32 or the values' dtype if wider.

    Raises:
        ValueError: on shape mismatch, a non-0/1 mask, ``clip_range <= 0``, ``N <= 0``
            (e.g. an empty mask with no explicit ``N``), or a NaN/inf in ``old_values`` or
            ``returns`` at a valid position (key and position named). Non-finite ``values``
            (the model's output) are not an error: they give a non-finite loss.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    valid_mask = as_bool_mask(mask)
    check_finite_at("returns", returns, valid_mask)
    check_finite_at("old_values", old_values, valid_mask)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    # Select before computing: where() passes a zero gradient to the unselected branch, but
    # a NaN computed from a masked input would still turn that zero into NaN.
    v = torch.where(valid_mask, values.to(dtype), zero)
    r = torch.where(valid_mask, returns.to(dtype), zero)
    unclipped = (v - r).square()
    if clip_range is not None:
        old = torch.where(valid_mask, old_values.to(dtype), zero)
        # clamp(v, old - c, old + c), not old + clamp(v - old): the latter is not exactly v
        # inside the range and rounding would count unclipped tokens as clipped.
        v_clip = torch.minimum(torch.maximum(v, old - clip_range), old + clip_range)
        clipped = (v_clip - r).square()
        per_tok = torch.maximum(unclipped, clipped)
        clipped_tokens = ((clipped > unclipped) & valid_mask).sum().to(dtype).detach()
    else:
        per_tok = unclipped
        clipped_tokens = torch.zeros((), dtype=dtype, device=v.device)
    valid = valid_mask.sum().to(dtype)
    if num_valid_tokens is None:
        n = valid
    else:
        n = torch.as_tensor(num_valid_tokens, dtype=dtype, device=v.device)
    if float(n) <= 0:
        raise ValueError(
            "the number of valid tokens is 0 (empty mask); the value loss is undefined"
        )
    total = 0.5 * masked_sum(per_tok, valid_mask)
    return ValueLossOutput(
        loss=total / n,
        loss_sum=total.detach(),
        clipped_tokens=clipped_tokens,
        valid_tokens=valid,
        values=values.detach(),
    )


class ClippedValueLoss:
    """:func:`clipped_value_loss` with a fixed ``clip_range`` (an object, so that wrappers such
    as :class:`~ppo_value.alignment.RightShiftLossWrapper` can forward ``clip_range``)."""

    def __init__(self, clip_range: float | None) -> None:
        """Args: clip_range: ``c`` > 0, or ``None`` for no clipping."""
        if clip_range is not None and clip_range <= 0:
            raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
        self.clip_range = clip_range

    def __call__(
        self,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
        *,
        num_valid_tokens: float | torch.Tensor | None = None,
    ) -> ValueLossOutput:
        """See :func:`clipped_value_loss` (all tensors ``[B, S]``)."""
        return clipped_value_loss(
            values,
            old_values,
            returns,
            mask,
            clip_range=self.clip_range,
            num_valid_tokens=num_valid_tokens,
        )

    def __repr__(self) -> str:
        return f"ClippedValueLoss(clip_range={self.clip_range})"
