"""Metric gates of a critic training run.

The same bounds as NeMo-RL's functional test of the DTensor value model: critic loss in
``[0, 6)``, explained variance at most ``1.0001`` (a little above 1 only from rounding; more
means the statistics are wrong) and gradient norm below ``350``, checked at every step, plus
held-out explained variance that rises from the first evaluation to the last. A run that breaks
one of them has a broken critic even if it did not crash.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["GateResult", "check_metric_gates", "format_gates"]


@dataclass(frozen=True)
class GateResult:
    """One gate: its name, the bound, the worst value seen and where, and whether it held."""

    name: str
    bound: str
    worst: float
    step: int | None
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        """Plain ``dict`` (JSON-ready)."""
        return asdict(self)


def _worst(history: Sequence[Mapping[str, float]], key: str, bad: Any) -> tuple[float, int | None]:
    """The value of ``key`` that is worst by ``bad`` (higher = worse), and its step.
    A non-finite value is the worst of all."""
    worst_val, worst_step, worst_score = math.nan, None, -math.inf
    for h in history:
        v = float(h[key])
        score = math.inf if not math.isfinite(v) else bad(v)
        if score > worst_score:
            worst_val, worst_step, worst_score = v, int(h["step"]), score
    return worst_val, worst_step


def check_metric_gates(
    history: Sequence[Mapping[str, float]],
    heldout_ev: Sequence[tuple[int, float]],
    *,
    loss_range: tuple[float, float] = (0.0, 6.0),
    max_explained_var: float = 1.0001,
    max_grad_norm: float = 350.0,
    min_ev_gain: float = 0.0,
) -> list[GateResult]:
    """Check every gate over a run.

    Args:
        history: per-step metrics with ``step``, ``critic/loss``, ``critic/explained_var``
            and ``critic/grad_norm``.
        heldout_ev: ``(step, explained variance)`` of the held-out evaluations, in order.
        loss_range: ``[lo, hi)`` for the critic loss at every step.
        max_explained_var: upper bound for the training explained variance at every step.
        max_grad_norm: strict upper bound for the (unclipped) gradient norm at every step.
        min_ev_gain: the held-out EV must rise by more than this from first to last
            evaluation (``> 0``: strictly rising).

    Returns:
        One :class:`GateResult` per gate, in a fixed order. A non-finite metric fails its gate.

    Raises:
        ValueError: with no steps or fewer than two held-out evaluations.
    """
    if not history:
        raise ValueError("no training steps to check")
    if len(heldout_ev) < 2:
        raise ValueError("need at least two held-out evaluations to see explained variance rise")
    lo, hi = loss_range
    # the largest loss, unless one is below the range (ranked above every in-range value)
    loss, loss_step = _worst(history, "critic/loss", lambda v: v if v >= lo else hi + lo - v)
    ev, ev_step = _worst(history, "critic/explained_var", lambda v: v)
    norm, norm_step = _worst(history, "critic/grad_norm", lambda v: v)
    (first_step, first), (last_step, last) = heldout_ev[0], heldout_ev[-1]
    gain = last - first
    return [
        GateResult(
            "critic/loss",
            f"in [{lo:g}, {hi:g})",
            loss,
            loss_step,
            math.isfinite(loss) and lo <= loss < hi,
        ),
        GateResult(
            "critic/explained_var",
            f"<= {max_explained_var:g}",
            ev,
            ev_step,
            math.isfinite(ev) and ev <= max_explained_var,
        ),
        GateResult(
            "critic/grad_norm",
            f"< {max_grad_norm:g}",
            norm,
            norm_step,
            math.isfinite(norm) and norm < max_grad_norm,
        ),
        GateResult(
            "held-out explained variance gain",
            f"> {min_ev_gain:g} (step {first_step}: {first:.3f} -> step {last_step}: {last:.3f})",
            gain,
            last_step,
            math.isfinite(gain) and gain > min_ev_gain,
        ),
    ]


def format_gates(results: Sequence[GateResult]) -> str:
    """A small fixed-width table, one line per gate, ``PASS``/``FAIL`` first."""
    lines = []
    for r in results:
        where = f" at step {r.step}" if r.step is not None else ""
        lines.append(
            f"{'PASS' if r.passed else 'FAIL'}  {r.name}: worst {r.worst:.4g}{where}, "
            f"required {r.bound}"
        )
    return "\n".join(lines)
