"""``Partial()`` plus a python scalar adds the scalar once per rank on torch 2.9 and 2.10.

Trigger: ``y = x.sum()`` with ``x`` sharded is a ``Partial()`` DTensor (each rank holds its
shard's sum). ``y + 10`` (``aten.add.Tensor`` with a scalar ``other``) adds 10 on every rank
and keeps the result ``Partial()``, so the full result is off by ``10 * (world - 1)``: masked
means and normalisers built from partial sums (``total / (count + eps)`` after
``count = mask.sum()``), returns ``r + gamma * v``. ``sub``, ``rsub`` and every other
non-linear pointwise op reduce ``Partial`` inputs first and are correct on every release
(measured over torch's pointwise ops in ``op_db`` with ``Partial(sum/avg/max/min)`` shares
of both signs).

Fix (replacing torch's strategy for ``aten.add.Tensor`` only; in-place ``add_`` is not
touched): ``strategies.elementwise_strategy`` with a rule that keeps a pending reduction only
where ``add`` is linear in it:

- ``Partial(sum)`` with ``Partial(sum)``, or with a replicated tensor (which becomes a
  ``Partial(sum)`` share on one rank, zeros elsewhere, without communication), stays
  ``Partial(sum)``; ``Partial(avg)`` with ``Partial(avg)``, a replicated tensor or a python
  scalar stays ``Partial(avg)``;
- ``Partial(sum)`` plus a python scalar, and every other mix, is reduced first.

Shards stay sharded, with broadcasting, as in torch's pointwise strategy. Measured correct from
torch 2.11, where ``add`` moved to a single-dim strategy with explicit ``Partial`` rules.
"""

from __future__ import annotations

from typing import Any

from packaging.specifiers import SpecifierSet

from dtensor_patches.calls import partial_plus_scalar
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import additive_rule, elementwise_strategy, schema_info


def _add_strategy(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema, partial_rule=additive_rule)


def _registrations() -> list[Strategy]:
    return [Strategy("aten.add.Tensor", _add_strategy, schema_info(static_kwargkey=("out",)))]


# The tripwire's cases: A pending sum plus a python scalar vs single-device.
CASES = [
    Case("x.sum() + 10", lambda x: x.sum() + 10, lambda: [randn(5, 6)], ["S0"]),
    Case("P + 10", lambda x: x + 10, lambda: [randn(5, 6)], ["P"]),
    Case("10 + P", lambda x: 10 + x, lambda: [randn(5, 6)], ["P"]),
    Case("P.add(2, alpha=3)", lambda x: x.add(2, alpha=3), lambda: [randn(5, 6)], ["P"]),
]


PATCH = Patch(
    name="partial_add_scalar",
    summary="Partial() + python scalar adds the scalar once, not once per rank (torch 2.9, 2.10)",
    ops=("aten.add.Tensor",),
    gate=SpecifierSet(">=2.9,<2.11"),
    registrations=_registrations,
    cases=CASES,
    concerns=partial_plus_scalar,
    upstream_fix="correct from torch 2.11 (measured): single-dim strategy with Partial rules",
    overrides_existing=True,
    communication="none, except `Partial(sum)` + scalar",
)
