"""Elementwise ops with no sharding strategy on torch 2.9 and 2.10: ``softplus``,
``leaky_relu``, ``elu`` (also ``selu``, ``celu``), ``mish`` (with their backward ops), ``fmax``,
``fmin``, ``torch.rsub`` of two tensors, ``floor_divide`` (``//``), ``masked_fill`` with a
tensor value, and ``masked_fill_`` with a scalar on 2.9.

Trigger: ``F.softplus(x)`` (positive heads, variance/temperature parameterisations),
``F.leaky_relu``/``F.elu``/``F.mish`` in value or reward heads, ``torch.fmax(a, b)`` (NaN-aware
clipping), ``torch.rsub(a, b)``, ``ids // block`` (bucketing token ids),
``x.masked_fill(mask, torch.tensor(v))`` (attention masks) on DTensors:
``NotImplementedError: Operator aten.softplus.default does not have a sharding strategy
registered``.

Fix: ``strategies.elementwise_strategy``: shards stay sharded, with broadcasting (the other
tensors are sharded alike where they have the dim and replicated where they broadcast);
in-place variants keep the caller's placements. ``Partial()`` inputs are reduced first (none of
these is linear), except ``rsub``, which keeps a pending sum or average where it is linear (as
``add``). Measured fixed upstream in torch 2.11 (strategies or decompositions; ``masked_fill_``
with a scalar from 2.10).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import additive_rule, elementwise_strategy

ACTIVATIONS = (
    "aten.softplus.default",
    "aten.softplus_backward.default",
    "aten.leaky_relu.default",
    "aten.leaky_relu_backward.default",
    "aten.elu.default",
    "aten.elu_backward.default",
    "aten.celu.default",
    "aten.mish.default",
    "aten.mish_backward.default",
    "aten.fmax.default",
    "aten.fmin.default",
)
# Ops whose output keeps the first argument's shape and placements (in-place variants too).
FOLLOW_SELF = (
    "aten.floor_divide.default",
    "aten.floor_divide_.Tensor",
    "aten.masked_fill.Tensor",
    "aten.masked_fill_.Tensor",
    "aten.masked_fill_.Scalar",
)


def _elementwise(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema)


def _follow_self(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema, driver=0)


def _rsub(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema, partial_rule=additive_rule)


def _registrations() -> list[Strategy]:
    return [
        *(Strategy(op, _elementwise) for op in ACTIVATIONS),
        Strategy("aten.rsub.Tensor", _rsub),
        *(Strategy(op, _follow_self) for op in FOLLOW_SELF),
    ]


def _fill_(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x.masked_fill_(m, -1.0)


CASES = [
    Case("softplus(x, beta=2)", lambda x: F.softplus(x, beta=2.0), lambda: [randn(4, 6)], ["S1"]),
    Case("leaky_relu(x)", F.leaky_relu, lambda: [randn(5, 6)], ["S0"]),
    Case("elu(x)", F.elu, lambda: [randn(5, 6)], ["S0"]),
    Case("celu(x)", F.celu, lambda: [randn(5, 6)], ["S0"]),
    Case("mish(x)", F.mish, lambda: [randn(5, 6)], ["S1"]),
    Case("fmax(x, y[1, S])", torch.fmax, lambda: [randn(5, 6), randn(1, 6, seed=1)], ["S1", "R"]),
    Case("fmin(x, y)", torch.fmin, lambda: [randn(5, 6), randn(5, 6, seed=1)], ["S0", "S0"]),
    Case("rsub(x, y)", torch.rsub, lambda: [randn(5, 6), randn(6, seed=1)], ["S1", "S0"]),
    Case("ids // 4", lambda x: x // 4, lambda: [torch.arange(30).reshape(5, 6)], ["S0"]),
    Case(
        "floor_divide(x, y)",
        torch.floor_divide,
        lambda: [torch.arange(30).reshape(5, 6), torch.arange(1, 7)],
        ["S1", "S0"],
    ),
    Case(
        "x.masked_fill(mask, tensor)",
        lambda x, m: x.masked_fill(m, torch.tensor(0.5)),
        lambda: [randn(5, 6), randn(5, 6, seed=1) > 0],
        ["S1", "S1"],
    ),
    Case(
        "x.masked_fill(mask[1, S], tensor)",
        lambda x, m: x.masked_fill(m, torch.tensor(0.5)),
        lambda: [randn(5, 6), randn(1, 6, seed=1) > 0],
        ["S0", "R"],
    ),
    Case(
        "x.masked_fill_(mask, v)",
        _fill_,
        lambda: [randn(5, 6), randn(5, 6, seed=1) > 0],
        ["S1", "S1"],
        inplace=True,
    ),
]


PATCH = Patch(
    name="elementwise_strategies",
    summary="strategies for softplus, leaky_relu, elu, celu, mish (+ backward), fmax, fmin, "
    "rsub, floor_divide, masked_fill (torch 2.9, 2.10)",
    ops=(*ACTIVATIONS, "aten.rsub.Tensor", *FOLLOW_SELF),
    gate=SpecifierSet(">=2.9,<2.11"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategies or decompositions from torch 2.11 (measured)",
    communication="none",
)
