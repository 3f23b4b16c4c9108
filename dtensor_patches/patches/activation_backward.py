"""Backward ops of ``F.logsigmoid`` and ``F.hardtanh``/``F.relu6`` have no sharding strategy on
torch 2.9 to 2.12.

Trigger: ``loss = -F.logsigmoid(beta * (chosen - rejected)).mean(); loss.backward()`` (DPO,
reward models) on DTensors: the forward runs (torch 2.11/2.12, or with ``pointwise_2_11``),
the backward raises ``NotImplementedError: Operator aten.log_sigmoid_backward.default does not
have a sharding strategy registered``.

Fix: ``strategies.elementwise_strategy`` over ``grad_output`` and ``self``: shards stay sharded,
``Partial()`` is reduced first. ``log_sigmoid_backward``'s buffer is placed like ``self`` on
CPU (same shape) and replicated where it is empty (accelerators). Measured fixed upstream in
torch 2.13.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.strategies import elementwise_strategy, tensor_meta


def _hardtanh_backward(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema)


def _log_sigmoid_backward(op_schema: Any) -> Any:
    # (grad_output, self, buffer): an empty buffer takes no part in the broadcast.
    buffer = op_schema.args_schema[2]
    empty = any(int(n) == 0 for n in tensor_meta(buffer).shape)
    return elementwise_strategy(op_schema, replicated=(2,) if empty else ())


def _registrations() -> list[Strategy]:
    return [
        Strategy("aten.log_sigmoid_backward.default", _log_sigmoid_backward),
        Strategy("aten.hardtanh_backward.default", _hardtanh_backward),
    ]


def _log_sigmoid_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # Called directly, so that the case needs no strategy for the forward op.
    buffer = torch.sigmoid(-x)
    return torch.ops.aten.log_sigmoid_backward(g, x, buffer)


CASES = [
    Case(
        "log_sigmoid_backward(g, x, buffer)",
        _log_sigmoid_grad,
        lambda: [randn(5, 6, seed=1), randn(5, 6)],
        ["S0", "S0"],
    ),
    Case(
        "hardtanh_backward(g, x, -1, 1)",
        lambda g, x: torch.ops.aten.hardtanh_backward(g, x, -1.0, 1.0),
        lambda: [randn(5, 6, seed=1), randn(5, 6)],
        ["S1", "S1"],
    ),
]


def reproduce(mesh: object) -> str | None:
    """The two backward ops called on sharded DTensors vs single-device."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="activation_backward",
    summary="strategies for log_sigmoid_backward and hardtanh_backward (torch 2.9 to 2.12)",
    ops=("aten.log_sigmoid_backward.default", "aten.hardtanh_backward.default"),
    gate=SpecifierSet(">=2.9,<2.13"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_fix="native strategies or decompositions from torch 2.13 (measured)",
)
