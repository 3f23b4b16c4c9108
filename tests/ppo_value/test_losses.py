"""Clipped value loss: hand-computed golden values, clip fraction, normalisation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_value.losses import ClippedValueLoss, clipped_value_loss

# Per token, clip 0.2 (v_clip = clamp(v, old - 0.2, old + 0.2)):
#  t0: v=1.0 old=1.5 R=0.0 -> v_clip=1.3: (1.0)^2=1.00 vs (1.3)^2=1.69 -> 1.69, clipped
#  t1: v=2.0 old=1.5 R=2.0 -> v_clip=1.7: 0.00 vs (0.3)^2=0.09        -> 0.09, clipped
#  t2: v=1.6 old=1.5 R=1.0 -> v_clip=1.6: 0.36 vs 0.36                -> 0.36, not clipped
#  t3: v=2.0 old=1.5 R=1.0 -> v_clip=1.7: 1.00 vs (0.7)^2=0.49        -> 1.00, not clipped
#  t4: masked (would be clipped: v=0 old=0.5 R=-1 -> 1.00 vs 1.69)
# loss = 0.5 * (1.69 + 0.09 + 0.36 + 1.00) / 4 = 0.3925; clip fraction 2/4
# unclipped loss = 0.5 * (1.00 + 0.00 + 0.36 + 1.00) / 4 = 0.295
V = torch.tensor([[1.0, 2.0, 1.6, 2.0, 0.0]])
OLD = torch.tensor([[1.5, 1.5, 1.5, 1.5, 0.5]])
R = torch.tensor([[0.0, 2.0, 1.0, 1.0, -1.0]])
MASK = torch.tensor([[1, 1, 1, 1, 0]])


def test_clipped_loss_golden() -> None:
    out = clipped_value_loss(V, OLD, R, MASK, clip_range=0.2)
    assert out.loss.item() == pytest.approx(0.3925, abs=1e-6)
    assert out.loss_sum.item() == pytest.approx(0.5 * 3.14, abs=1e-6)
    assert out.clipped_tokens.item() == 2
    assert out.valid_tokens.item() == 4
    assert out.clip_fraction == pytest.approx(0.5)


def test_unclipped_loss_golden() -> None:
    out = clipped_value_loss(V, OLD, R, MASK, clip_range=None)
    assert out.loss.item() == pytest.approx(0.295, abs=1e-6)
    assert out.clipped_tokens.item() == 0


def test_explicit_global_normaliser() -> None:
    out = clipped_value_loss(V, OLD, R, MASK.bool(), clip_range=0.2, num_valid_tokens=10)
    assert out.loss.item() == pytest.approx(0.5 * 3.14 / 10, abs=1e-6)


def test_gradient_golden() -> None:
    # d/dv of 0.5 * per_tok / N: clipped tokens (t0, t1) have v outside the range, so the
    # clipped branch is constant in v -> 0; t2: (v - R) / 4 = 0.15; t3: (2 - 1) / 4 = 0.25.
    v = V.clone().requires_grad_(True)
    clipped_value_loss(v, OLD, R, MASK, clip_range=0.2).loss.backward()
    assert v.grad is not None
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.0, 0.15, 0.25, 0.0]]))


def test_values_inside_range_are_never_counted_as_clipped() -> None:
    # old + (v - old) is not exactly v in float32; the clip must not count rounding noise.
    g = torch.Generator().manual_seed(0)
    v = torch.randn(8, 64, generator=g)
    old = v + (torch.rand(8, 64, generator=g) - 0.5) * 0.1  # |v - old| <= 0.05 < c
    r = torch.randn(8, 64, generator=g)
    out = clipped_value_loss(v, old, r, torch.ones(8, 64), clip_range=0.2)
    assert out.clipped_tokens.item() == 0


def test_wrapper_object_matches_function() -> None:
    loss = ClippedValueLoss(0.2)
    assert loss.clip_range == 0.2
    assert loss(V, OLD, R, MASK).loss.item() == pytest.approx(0.3925, abs=1e-6)
    with pytest.raises(ValueError, match="clip_range"):
        ClippedValueLoss(0.0)


def test_errors() -> None:
    with pytest.raises(ValueError, match="shape mismatch"):
        clipped_value_loss(V, OLD[:, :4], R, MASK, clip_range=0.2)
    with pytest.raises(ValueError, match="empty mask"):
        clipped_value_loss(V, OLD, R, torch.zeros_like(MASK), clip_range=0.2)
    with pytest.raises(ValueError, match="only 0 and 1"):
        clipped_value_loss(V, OLD, R, MASK * 2, clip_range=0.2)
    with pytest.raises(ValueError, match="clip_range"):
        clipped_value_loss(V, OLD, R, MASK, clip_range=-1.0)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 6),
    seq=st.integers(1, 8),
    micro=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    clip=st.sampled_from([None, 0.1, 0.5]),
)
def test_loss_normalisation_independent_of_micro_batch_split(
    batch: int, seq: int, micro: int, seed: int, clip: float | None
) -> None:
    """Sum of micro-batch losses (global N) and its gradient equal the whole-batch loss."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(batch, seq, generator=g, dtype=torch.float64)
    old = v + 0.3 * torch.randn(batch, seq, generator=g, dtype=torch.float64)
    r = torch.randn(batch, seq, generator=g, dtype=torch.float64)
    mask = torch.rand(batch, seq, generator=g) < 0.7
    mask[0, 0] = True
    n = int(mask.sum())
    v_whole = v.clone().requires_grad_(True)
    whole = clipped_value_loss(v_whole, old, r, mask, clip_range=clip)
    whole.loss.backward()
    v_split = v.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for s in range(0, batch, micro):
        part = clipped_value_loss(
            v_split[s : s + micro],
            old[s : s + micro],
            r[s : s + micro],
            mask[s : s + micro],
            clip_range=clip,
            num_valid_tokens=n,
        )
        part.loss.backward()
        total = total + part.loss.detach()
    torch.testing.assert_close(total, whole.loss.detach())
    assert v_whole.grad is not None and v_split.grad is not None
    torch.testing.assert_close(v_split.grad, v_whole.grad)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("clip", [0.2, None])
def test_masked_nan_and_inf_change_neither_loss_nor_gradient(
    garbage: float, clip: float | None
) -> None:
    """Issue 12 item 5: ``(per_tok * mask).sum()`` turned a masked NaN/inf into a NaN loss and
    a NaN gradient. The masked token t4 holds garbage in old values and returns."""
    old, ret = OLD.clone(), R.clone()
    old[0, 4] = garbage
    ret[0, 4] = garbage
    v_clean = V.clone().requires_grad_(True)
    v_dirty = V.clone().requires_grad_(True)
    clean = clipped_value_loss(v_clean, OLD, R, MASK, clip_range=clip)
    dirty = clipped_value_loss(v_dirty, old, ret, MASK, clip_range=clip)
    clean.loss.backward()
    dirty.loss.backward()
    assert dirty.loss.item() == clean.loss.item()
    assert dirty.clipped_tokens.item() == clean.clipped_tokens.item()
    assert torch.equal(v_dirty.grad, v_clean.grad)
    assert v_dirty.grad[0, 4].item() == 0.0


@pytest.mark.parametrize("key", ["old_values", "returns"])
def test_non_finite_target_at_valid_position_is_named(key: str) -> None:
    inputs = {"old_values": OLD.clone(), "returns": R.clone()}
    inputs[key][0, 2] = float("nan")
    with pytest.raises(ValueError, match=rf"{key} is not finite at valid position \(0, 2\)"):
        clipped_value_loss(V, inputs["old_values"], inputs["returns"], MASK, clip_range=0.2)
