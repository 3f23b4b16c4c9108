"""``aten.mse_loss`` (and its backward): no sharding strategy on torch 2.9 and 2.10, silently
wrong results from 2.11 on.

On 2.11+ torch's own strategies average the per-rank means of unevenly sharded inputs (wrong
forward for ``reduction="mean"``) and compute the ``mean`` backward on shards with the local
element count instead of the global one, measured on 2.13.0 and 2.14.1. This
patch therefore replaces torch's strategies on those releases (``overrides_existing``).

Trigger: ``F.mse_loss(v, returns)`` on DTensors: the value loss of a PPO critic, regression
heads.

Fix, by ``reduction``:

- ``none``: elementwise; ``target`` takes ``input``'s shards, no communication;
- ``sum``: each rank sums its shard, the result is ``Partial(sum)``: no communication until
  the caller needs the value;
- ``mean``: ``Partial(avg)`` when every sharded dim divides evenly over its mesh dim (then
  the local means are equally weighted); otherwise gathered first, because averaging the
  per-rank means of uneven shards is wrong.

``Partial`` inputs are reduced first (the loss is not linear). The backward follows the same
rules (``mean`` gathers, as the local kernel divides by the local element count).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._repro import Case, randn, run_cases
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.strategies import arg, evenly_sharded, is_shard, rule_strategy, schema_info

_NONE, _MEAN, _SUM = 0, 1, 2


def _forward(op_schema: Any) -> Any:
    from torch.distributed.tensor import Partial, Replicate

    reduction = arg(op_schema, 2, "reduction", _MEAN)
    src = op_schema.args_schema[0]
    spec = src.strategies[0].output_spec
    even = all(evenly_sharded(spec, p.dim) for p in spec.placements if is_shard(p))

    def rule(p: Any) -> tuple[Any, Any]:
        if not is_shard(p):
            return Replicate(), Replicate()
        if reduction == _NONE:
            return p, p
        if reduction == _SUM:
            return p, Partial("sum")
        return (p, Partial("avg")) if even else (Replicate(), Replicate())

    return rule_strategy(op_schema, rule, follow=(1,))


def _backward(op_schema: Any) -> Any:
    from torch.distributed.tensor import Replicate

    reduction = arg(op_schema, 3, "reduction", _MEAN)

    def rule(p: Any) -> tuple[Any, Any]:
        if is_shard(p) and reduction != _MEAN:
            return p, p
        return Replicate(), Replicate()

    if reduction == _NONE:  # grad_output is shaped like input
        return rule_strategy(op_schema, rule, driver=1, follow=(0, 2))
    return rule_strategy(op_schema, rule, driver=1, follow=(2,))


def _registrations() -> list[Strategy]:
    return [
        Strategy("aten.mse_loss.default", _forward, schema_info(2)),
        Strategy("aten.mse_loss_backward.default", _backward, schema_info(3)),
    ]


def _loss_and_grad(reduction: str) -> Any:
    def run(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_()
        loss = F.mse_loss(x, y, reduction=reduction)
        (grad,) = torch.autograd.grad(loss.sum(), [x])
        return loss.detach(), grad

    return run


CASES = [
    Case(
        "mse_loss(mean) uneven",
        lambda x, y: F.mse_loss(x, y),
        lambda: [randn(5, 6), randn(5, 6, seed=1)],
        ["S0", "S0"],
    ),
    Case(
        "mse_loss(mean)",
        lambda x, y: F.mse_loss(x, y),
        lambda: [randn(4, 6), randn(4, 6, seed=1)],
        ["S0", "S0"],
    ),
    Case(
        "mse_loss(sum) + grad",
        _loss_and_grad("sum"),
        lambda: [randn(5, 6), randn(5, 6, seed=1)],
        ["S1", "S1"],
    ),
    Case(
        "mse_loss(none) + grad",
        _loss_and_grad("none"),
        lambda: [randn(5, 6), randn(5, 6, seed=1)],
        ["S0", "R"],
    ),
    Case(
        "mse_loss(mean) + grad",
        _loss_and_grad("mean"),
        lambda: [randn(5, 6), randn(5, 6, seed=1)],
        ["S1", "S1"],
    ),
]


def reproduce(mesh: object) -> str | None:
    """Each reduction, even and uneven shards, forward and backward, vs single-device."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="mse_loss",
    summary="mse_loss forward/backward: missing on 2.9-2.10, wrong mean on uneven shards and wrong mean gradient from 2.11",
    ops=("aten.mse_loss.default", "aten.mse_loss_backward.default"),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
)
