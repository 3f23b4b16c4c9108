"""torch's context parallelism has no ring attention for the CPU attention kernel (2.9 to 2.15).

Trigger: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` inside
``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=...)`` on CPU. The block
turns q/k/v into ``Shard(2)`` (sequence) DTensors and routes the flash, efficient and cuDNN
kernels, all CUDA, to ring attention; on CPU SDPA picks
``aten._scaled_dot_product_flash_attention_for_cpu``, which has no ring handler: stock torch
raises ``... does not have a sharding strategy registered`` (measured on 2.13.0, 2 gloo ranks),
and with only :mod:`~dtensor_patches.patches.nn.sdpa_cpu` applied the sequence shards are
gathered in their load-balanced order and the causal mask is applied to that order: wrong
values. So no CPU machine can test context parallelism at all.

Fix: ``context_parallel()``'s own handler table gets the CPU forward and backward kernels, run
through torch's ring loops (``_templated_ring_attention`` and its backward) with the CPU
kernels as the block op. The loops implement torch's head-tail load balancing of the causal
mask, so the sharding (which rank holds which chunk) is exactly the one torch uses on GPU, and
``context_parallel_unshard`` restores the order. Only inside a ``context_parallel()`` block:
DTensor consults the entry only while a block is active, so outside one nothing changes and
costs nothing. What torch's ring cannot do stays a clear error: an ``attn_mask`` (ring
attention computes per key block, a dense mask has no block form here), inputs not
sequence-sharded on one mesh dim. Moves what torch's GPU ring moves: ``k``/``v`` once around
the ring forward, ``k``/``v`` and their gradients backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from packaging.specifiers import SpecifierSet

from dtensor_patches._torch import context_parallel
from dtensor_patches._torch.dtensors import is_dtensor, local_tensor, spec_of
from dtensor_patches._torch.tables import context_parallel_block_guard
from dtensor_patches.dispatch.shards import sharded_result, stride_like
from dtensor_patches.errors import first_line
from dtensor_patches.patch import ContextParallelHandler, Patch
from dtensor_patches.reproducers import compare, randn

_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def _sequence_group(op: str, tensors: tuple[Any, ...]) -> tuple[Any, Any]:
    """``(mesh, process group)`` of the ``Shard(2)`` inputs; ``NotImplementedError`` naming
    what else was given (a ring over one mesh dim is all torch's CP does)."""
    from torch.distributed.tensor import Shard

    specs = [spec_of(t) for t in tensors if is_dtensor(t)]
    if len(specs) != len(tensors):
        raise NotImplementedError(
            f"context_parallel() on CPU: {op} got a plain tensor beside DTensors"
        )
    mesh = specs[0].mesh
    for spec in specs:
        if spec.mesh != mesh or mesh.ndim != 1 or tuple(spec.placements) != (Shard(2),):
            raise NotImplementedError(
                f"context_parallel() on CPU: {op} needs q/k/v sharded Shard(2) on one 1-D mesh, "
                f"got {tuple(spec.placements)} on a {spec.mesh.ndim}-D mesh"
            )
    return mesh, mesh.get_group()


def _no_mask(op: str, kwargs: dict[str, Any]) -> None:
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError(
            f"context_parallel() on CPU: {op} got an attn_mask; torch's ring attention runs "
            "each key block with is_causal only (pass is_causal=True and no mask, as on GPU)"
        )


def _sharded_like(local: torch.Tensor, mesh: Any, shape: tuple[int, ...]) -> Any:
    from torch.distributed.tensor import Shard

    # the CPU kernel lays its output out as [B, S, H, D]: keep that order in the global stride
    return sharded_result(local, mesh, [Shard(2)], shape, stride=stride_like(local, shape))


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def ring_forward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """CP handler of ``_scaled_dot_product_flash_attention_for_cpu``: torch's ring attention
    with the CPU kernel per block.

    Acts on: every call of the op inside a ``context_parallel()`` block. q/k/v ``[B, H, S, D]``
    DTensors ``Shard(2)`` on the CP mesh (local ``S / cp``). Returns ``(out [B, H, S, Dv],
    logsumexp [B, H, S] float32)`` DTensors ``Shard(2)``. Cost: one ring pass (``cp - 1`` k/v
    exchanges). All-or-nothing: it writes nothing; a refused call (mask, other placements)
    raises ``NotImplementedError`` before any exchange.
    """
    query, key, value = args[:3]
    _no_mask(_FORWARD, kwargs)
    mesh, group = _sequence_group(_FORWARD, (query, key, value))
    out, lse, *_ = context_parallel.ring_attention(
        op_call,
        group,
        local_tensor(query),
        local_tensor(key),
        local_tensor(value),
        is_causal=bool(_arg(args, kwargs, 4, "is_causal", False)),
        dropout_p=float(_arg(args, kwargs, 3, "dropout_p", 0.0)),
        scale=kwargs.get("scale"),
    )
    b, h, s = (int(n) for n in query.shape[:3])
    return (
        _sharded_like(out, mesh, (b, h, s, int(value.shape[-1]))),
        _sharded_like(lse, mesh, (b, h, s)),
    )


def ring_backward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """CP handler of ``_scaled_dot_product_flash_attention_for_cpu_backward``: torch's ring
    attention backward with the CPU backward kernel per block.

    Acts on: every call of the op inside a ``context_parallel()`` block (the backward of
    :func:`ring_forward`). Returns ``(grad_q, grad_k, grad_v)`` DTensors ``Shard(2)`` like
    q/k/v. Cost: ``cp - 1`` k/v exchanges and ``cp`` exchanges of their gradients. Writes
    nothing the caller holds; refused calls raise before any exchange.
    """
    grad_out, query, key, value, out, lse = args[:6]
    _no_mask(_BACKWARD, kwargs)
    mesh, group = _sequence_group(_BACKWARD, (grad_out, query, key, value, out, lse))
    grads = context_parallel.ring_attention_backward(
        op_call,
        group,
        local_tensor(grad_out),
        local_tensor(query),
        local_tensor(key),
        local_tensor(value),
        local_tensor(out),
        local_tensor(lse),
        is_causal=bool(_arg(args, kwargs, 7, "is_causal", False)),
        dropout_p=float(_arg(args, kwargs, 6, "dropout_p", 0.0)),
        scale=kwargs.get("scale"),
    )
    return tuple(
        _sharded_like(g, mesh, tuple(int(n) for n in like.shape))
        for g, like in zip(grads[:3], (query, key, value), strict=True)
    )


def _registrations() -> list[ContextParallelHandler]:
    return [
        ContextParallelHandler(_FORWARD, ring_forward),
        ContextParallelHandler(_BACKWARD, ring_backward),
    ]


def _chunks_of_rank(full: torch.Tensor, rank: int, size: int, balanced: bool) -> torch.Tensor:
    """The part of the global ``[B, H, S, D]`` sequence that ``context_parallel()`` gives
    ``rank``: chunk ``rank`` of ``size``, or, load-balanced, chunks ``rank`` and
    ``2 * size - 1 - rank`` of ``2 * size`` (head-tail)."""
    if not balanced:
        return full.chunk(size, dim=2)[rank]
    chunks = full.chunk(2 * size, dim=2)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=2)


def reproduce(mesh: Any) -> str | None:
    """Causal attention with a nonlinear loss inside ``context_parallel()`` on ``mesh`` (its
    first dim): each rank's output chunks and the summed weight gradient against the
    single-device computation. ``None`` when they match, else what failed."""
    from torch.distributed.tensor.experimental import context_parallel as cp_block

    if mesh.ndim != 1:
        return None  # torch's CP rings over a 1-D mesh; the tripwire's 1-D run covers it
    size, rank = mesh.size(), mesh.get_local_rank()
    weights = randn(3, 8, 8, seed=7).requires_grad_()

    def attention(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ weights[i] for i in range(3))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    x = randn(2, 4, 4 * size, 8, seed=3)
    expected = attention(x)
    (expected_grad,) = torch.autograd.grad((expected * expected).sum(), [weights])
    local_x = x.clone()
    try:
        with context_parallel_block_guard(), cp_block(mesh, buffers=[local_x], buffer_seq_dims=[2]):
            got = attention(local_x)
            got = got.to_local() if is_dtensor(got) else got
            (grad,) = torch.autograd.grad((got * got).sum(), [weights])
        balanced = context_parallel.load_balanced()
    except Exception as exc:  # noqa: BLE001 - the error is the verdict
        return first_line(exc)
    dist.all_reduce(grad, group=mesh.get_group())
    mine = _chunks_of_rank(expected.detach(), rank, size, balanced)
    grad_scale = float(expected_grad.abs().max())
    return compare(
        got.detach(), mine, what="ring attention output (this rank's chunks)", atol=1e-4
    ) or compare(grad, expected_grad, what="weight gradient", atol=1e-5 * grad_scale)


PATCH = Patch(
    name="context_parallel_cpu",
    summary="context_parallel() ring attention with the CPU SDPA kernels (torch 2.9 to 2.15)",
    ops=(_FORWARD, _BACKWARD),
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,  # sdpa_cpu's strategy is not a ring: inside the block this wins
    out_variants=False,
    communication="k/v around the ring (cp - 1 exchanges), backward also their gradients: as torch's GPU ring",
)
