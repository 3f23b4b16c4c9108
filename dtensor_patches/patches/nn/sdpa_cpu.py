"""CPU flash attention has no sharding strategy on torch 2.9 to 2.15.

Trigger: ``F.scaled_dot_product_attention(q, k, v)`` with DTensor ``q``/``k``/``v`` on CPU
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no strategy
(CUDA kernels have one). Hit by TP plans that keep attention projections as DTensors
(``use_local_output=False``) and by CPU test suites of GPU code.

Fix: attention is independent per batch element and per head, so ``Shard(0)`` (batch) and
``Shard(1)`` (heads) of ``[B, H, S, D]`` inputs stay sharded with no communication, with
``k``/``v`` (and, in the backward, every saved tensor) sharded alike; a sequence or feature
shard or a ``Partial`` input gathers everything first. An ``attn_mask`` that broadcasts over
heads (``[B, 1, S, S]``, HF's padding-aware causal mask) is replicated while q/k/v keep their
head sharding: gathering them instead costs a collective per layer, and the gathered kernel's
contiguous output contradicts the strides DTensor gives it (HF's
``attn_output.transpose(1, 2).reshape(...)`` then fails under TP + SP with a padded mask). Measured
missing on every release from 2.9 to 2.14 with heads or batch sharded (the CUDA kernels have
strategies).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch.dtensors import dtensor_types
from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import Case, randn
from dtensor_patches.strategies import (
    arg,
    replicate_strategy,
    schema_info,
    uniform_strategy,
)

_BATCH_AND_HEADS = (0, 1)


def _mask_broadcast_dims(op_schema: Any, index: int) -> tuple[int, ...] | None:
    """The dims of ``(0, 1)`` (batch, heads) along which ``attn_mask`` broadcasts, ``(0, 1)``
    when there is no mask, ``None`` when the mask cannot follow any shard.

    DTensor never redistributes keyword arguments: the kernel gets the mask's local tensor as
    it is. So q/k/v may stay sharded on a dim only where the mask's local tensor broadcasts
    over it: the mask (aligned to ``[B, H, S, S]`` from the right) has size 1 there, or lacks
    the dim, and it is replicated on every mesh dim.
    """
    from torch.distributed.tensor import Replicate

    mask = arg(op_schema, index, "attn_mask", None)
    if mask is None:
        return _BATCH_AND_HEADS
    types = dtensor_types()
    if isinstance(mask, types.OpStrategy):
        spec = mask.strategies[0].output_spec
        if any(not isinstance(p, Replicate) for p in spec.placements):
            return None
        shape = tuple(spec.tensor_meta.shape)
    elif isinstance(mask, torch.Tensor):
        shape = tuple(mask.shape)
    else:
        return None
    offset = 4 - len(shape)
    return tuple(d for d in _BATCH_AND_HEADS if d - offset < 0 or shape[d - offset] == 1)


def _strategy(op_schema: Any, *, mask_index: int, num_outputs: int, follow: tuple[int, ...]) -> Any:
    dims = _mask_broadcast_dims(op_schema, mask_index)
    if not dims:
        return replicate_strategy(op_schema, num_outputs=num_outputs)
    return uniform_strategy(op_schema, num_outputs=num_outputs, follow=follow, shard_dims=dims)


def _forward(op_schema: Any) -> Any:
    return _strategy(op_schema, mask_index=5, num_outputs=2, follow=(1, 2))


def _backward(op_schema: Any) -> Any:
    return _strategy(op_schema, mask_index=8, num_outputs=3, follow=(1, 2, 3, 4, 5))


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


def _masked_then_merged_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
    # HF attention layout: q/k/v come in as [B, S, H, D] transposed to [B, H, S, D]; a padding
    # mask broadcasts over heads; the output is transposed back and the heads merged.
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[0, :, :, 0] = False
    mask[0, :, 0, 0] = True
    if hasattr(q, "device_mesh"):
        mask = distribute_like(mask, q)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).contiguous().reshape(2, 5, -1)


def distribute_like(t: torch.Tensor, like: Any) -> Any:
    """``t`` replicated on ``like``'s mesh."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(t, like.device_mesh, [Replicate()] * like.device_mesh.ndim)


def _qkv_hf() -> list[torch.Tensor]:
    return [randn(2, 5, 4, 8, seed=s) for s in range(3)]


# The tripwire's cases: Attention forward and backward with heads, batch and sequence shards vs single-device.
CASES = [
    Case("sdpa heads-sharded", _attention_and_grads(True), _qkv, ["S1", "S1", "S1"]),
    Case("sdpa batch-sharded", _attention_and_grads(False), _qkv, ["S0", "S0", "S0"]),
    Case("sdpa sequence-sharded", _attention_and_grads(True), _qkv, ["S2", "S2", "S2"]),
    Case("sdpa heads-sharded, padding mask", _masked_then_merged_heads, _qkv_hf, ["S2"] * 3),
]


PATCH = Patch(
    name="sdpa_cpu",
    summary="strategies for CPU flash attention forward/backward (torch 2.9 to 2.15)",
    ops=(
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    ),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    communication="sequence/feature shards, masks: gathered",
)
