"""The demo's metric gates on hand-made runs: each bound, non-finite values, the EV rise."""

from __future__ import annotations

import math

import pytest

from ppo_value.gates import check_metric_gates, format_gates


def _run(**override: float) -> list[dict[str, float]]:
    history = [
        {"step": s, "critic/loss": 0.5, "critic/explained_var": 0.2, "critic/grad_norm": 3.0}
        for s in range(1, 6)
    ]
    for key, value in override.items():
        history[2][f"critic/{key}"] = value
    return history


EVALS = [(0, -0.1), (5, 0.3)]


def test_healthy_run_passes() -> None:
    results = check_metric_gates(_run(), EVALS)
    assert [r.passed for r in results] == [True] * 4
    assert "FAIL" not in format_gates(results)


@pytest.mark.parametrize(
    ("override", "gate"),
    [
        ({"loss": 6.0}, "critic/loss"),
        ({"loss": -1e-3}, "critic/loss"),
        ({"loss": math.nan}, "critic/loss"),
        ({"explained_var": 1.001}, "critic/explained_var"),
        ({"grad_norm": 350.0}, "critic/grad_norm"),
        ({"grad_norm": math.inf}, "critic/grad_norm"),
    ],
)
def test_each_bound_fails_and_names_the_step(override: dict[str, float], gate: str) -> None:
    results = {r.name: r for r in check_metric_gates(_run(**override), EVALS)}
    bad = results[gate]
    assert not bad.passed
    assert bad.step == 3
    assert sum(not r.passed for r in results.values()) == 1
    assert f"FAIL  {gate}: worst" in format_gates(list(results.values()))


def test_explained_variance_must_rise() -> None:
    flat = check_metric_gates(_run(), [(0, 0.2), (5, 0.2)])
    assert not flat[-1].passed and flat[-1].worst == 0.0
    assert check_metric_gates(_run(), EVALS, min_ev_gain=0.5)[-1].passed is False
    with pytest.raises(ValueError, match="two held-out"):
        check_metric_gates(_run(), [(0, 0.1)])
    with pytest.raises(ValueError, match="no training steps"):
        check_metric_gates([], EVALS)
