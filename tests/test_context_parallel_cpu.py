"""torch's ``context_parallel()`` on CPU after ``apply_all()`` (issue 22): causal attention of a
small attention block, forward and backward, against the single device on 2 and 4 gloo ranks;
what ring attention cannot do stays a clear error; outside a block nothing changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtensor_patches import patched
from dtensor_patches.comm_bytes import CommBytes
from dtensor_patches.testing import RankPool


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _block(heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, 24, generator=g)  # [B, S, hidden]
    wq = (0.3 * torch.randn(24, heads * 6, generator=g)).requires_grad_()
    wkv = (0.3 * torch.randn(24, 2 * kv_heads * 6, generator=g)).requires_grad_()
    return x, wq, wkv


def _attention(x: torch.Tensor, wq: torch.Tensor, wkv: torch.Tensor, heads: int, kv: int) -> Any:
    b, s, _ = x.shape
    q = (x @ wq).view(b, s, heads, 6).transpose(1, 2)
    k, v = (x @ wkv).view(b, s, 2, kv, 6).unbind(2)
    k, v = (t.transpose(1, 2).repeat_interleave(heads // kv, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _ring_vs_single_device(heads: int, kv: int) -> dict[str, float]:
    from torch.distributed.tensor.experimental import context_parallel

    torch.set_num_threads(1)
    mesh = _mesh()
    x, wq, wkv = _block(heads, kv)
    ref = _attention(x, wq, wkv, heads, kv)
    ref_grads = torch.autograd.grad((ref * ref).sum(), [wq, wkv])
    local_x = x.clone()
    with patched(), context_parallel(mesh, buffers=[local_x], buffer_seq_dims=[1]):
        with CommBytes() as forward:
            out = _attention(local_x, wq, wkv, heads, kv)
        grads = torch.autograd.grad((out * out).sum(), [wq, wkv])
    # the layout torch's default (head-tail) load balancer gives this rank
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = ref.detach().chunk(2 * n, dim=2)
    mine = torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim=2)
    summed = [g.clone() for g in grads]
    for g in summed:
        dist.all_reduce(g)
    return {
        "out": float((out.detach() - mine).abs().max()),
        "grad": max(
            float((g - e).abs().max() / e.abs().max())
            for g, e in zip(summed, ref_grads, strict=True)
        ),
        "restored": float(local_x.shape[1] == 16),
        "forward_bytes": forward.received,
        # the ring's lower bound: every other rank's keys and values once (after repeat_kv)
        "kv_bytes": 2 * 2 * heads * 16 * 6 * 4,
    }


def _masked_call_is_refused() -> str:
    from torch.distributed.tensor.experimental import context_parallel

    mesh = _mesh()
    q = torch.randn(1, 2, 8, 4)
    with patched(), context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
        # this rank's query rows of an [8, 8] mask: CP shards it like q (Shard(2))
        mask = torch.ones(1, 1, q.shape[2], 8, dtype=torch.bool)
        try:
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        except NotImplementedError as exc:
            return str(exc)
    return "no error"


def _entry_only_inside_the_block() -> list[bool]:
    from torch.distributed.tensor import DTensor

    from dtensor_patches._torch import context_parallel

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    seen = []
    with patched():
        seen.append(op in context_parallel.handler_table())
        seen.append(op in DTensor._op_dispatcher._custom_op_handlers)
    seen.append(op in context_parallel.handler_table())
    return seen


@pytest.mark.parametrize(("heads", "kv"), [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_ring_attention_matches_single_device_2_ranks(pool2: RankPool, heads: int, kv: int) -> None:
    for r in pool2.run(_ring_vs_single_device, heads, kv):
        assert r["out"] < 1e-5 and r["grad"] < 1e-5 and r["restored"] == 1.0
        # keys and values go round the ring once, nothing else moves (no gather of q or out)
        assert 0 < r["forward_bytes"] <= r["kv_bytes"], r


def test_ring_attention_matches_single_device_4_ranks(pool4: RankPool) -> None:
    for r in pool4.run(_ring_vs_single_device, 4, 2):
        assert r["out"] < 1e-5 and r["grad"] < 1e-5
        assert 0 < r["forward_bytes"] <= r["kv_bytes"], r


def test_attn_mask_is_a_clear_error(pool2: RankPool) -> None:
    for message in pool2.run(_masked_call_is_refused):
        assert "attn_mask" in message and "is_causal" in message


def test_handler_is_installed_in_cp_table_only(pool2: RankPool) -> None:
    # inside patched(): in context_parallel()'s own table, not in DTensor's (no cost outside a
    # block); after the patches are reverted: gone
    assert pool2.run(_entry_only_inside_the_block) == [[True, False, False]] * 2
