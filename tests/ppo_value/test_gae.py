"""GAE golden values, masked gaps, lambda = 0 pure TD, whitening, and a naive reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_value.gae import compute_gae, masked_mean, masked_var, masked_whiten

T = torch.tensor


def test_lambda_zero_is_pure_td() -> None:
    # gamma 0.9, lambda 0: A_t = r_t + 0.9 V_{t+1} - V_t
    # t2: 1 + 0 - 0.7 = 0.3; t1: 0.9*0.7 - 0.6 = 0.03; t0: 0.9*0.6 - 0.5 = 0.04
    adv, ret = compute_gae(
        T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), T([[1, 1, 1]]), gamma=0.9, lam=0.0
    )
    torch.testing.assert_close(adv, T([[0.04, 0.03, 0.3]]))
    torch.testing.assert_close(ret, T([[0.54, 0.63, 1.0]]))


def test_lambda_one_gamma_one_gives_monte_carlo_returns() -> None:
    adv, ret = compute_gae(
        T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), T([[1, 1, 1]]), gamma=1.0, lam=1.0
    )
    torch.testing.assert_close(ret, T([[1.0, 1.0, 1.0]]))
    torch.testing.assert_close(adv, T([[0.5, 0.4, 0.3]]))


def test_interior_masked_gap_is_skipped() -> None:
    # gamma 0.9, lambda 0.5 (gamma*lambda = 0.45); position 1 is masked: its reward (5) and
    # value (9) are ignored and V_next / A_next carry over it.
    # t3: 1 - 0.7 = 0.3
    # t2: 0.9*0.7 - 0.6 = 0.03; A = 0.03 + 0.45*0.3 = 0.165
    # t0: 0.9*0.6 - 0.5 = 0.04; A = 0.04 + 0.45*0.165 = 0.11425
    adv, ret = compute_gae(
        T([[0.0, 5.0, 0.0, 1.0]]),
        T([[0.5, 9.0, 0.6, 0.7]]),
        T([[1, 0, 1, 1]]),
        gamma=0.9,
        lam=0.5,
    )
    torch.testing.assert_close(adv, T([[0.11425, 0.0, 0.165, 0.3]]))
    torch.testing.assert_close(ret, T([[0.61425, 0.0, 0.765, 1.0]]))


def test_trailing_padding_and_rows_are_independent() -> None:
    # row 0: last valid token at t1 gets V_next = 0 despite the padded t2 (value 3).
    # row 1: prompt (t0 masked) then response; gamma 1, lambda 1.
    adv, ret = compute_gae(
        T([[0.0, 2.0, 0.0], [0.0, 0.0, 1.0]]),
        T([[1.0, 1.5, 3.0], [4.0, 0.25, 0.5]]),
        T([[1, 1, 0], [0, 1, 1]]),
        gamma=1.0,
        lam=1.0,
    )
    torch.testing.assert_close(adv, T([[1.0, 0.5, 0.0], [0.0, 0.75, 0.5]]))
    torch.testing.assert_close(ret, T([[2.0, 2.0, 0.0], [0.0, 1.0, 1.0]]))


def test_whitening_golden_and_stats() -> None:
    x = T([[1.0, 2.0, 3.0, 100.0]])
    mask = T([[1, 1, 1, 0]])
    # mean 2, population variance 2/3 -> (x - 2) / sqrt(2/3)
    s = (2.0 / 3.0) ** 0.5
    out = masked_whiten(x, mask, eps=0.0)
    torch.testing.assert_close(out, T([[-1.0 / s, 0.0, 1.0 / s, 0.0]]))
    assert masked_mean(out, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(out, mask).item() == pytest.approx(1.0, abs=1e-6)
    kept = masked_whiten(x, mask, shift_mean=False, eps=0.0)
    assert masked_mean(kept, mask).item() == pytest.approx(2.0, abs=1e-6)


def test_whitened_advantages_and_raw_returns() -> None:
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = T([[0.2, 0.4, 0.6], [0.1, 0.3, 0.9]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    raw_adv, raw_ret = compute_gae(rewards, values, mask, gamma=0.99, lam=0.95)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.99, lam=0.95, whiten_advantages=True)
    torch.testing.assert_close(ret, raw_ret)  # returns come from the raw advantages
    assert masked_mean(adv, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(adv, mask).item() == pytest.approx(1.0, abs=1e-5)
    assert adv[1, 2].item() == 0.0
    assert not torch.allclose(adv, raw_adv)


def test_errors() -> None:
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_gae(r, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="empty"):
        compute_gae(r, r, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(r, r, torch.ones(2, 3), gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        compute_gae(r, r, torch.ones(2, 3), lam=-0.1)
    with pytest.raises(ValueError, match="empty"):
        masked_whiten(r, torch.zeros(2, 3))


def _naive_gae(
    rewards: list[float], values: list[float], mask: list[bool], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Textbook GAE on the valid positions only (compressed), scattered back."""
    idx = [i for i, m in enumerate(mask) if m]
    r = [rewards[i] for i in idx]
    v = [values[i] for i in idx] + [0.0]
    adv_c = [0.0] * len(idx)
    running = 0.0
    for k in reversed(range(len(idx))):
        delta = r[k] + gamma * v[k + 1] - v[k]
        running = delta + gamma * lam * running
        adv_c[k] = running
    adv = [0.0] * len(mask)
    ret = [0.0] * len(mask)
    for k, i in enumerate(idx):
        adv[i] = adv_c[k]
        ret[i] = adv_c[k] + v[k]
    return adv, ret


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(1, 4),
    seq=st.integers(1, 10),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_gae_matches_naive_reference(
    data: st.DataObject, batch: int, seq: int, gamma: float, lam: float
) -> None:
    floats = st.floats(-5.0, 5.0, allow_nan=False)
    rewards = data.draw(
        st.lists(st.lists(floats, min_size=seq, max_size=seq), min_size=batch, max_size=batch)
    )
    values = data.draw(
        st.lists(st.lists(floats, min_size=seq, max_size=seq), min_size=batch, max_size=batch)
    )
    mask = data.draw(
        st.lists(
            st.lists(st.booleans(), min_size=seq, max_size=seq), min_size=batch, max_size=batch
        )
    )
    mask[0][0] = True
    adv, ret = compute_gae(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(values, dtype=torch.float64),
        torch.tensor(mask),
        gamma=gamma,
        lam=lam,
    )
    for b in range(batch):
        exp_adv, exp_ret = _naive_gae(rewards[b], values[b], mask[b], gamma, lam)
        torch.testing.assert_close(adv[b], torch.tensor(exp_adv, dtype=torch.float64))
        torch.testing.assert_close(ret[b], torch.tensor(exp_ret, dtype=torch.float64))


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("garbage", [NAN, INF, -INF, 1e30])
def test_masked_positions_influence_nothing(garbage: float) -> None:
    """Issue 12 item 5: NaN/inf at masked positions used to make advantages NaN there and
    whitening NaN everywhere (``nan * 0``)."""
    rewards = T([[0.0, 5.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    values = T([[0.5, 9.0, 0.6, 0.7, 3.0], [0.2, 0.1, 0.4, 2.0, 1.0]])
    mask = T([[1, 0, 1, 1, 0], [0, 1, 1, 0, 0]])
    dirty_r, dirty_v = rewards.clone(), values.clone()
    dirty_r[mask == 0] = garbage
    dirty_v[mask == 0] = garbage
    for whiten in (False, True):
        clean = compute_gae(rewards, values, mask, gamma=0.9, lam=0.5, whiten_advantages=whiten)
        dirty = compute_gae(dirty_r, dirty_v, mask, gamma=0.9, lam=0.5, whiten_advantages=whiten)
        for c, d in zip(clean, dirty, strict=True):
            assert torch.isfinite(d).all()
            torch.testing.assert_close(d, c, rtol=0, atol=0)
    x = T([[1.0, 2.0, 3.0, garbage]])
    m = T([[1, 1, 1, 0]])
    assert masked_mean(x, m).item() == pytest.approx(2.0)
    assert masked_var(x, m).item() == pytest.approx(2.0 / 3.0)
    assert masked_whiten(x, m)[0, 3].item() == 0.0


@pytest.mark.parametrize(("key", "bad"), [("rewards", NAN), ("values", INF)])
def test_non_finite_at_valid_position_is_named(key: str, bad: float) -> None:
    inputs = {"rewards": torch.zeros(2, 3), "values": torch.zeros(2, 3)}
    inputs[key][1, 2] = bad
    with pytest.raises(ValueError, match=rf"{key} is not finite at valid position \(1, 2\)"):
        compute_gae(inputs["rewards"], inputs["values"], torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"x is not finite at valid position \(1, 2\)"):
        masked_whiten(inputs[key], torch.ones(2, 3))
