"""Elementwise ops with no sharding strategy on torch 2.9 and 2.10: ``softplus``,
``leaky_relu``, ``elu`` (also ``selu``, ``celu``), ``mish``,
``fmax``, ``fmin`` and ``torch.rsub`` of two tensors, with the backward ops of the activations.

Trigger: ``F.softplus(x)`` (positive heads, variance/temperature parameterisations),
``F.leaky_relu``/``F.elu``/``F.mish`` in value or reward heads, ``torch.fmax(a, b)`` (NaN-aware
clipping), ``torch.rsub(a, b)`` on DTensors: ``NotImplementedError: Operator aten.softplus.default
does not have a sharding strategy registered``.

Fix: ``strategies.elementwise_strategy``: shards stay sharded (with broadcasting for
``fmax``/``fmin``/``rsub``), ``Partial()`` inputs are reduced first (none of these is linear),
except ``rsub`` which keeps a pending sum or average where it is linear (as ``add``). Measured
fixed upstream in torch 2.11 (strategies or decompositions).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.strategies import additive_rule, elementwise_strategy

ELEMENTWISE = (
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


def _elementwise(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema)


def _rsub(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema, partial_rule=additive_rule)


def _registrations() -> list[Strategy]:
    return [Strategy(op, _elementwise) for op in ELEMENTWISE] + [
        Strategy("aten.rsub.Tensor", _rsub)
    ]


CASES = [
    Case("softplus(x, beta=2)", lambda x: F.softplus(x, beta=2.0), lambda: [randn(4, 6)], ["S1"]),
    Case("leaky_relu(x)", F.leaky_relu, lambda: [randn(5, 6)], ["S0"]),
    Case("elu(x)", F.elu, lambda: [randn(5, 6)], ["S0"]),
    Case("celu(x)", F.celu, lambda: [randn(5, 6)], ["S0"]),
    Case("mish(x)", F.mish, lambda: [randn(5, 6)], ["S1"]),
    Case("fmax(x, y[1, S])", torch.fmax, lambda: [randn(5, 6), randn(1, 6, seed=1)], ["S1", "R"]),
    Case("fmin(x, y)", torch.fmin, lambda: [randn(5, 6), randn(5, 6, seed=1)], ["S0", "S0"]),
    Case("rsub(x, y)", torch.rsub, lambda: [randn(5, 6), randn(6, seed=1)], ["S1", "S0"]),
]


def reproduce(mesh: object) -> str | None:
    """The activations, ``fmax``/``fmin`` and ``rsub`` on sharded DTensors vs single-device."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="pointwise_2_10",
    summary="strategies for softplus, leaky_relu, elu, celu, mish (+ backward), "
    "fmax, fmin, rsub (torch 2.9, 2.10)",
    ops=(*ELEMENTWISE, "aten.rsub.Tensor"),
    gate=SpecifierSet(">=2.9,<2.11"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_fix="native strategies or decompositions from torch 2.11 (measured)",
)
