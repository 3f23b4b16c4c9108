"""Activation ops whose backward (and, on older releases, forward) has no sharding strategy:
``F.logsigmoid``, ``F.hardtanh``/``F.relu6``, ``F.hardswish``, ``F.hardsigmoid``,
``F.hardshrink``, ``F.softshrink``.

Trigger: ``loss = -F.logsigmoid(beta * (chosen - rejected)).mean(); loss.backward()`` (DPO,
reward models) on DTensors. Measured: on torch 2.9/2.10 the forward raises
``NotImplementedError: Operator aten.log_sigmoid_forward.default does not have a sharding
strategy registered``; from 2.11 the forward runs (``hardshrink`` from 2.12) and the backward
raises the same for ``aten.log_sigmoid_backward.default`` (``hardtanh_backward``,
``hardswish_backward``…) on every release up to 2.15.

Fix: ``strategies.elementwise_strategy`` over ``grad_output`` and ``self``: shards stay
sharded, ``Partial()`` is reduced first. ``log_sigmoid_forward`` also returns a buffer, shaped
like the input on CPU (placed like the output) and empty on accelerators (replicated);
``log_sigmoid_backward`` takes it back alike. Ops that torch already covers on a release (the
forwards from 2.11/2.12) are left to torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import dtensor_types
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import elementwise_strategy, tensor_meta

ELEMENTWISE = (
    "aten.hardtanh.default",
    "aten.hardtanh_backward.default",
    "aten.hardswish.default",
    "aten.hardswish_backward.default",
    "aten.hardsigmoid.default",
    "aten.hardsigmoid_backward.default",
    "aten.hardshrink.default",
    "aten.hardshrink_backward.default",
    "aten.softshrink.default",
    "aten.softshrink_backward.default",
)


def _elementwise(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema)


def _log_sigmoid_forward(op_schema: Any) -> Any:
    """Two outputs: the result and a buffer (input-shaped on CPU, empty elsewhere)."""
    from torch.distributed.tensor import Replicate

    types = dtensor_types()
    specs = []
    for spec in elementwise_strategy(op_schema).strategies:
        out = spec.output_specs
        mesh = out.mesh
        if mesh.device_type == "cpu":
            placements = out.placements
        else:
            placements = tuple(Replicate() for _ in range(mesh.ndim))
        buffer = types.DTensorSpec(mesh=mesh, placements=placements)
        specs.append(
            types.OpSpec(
                output_specs=(out, buffer),
                input_specs=spec.input_specs,
                redistribute_cost=spec.redistribute_cost,
            )
        )
    return types.OpStrategy(specs)


def _log_sigmoid_backward(op_schema: Any) -> Any:
    # (grad_output, self, buffer): an empty buffer takes no part in the broadcast.
    buffer = op_schema.args_schema[2]
    empty = any(int(n) == 0 for n in tensor_meta(buffer).shape)
    return elementwise_strategy(op_schema, replicated=(2,) if empty else ())


def _registrations() -> list[Strategy]:
    return [
        Strategy("aten.log_sigmoid_forward.default", _log_sigmoid_forward),
        Strategy("aten.log_sigmoid_backward.default", _log_sigmoid_backward),
    ] + [Strategy(op, _elementwise) for op in ELEMENTWISE]


def _with_grad(fn: Any) -> Any:
    """``fn(x)`` and the gradient of its sum with respect to ``x``."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_()
        y = fn(x)
        y.sum().backward()
        return y.detach(), x.grad

    return run


# The tripwire's cases: The activations and their gradients on sharded DTensors vs single-device.
CASES = [
    Case("logsigmoid(x) + grad", _with_grad(F.logsigmoid), lambda: [randn(5, 6)], ["S0"]),
    Case(
        "logsigmoid(2 * x) + grad",
        _with_grad(lambda x: F.logsigmoid(2 * x)),
        lambda: [randn(5, 6)],
        ["S1"],
    ),
    Case(
        "relu6(4 * x) + grad", _with_grad(lambda x: F.relu6(4 * x)), lambda: [randn(5, 6)], ["S1"]
    ),
]


PATCH = Patch(
    name="activations",
    summary="strategies for logsigmoid, hardtanh, hardswish, hardsigmoid, hardshrink, "
    "softshrink, forward and backward",
    ops=("aten.log_sigmoid_forward.default", "aten.log_sigmoid_backward.default", *ELEMENTWISE),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="backward ops still without a strategy in torch 2.15 (measured)",
    communication="none",
)
