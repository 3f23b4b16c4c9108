"""CPU flash attention has no sharding strategy on torch 2.9 to 2.15.

Trigger: ``F.scaled_dot_product_attention(q, k, v)`` with DTensor ``q``/``k``/``v`` on CPU
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no strategy
(CUDA kernels have one). Hit by TP plans that keep attention projections as DTensors
(``use_local_output=False``) and by CPU test suites of GPU code.

Fix: attention is independent per batch element and per head, so ``Shard(0)`` (batch) and
``Shard(1)`` (heads) of ``[B, H, S, D]`` inputs stay sharded with no communication, with
``k``/``v`` (and, in the backward, every saved tensor) sharded alike; a sequence or feature
shard, a ``Partial`` input or an explicit ``attn_mask`` gathers everything first. Measured
missing on every release from 2.9 to 2.14 with heads or batch sharded (the CUDA kernels have
strategies).
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
    replicate_strategy,
    schema_info,
    uniform_strategy,
)

_BATCH_AND_HEADS = (0, 1)


def _has_mask(op_schema: Any, index: int) -> bool:
    return arg(op_schema, index, "attn_mask", None) is not None


def _forward(op_schema: Any) -> Any:
    if _has_mask(op_schema, 5):
        return replicate_strategy(op_schema, num_outputs=2)
    return uniform_strategy(op_schema, num_outputs=2, follow=(1, 2), shard_dims=_BATCH_AND_HEADS)


def _backward(op_schema: Any) -> Any:
    if _has_mask(op_schema, 8):
        return replicate_strategy(op_schema, num_outputs=3)
    return uniform_strategy(
        op_schema, num_outputs=3, follow=(1, 2, 3, 4, 5), shard_dims=_BATCH_AND_HEADS
    )


def _registrations() -> list[Strategy]:
    return [
        Strategy(
            "aten._scaled_dot_product_flash_attention_for_cpu.default",
            _forward,
            schema_info(3, ("attn_mask", "scale")),
        ),
        Strategy(
            "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
            _backward,
            schema_info(6, ("attn_mask", "scale")),
        ),
    ]


def _attention_and_grads(causal: bool) -> Any:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grads = torch.autograd.grad(out.sum(), [q, k, v])
        return (out.detach(), *grads)

    return run


def _qkv() -> list[torch.Tensor]:
    return [randn(2, 4, 5, 8, seed=s) for s in range(3)]


CASES = [
    Case("sdpa heads-sharded", _attention_and_grads(True), _qkv, ["S1", "S1", "S1"]),
    Case("sdpa batch-sharded", _attention_and_grads(False), _qkv, ["S0", "S0", "S0"]),
    Case("sdpa sequence-sharded", _attention_and_grads(True), _qkv, ["S2", "S2", "S2"]),
]


def reproduce(mesh: object) -> str | None:
    """Attention forward and backward with heads, batch and sequence shards vs single-device."""
    return run_cases(mesh, CASES)


PATCH = Patch(
    name="sdpa_cpu",
    summary="strategies for CPU flash attention forward/backward (torch 2.9 to 2.15)",
    ops=(
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    ),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
)
