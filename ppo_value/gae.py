"""Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous
Control Using Generalized Advantage Estimation", eq. 16) over token sequences with a mask.

Backwards over ``t`` (design notes §4)::

    delta_t = r_t + gamma * V_next - V_t
    A_t     = delta_t + gamma * lambda * A_next

``V_next`` and ``A_next`` are the value and advantage of the next *valid* position (0 after the
last one): at masked positions both are carried through unchanged, so interior gaps (e.g. tool
output tokens inside a response) are skipped as if absent. ``returns = advantages + values``.
Outputs are 0 at masked positions. Masked positions influence nothing, whatever they hold
(NaN and inf included): they are selected away with ``torch.where``, never multiplied by the
mask (``nan * 0`` is ``nan``). A non-finite value at a valid position is a ``ValueError``.
"""

from __future__ import annotations

import torch

from ppo_value._checks import as_bool_mask, check_finite_at, check_same_shape, masked_sum

__all__ = ["compute_gae", "masked_mean", "masked_var", "masked_whiten"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (same shape; bool or 0/1); masked positions are ignored,
    whatever they hold. Raises ``ValueError`` if the mask is empty."""
    valid = as_bool_mask(mask)
    n = valid.sum()
    if int(n) == 0:
        raise ValueError("mask is empty: the masked mean is undefined")
    return masked_sum(x, valid) / n


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance ``mean_mask((x - mean_mask(x))^2)``. Raises ``ValueError`` if empty."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean).square(), mask)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``x`` over the valid positions: ``(x - mean) / sqrt(var + eps)``.

    Mean and (population) variance are taken over ``mask`` only; masked positions are 0 in the
    output, whatever they held. With ``shift_mean=False`` the mean is added back (scale only).

    Args:
        x: ``[B, S]`` float.
        mask: ``[B, S]`` bool or 0/1.

    Raises:
        ValueError: on shape mismatch, an empty mask, or a non-finite ``x`` at a valid
            position (named).
    """
    check_same_shape(x=x, mask=mask)
    valid = as_bool_mask(mask)
    check_finite_at("x", x, valid)
    mean = masked_mean(x, valid)
    var = masked_var(x, valid)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


@torch.no_grad()
def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_advantages: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns by GAE.

    Args:
        rewards: ``[B, S]`` float token rewards (typically the sequence reward on the last
            response token).
        values: ``[B, S]`` float ``V(s_t)`` (right-shifted, from ``get_values``).
        mask: ``[B, S]`` bool or 0/1 valid (response) positions; may have interior gaps.
        gamma: discount in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``; 0 gives one-step TD errors, 1 Monte-Carlo returns
            minus values.
        whiten_advantages: whiten the advantages over the mask (:func:`masked_whiten`); the
            returns are computed from the raw advantages first.

    Returns:
        ``(advantages, returns)``, each ``[B, S]`` in the promoted float dtype of the inputs
        (at least float32), 0 at masked positions.

    Raises:
        ValueError: on shape mismatch, an empty mask, ``gamma``/``lam`` outside ``[0, 1]``, or
            a NaN/inf reward or value at a valid position (the key and position are named;
            masked positions may hold anything and do not influence the result).
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    valid = as_bool_mask(mask)
    if not bool(valid.any()):
        raise ValueError("mask is empty: GAE has no valid positions")
    check_finite_at("rewards", rewards, valid)
    check_finite_at("values", values, valid)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    r = torch.where(valid, rewards.to(dtype), zero)
    v = torch.where(valid, values.to(dtype), zero)
    batch, seq = r.shape
    next_value = torch.zeros(batch, dtype=dtype, device=r.device)
    next_adv = torch.zeros(batch, dtype=dtype, device=r.device)
    advantages = torch.zeros_like(r)
    for t in range(seq - 1, -1, -1):
        vt = valid[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(vt, adv_t, zero)
        next_value = torch.where(vt, v[:, t], next_value)
        next_adv = torch.where(vt, adv_t, next_adv)
    returns = torch.where(valid, advantages + v, zero)
    if whiten_advantages:
        advantages = masked_whiten(advantages, valid)
    return advantages, returns
