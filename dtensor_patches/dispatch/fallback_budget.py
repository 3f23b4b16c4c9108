"""The fallback's memory budget: a call it would run on gathered inputs bigger than the budget
raises :class:`~dtensor_patches.errors.FallbackBudgetError` instead of gathering (issue 20).

The fallback is correct for any op, but it gathers every DTensor input onto every rank: a
``log_softmax`` of vocab-sharded ``[batch, seq, vocab]`` logits at a vocabulary of 150k and 32k
tokens is about 20 GB per rank. Past the budget such a call is refused with the op, the
placements, the bytes and what avoids it, before anything is gathered (nothing changes).

Two budgets, in bytes of full inputs gathered onto each rank (the full size of every input that
is not replicated: the same number on every rank, so every rank decides alike):

- **per call** (default 1 GiB): one fallback call;
- **in total** (default none): every fallback call of this process together.

Set them with :func:`set_fallback_budget` or the environment (``DTENSOR_PATCHES_FALLBACK_CALL_BUDGET``,
``DTENSOR_PATCHES_FALLBACK_TOTAL_BUDGET``: bytes, or ``none``), which overrides the call.
``fallback_report()`` gives each kind of call's peak; :func:`fallback_peak` the largest call.
Patches that gather by nature (``as_strided``, ``conv_layouts``) are not budgeted: they are
chosen, not fallen into.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from dtensor_patches.errors import FallbackBudgetError

__all__ = [
    "CALL_BUDGET_ENV",
    "DEFAULT_CALL_BUDGET",
    "TOTAL_BUDGET_ENV",
    "Budget",
    "check",
    "fallback_budget",
    "fallback_peak",
    "set_fallback_budget",
]

CALL_BUDGET_ENV = "DTENSOR_PATCHES_FALLBACK_CALL_BUDGET"
TOTAL_BUDGET_ENV = "DTENSOR_PATCHES_FALLBACK_TOTAL_BUDGET"
DEFAULT_CALL_BUDGET = 1 << 30
"""1 GiB of full inputs gathered onto each rank by one fallback call."""

# Hints for the calls that reach the fallback with the largest inputs.
_AVOID = {
    "aten._log_softmax": "loss_parallel() for cross_entropy on vocab-sharded logits, or a "
    "redistribute of the logits to Shard(0)/Shard(1) (batch or sequence) first",
    "aten._softmax": "a redistribute to a placement the op has a strategy for (batch or "
    "sequence sharding) first",
    "aten.gather": "loss_parallel() for log-probs of vocab-sharded logits",
    "aten.topk": "a redistribute of the input to shard another dim first",
    "aten.sort": "a redistribute of the input to shard another dim first",
}


@dataclass(frozen=True)
class Budget:
    """The budgets in bytes (``None``: no limit)."""

    per_call: int | None = DEFAULT_CALL_BUDGET
    total: int | None = None


_LOCK = threading.Lock()
_SET = Budget()
_USED = [0, 0]  # bytes gathered so far by budgeted calls, the largest call


def _parse(env: str, raw: str) -> int | None:
    text = raw.strip().lower()
    if text in ("none", "off", "inf", ""):
        return None
    try:
        value = int(float(text))
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{env}={raw!r}: a number of bytes >= 0, or 'none', is expected")
    return value


def fallback_budget() -> Budget:
    """The budgets in effect: the environment's where set, else :func:`set_fallback_budget`'s.

    Raises:
        ValueError: an environment variable that is not a number of bytes or ``none``.
    """
    per_call, total = _SET.per_call, _SET.total
    if CALL_BUDGET_ENV in os.environ:
        per_call = _parse(CALL_BUDGET_ENV, os.environ[CALL_BUDGET_ENV])
    if TOTAL_BUDGET_ENV in os.environ:
        total = _parse(TOTAL_BUDGET_ENV, os.environ[TOTAL_BUDGET_ENV])
    return Budget(per_call, total)


def set_fallback_budget(
    per_call: int | None = DEFAULT_CALL_BUDGET, total: int | None = None
) -> Budget:
    """Set the fallback's budgets in bytes (``None``: no limit); returns the previous ones.

    Raises:
        ValueError: a negative budget.
    """
    global _SET
    for name, value in (("per_call", per_call), ("total", total)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0 bytes or None, got {value}")
    with _LOCK:
        previous, _SET = _SET, Budget(per_call, total)
    return previous


def fallback_peak() -> int:
    """The most bytes one fallback call has gathered onto each rank in this process."""
    return _USED[1]


def full_bytes(value: Any) -> int:
    """The bytes a DTensor's full value takes on each rank once gathered: 0 where every
    placement is ``Replicate()`` (nothing is gathered)."""
    if all(p.is_replicate() for p in value.placements):
        return 0
    return int(value.numel()) * int(value.element_size())


def check(op: Any, leaves: list[Any], placements: str) -> int:
    """Refuse the call if its gathered inputs exceed a budget; else count them. Returns the
    bytes.

    Raises:
        FallbackBudgetError: over the per-call or the total budget (nothing gathered).
    """
    needed = sum(full_bytes(x) for x in leaves)
    budget = fallback_budget()
    with _LOCK:
        over_call = budget.per_call is not None and needed > budget.per_call
        over_total = budget.total is not None and _USED[0] + needed > budget.total
        if not (over_call or over_total):
            _USED[0] += needed
            _USED[1] = max(_USED[1], needed)
            return needed
        used = _USED[0]
    packet = str(op).rsplit(".", 1)[0]
    avoid = _AVOID.get(packet, "a placement the op has a strategy for, or a patch for it")
    which = (
        f"the per-call budget of {budget.per_call} bytes"
        if over_call
        else f"the total budget of {budget.total} bytes ({used} already gathered)"
    )
    raise FallbackBudgetError(
        f"{op} on DTensors {placements}: torch has no way to run it sharded, and the fallback "
        f"would gather {needed} bytes of full inputs onto every rank, over {which}. Avoid it "
        f"with {avoid}; or raise the budget: dtensor_patches.set_fallback_budget(per_call=..., "
        f"total=...) or {CALL_BUDGET_ENV} / {TOTAL_BUDGET_ENV} (bytes, or 'none').",
        op=str(op),
        bytes_needed=needed,
    )


def reset_usage() -> None:
    """Forget the bytes counted toward the total budget and the peak (``reset_report()`` keeps
    them: it forgets the per-kind records only)."""
    with _LOCK:
        _USED[0] = _USED[1] = 0
