"""Elementwise ops with no sharding strategy on torch 2.9 to 2.11: ``ne`` of two tensors,
``F.glu`` (and its backward), ``torch.special.entr``.

Trigger: ``a != b`` with two tensors (also ``torch.nanmean``, which calls it; see
the ``nansum`` patch), entropy bonuses ``torch.special.entr(p).sum(-1)``, GLU
layers: ``NotImplementedError: Operator aten.ne.Tensor does not have a sharding strategy
registered``.

Fix: ``strategies.elementwise_strategy`` (``ne``, ``special_entr``): shards stay sharded, with
broadcasting; ``Partial()`` is reduced first. ``glu`` splits ``dim`` in halves: shards on the
other dims stay, a shard on ``dim`` is gathered (``glu_backward`` alike, its two tensors placed
together). Measured fixed upstream in torch 2.12.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import (
    arg,
    dimwise_strategy,
    elementwise_strategy,
    schema_info,
)


def _elementwise(op_schema: Any) -> Any:
    return elementwise_strategy(op_schema)


def _glu(op_schema: Any) -> Any:
    return dimwise_strategy(op_schema, dims=arg(op_schema, 1, "dim", -1))


def _glu_backward(op_schema: Any) -> Any:
    # (grad_output, self, dim): both tensors keep the same shards off ``dim``.
    return dimwise_strategy(op_schema, dims=arg(op_schema, 2, "dim", -1), follow=(1,))


def _registrations() -> list[Strategy]:
    return [
        Strategy("aten.ne.Tensor", _elementwise),
        Strategy("aten.special_entr.default", _elementwise),
        Strategy("aten.glu.default", _glu, schema_info(1)),
        Strategy("aten.glu_backward.default", _glu_backward, schema_info(2)),
    ]


# The tripwire's cases: ``!=``, ``entr`` and ``glu`` on DTensors vs single-device.
CASES = [
    Case("x != y[S]", lambda x, y: x != y, lambda: [randn(5, 6), randn(6, seed=1)], ["S1", "S0"]),
    Case("special.entr(x)", torch.special.entr, lambda: [randn(5, 6).abs()], ["S0"]),
    Case("glu(x, 1)", lambda x: F.glu(x, 1), lambda: [randn(5, 6)], ["S0"]),
    Case("glu(x, 1)", lambda x: F.glu(x, 1), lambda: [randn(5, 8)], ["S1"]),
]


PATCH = Patch(
    name="ne_glu_entr",
    summary="strategies for ne.Tensor, glu (+ backward), special.entr (torch 2.9 to 2.11)",
    ops=(
        "aten.ne.Tensor",
        "aten.special_entr.default",
        "aten.glu.default",
        "aten.glu_backward.default",
    ),
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategies or decompositions from torch 2.12 (measured)",
    communication="only a shard on `glu`'s `dim`",
)
