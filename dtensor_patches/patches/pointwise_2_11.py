"""Elementwise ops with no sharding strategy on torch 2.9 to 2.11: ``ne`` of two tensors,
``F.logsigmoid`` (forward), ``F.glu`` (and its backward), ``torch.special.entr``.

Trigger: ``a != b`` with two tensors (also ``torch.nanmean``, which calls it), DPO/reward-model
losses ``-F.logsigmoid(beta * margin)``, entropy bonuses ``torch.special.entr(p).sum(-1)``, GLU
layers: ``NotImplementedError: Operator aten.ne.Tensor does not have a sharding strategy
registered``.

Fix: ``strategies.elementwise_strategy`` (``ne``, ``log_sigmoid_forward``, ``special_entr``):
shards stay sharded, with broadcasting; ``Partial()`` is reduced first. ``log_sigmoid_forward``
also returns a buffer, shaped like the input on CPU (placed like the output) and empty on
accelerators (replicated). ``glu`` splits ``dim`` in halves: shards on the other dims stay, a
shard on ``dim`` is gathered (``glu_backward`` alike, its two tensors placed together). Measured
fixed upstream in torch 2.12 (the backward of ``logsigmoid`` only in 2.13: see
``activation_backward``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.strategies import (
    arg,
    dimwise_strategy,
    elementwise_strategy,
    schema_info,
)


def _elementwise(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema)


def _log_sigmoid_forward(op_schema: Any) -> Any:
    """Two outputs: the result and a buffer (input-shaped on CPU, empty elsewhere)."""
    types = _types()
    base = elementwise_strategy(op_schema)
    specs = []
    for spec in base.strategies:
        out = spec.output_specs
        mesh = out.mesh
        if mesh.device_type == "cpu":
            buffer = types.DTensorSpec(mesh=mesh, placements=out.placements)
        else:
            buffer = types.DTensorSpec(mesh=mesh, placements=_replicate(mesh.ndim))
        specs.append(
            types.OpSpec(
                output_specs=(out, buffer),
                input_specs=spec.input_specs,
                redistribute_cost=spec.redistribute_cost,
            )
        )
    return types.OpStrategy(specs)


def _replicate(n: int) -> tuple[Any, ...]:
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() for _ in range(n))


def _types() -> Any:
    from dtensor_patches import compat

    return compat.dtensor_types()


def _glu(op_schema: Any) -> Any:
    return dimwise_strategy(op_schema, dims=arg(op_schema, 1, "dim", -1))


def _glu_backward(op_schema: Any) -> Any:
    # (grad_output, self, dim): both tensors keep the same shards off ``dim``.
    return dimwise_strategy(op_schema, dims=arg(op_schema, 2, "dim", -1), follow=(1,))


def _registrations() -> list[Strategy]:
    return [
        Strategy("aten.ne.Tensor", _elementwise),
        Strategy("aten.special_entr.default", _elementwise),
        Strategy("aten.log_sigmoid_forward.default", _log_sigmoid_forward),
        Strategy("aten.glu.default", _glu, schema_info(1)),
        Strategy("aten.glu_backward.default", _glu_backward, schema_info(2)),
    ]


CASES = [
    Case("x != y[S]", lambda x, y: x != y, lambda: [randn(5, 6), randn(6, seed=1)], ["S1", "S0"]),
    Case("special.entr(x)", torch.special.entr, lambda: [randn(5, 6).abs()], ["S0"]),
    Case("logsigmoid(x)", F.logsigmoid, lambda: [randn(5, 6)], ["S1"]),
    Case("logsigmoid(P)", F.logsigmoid, lambda: [randn(5, 6)], ["P"]),
    Case("glu(x, 1)", lambda x: F.glu(x, 1), lambda: [randn(5, 6)], ["S0"]),
    Case("glu(x, 1)", lambda x: F.glu(x, 1), lambda: [randn(5, 8)], ["S1"]),
]


def reproduce(mesh: object) -> str | None:
    """``!=``, ``nanmean``, ``entr``, ``logsigmoid`` and ``glu`` on DTensors vs single-device."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="pointwise_2_11",
    summary="strategies for ne.Tensor, logsigmoid, glu (+ backward), special.entr "
    "(torch 2.9 to 2.11)",
    ops=(
        "aten.ne.Tensor",
        "aten.special_entr.default",
        "aten.log_sigmoid_forward.default",
        "aten.glu.default",
        "aten.glu_backward.default",
    ),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_fix="native strategies or decompositions from torch 2.12 (measured)",
)
