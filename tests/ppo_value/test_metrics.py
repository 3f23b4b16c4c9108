"""Explained variance and value statistics from summed statistics."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_value.metrics import ValueStats, explained_variance


def test_explained_variance_golden() -> None:
    # valid: R = [1, 2, 3, 4], V = [1, 2, 3, 3] -> R - V = [0, 0, 0, 1]
    # Var(R - V) = 0.25 - 0.0625 = 0.1875; Var(R) = 1.25 -> EV = 1 - 0.15 = 0.85
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 50.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 3.0, -50.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert explained_variance(values, returns, mask) == pytest.approx(0.85, abs=1e-12)


def test_explained_variance_edge_cases() -> None:
    r = torch.tensor([[1.0, 2.0, 3.0]])
    assert explained_variance(r, r, torch.ones(1, 3)) == pytest.approx(1.0)
    # predicting 0 leaves R - V = R: EV = 1 - Var(R) / Var(R) = 0 even though V is biased
    assert explained_variance(torch.zeros(1, 3), r, torch.ones(1, 3)) == pytest.approx(0.0)
    # V = R + 1 (constant offset) keeps EV = 1: it measures variance, not bias
    assert explained_variance(r + 1.0, r, torch.ones(1, 3)) == pytest.approx(1.0)
    # constant prediction equal to the mean explains nothing
    assert explained_variance(torch.full((1, 3), 2.0), r, torch.ones(1, 3)) == pytest.approx(0.0)
    assert math.isnan(explained_variance(torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3)))
    with pytest.raises(ValueError, match="empty"):
        explained_variance(r, r, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="shape mismatch"):
        explained_variance(r, r[:, :2], torch.ones(1, 3))


def test_merged_sums_equal_whole_batch_not_average_of_ratios() -> None:
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(6, 5, generator=g)
    values = returns + 0.5 * torch.randn(6, 5, generator=g)
    values[:3] += 1.0  # the two halves have different biases
    mask = torch.rand(6, 5, generator=g) < 0.8
    whole = explained_variance(values, returns, mask)
    a, b = ValueStats(), ValueStats()
    a.update(values=values[:3], returns=returns[:3], mask=mask[:3])
    b.update(values=values[3:], returns=returns[3:], mask=mask[3:])
    merged = ValueStats(
        **{
            k: getattr(a, k) + getattr(b, k)
            for k in ("count", "sum_v", "sum_r", "sum_r2", "sum_res", "sum_res2")
        }
    )
    assert merged.explained_variance() == pytest.approx(whole, abs=1e-12)
    avg_of_ratios = 0.5 * (a.explained_variance() + b.explained_variance())
    assert abs(avg_of_ratios - whole) > 1e-3


def test_as_metrics_golden() -> None:
    s = ValueStats()
    s.update(
        values=torch.tensor([[0.5, -1.0, 9.0]]),
        returns=torch.tensor([[1.0, 0.0, 9.0]]),
        mask=torch.tensor([[1, 1, 0]]),
    )
    s.add_loss(loss_sum=0.75, clipped_tokens=1)
    m = s.as_metrics()
    assert m["critic/loss"] == pytest.approx(0.375)
    assert m["critic/clip_fraction"] == pytest.approx(0.5)
    assert m["critic/values_mean"] == pytest.approx(-0.25)
    assert m["critic/values_min"] == pytest.approx(-1.0)
    assert m["critic/values_max"] == pytest.approx(0.5)
    assert m["critic/returns_mean"] == pytest.approx(0.5)
    assert m["critic/num_tokens"] == 2
    # R - V = [0.5, 1.0]: var 0.0625; Var(R) = 0.25 -> EV 0.75
    assert m["critic/explained_var"] == pytest.approx(0.75)


def test_masked_nan_and_inf_do_not_reach_the_statistics() -> None:
    """Issue 12 item 5: masked garbage used to make every sum (and the metrics) NaN."""
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, float("nan")]])
    values = torch.tensor([[1.0, 2.0, 3.0, 3.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    stats = ValueStats()
    stats.update(values=values, returns=returns, mask=mask)
    metrics = stats.as_metrics()
    assert metrics["critic/explained_var"] == pytest.approx(0.85, abs=1e-12)
    assert metrics["critic/values_mean"] == pytest.approx(2.25)
    assert metrics["critic/values_max"] == 3.0
    assert metrics["critic/returns_mean"] == pytest.approx(2.5)
