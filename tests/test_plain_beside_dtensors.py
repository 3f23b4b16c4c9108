"""Plain tensors beside DTensors, as training code writes them (issue 18): a causal mask and
rotary tables beside head-sharded attention, an EMA and a hand-written optimizer state kept as
plain full tensors, a weight sync into plain copies, data-parallel inputs beside an FSDP2
weight. Each program runs on plain tensors and on DTensors with ``apply_all()``, on 2 ranks, 4
ranks and a 2x2 mesh, on every release 2.9 to 2.15 (from 2.10 through the C++ dispatch's
implicit-replication flag); every DTensor result is checked for agreement between the ranks
(``spec_disagreement``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool

B, H, S, D = 2, 4, 5, 6


def _attention(q: Any, k: Any, v: Any, cos: torch.Tensor, sin: torch.Tensor) -> Any:
    """Rotary embedding and causal attention, written as model code writes them: ``cos``,
    ``sin`` and the mask are plain tensors built on every rank."""

    def rotate(x: Any) -> Any:
        return torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1)

    q = q * cos + rotate(q) * sin
    k = k * cos + rotate(k) * sin
    mask = torch.full((S, S), float("-inf")).triu(1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D) + mask
    return scores.softmax(-1) @ v


def _rotary() -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.arange(S, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, D)[None]
    return angle.cos(), angle.sin()


def _qkv() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(3)]


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _head_placements(mesh: Any) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(1)] if mesh.ndim == 1 else [Replicate(), Shard(1)]


def _attention_case(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    from dtensor_patches import patched
    from dtensor_patches.testing import spec_disagreement

    mesh = _mesh(mesh_shape)
    cos, sin = _rotary()
    with patched():
        qkv = [distribute_tensor(t, mesh, _head_placements(mesh)).requires_grad_() for t in _qkv()]
        out = _attention(*qkv, cos, sin)
        out.square().sum().backward()
        return {
            "spec": spec_disagreement(out),
            "out": out.full_tensor().detach(),
            "grads": [t.grad.full_tensor() for t in qkv],
        }


@pytest.mark.parametrize("mesh_shape", [(2,)], ids=["1d-2"])
def test_mask_and_rotary_beside_head_sharded_attention(
    pool2: RankPool, mesh_shape: tuple[int, ...]
) -> None:
    _check_attention(pool2.run(_attention_case, mesh_shape))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d-4", "2x2"])
def test_mask_and_rotary_on_four_ranks(pool4: RankPool, mesh_shape: tuple[int, ...]) -> None:
    _check_attention(pool4.run(_attention_case, mesh_shape))


def _check_attention(rows: list[dict[str, Any]]) -> None:
    qkv = [t.clone().requires_grad_() for t in _qkv()]
    expected = _attention(*qkv, *_rotary())
    expected.square().sum().backward()
    for row in rows:
        assert row["spec"] is None, row["spec"]
        torch.testing.assert_close(row["out"], expected.detach())
        for got, want in zip(row["grads"], qkv, strict=True):
            torch.testing.assert_close(got, want.grad)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"weight": torch.randn(6, 4, generator=g), "bias": torch.randn(6, generator=g)}


def _training_program(params: dict[str, Any], x: torch.Tensor, steps: int = 2) -> dict[str, Any]:
    """An SGD-with-RMS step written by hand with plain state tensors of each parameter's
    shape, an EMA kept as plain full tensors, a weight sync into plain copies, a checkpoint
    copied back in. ``params``: plain or DTensor parameters alike."""

    def full(t: Any) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    with torch.no_grad():
        ema = {n: full(p).clone() for n, p in params.items()}
        state = {n: torch.zeros(p.shape) for n, p in params.items()}  # plain, global shape
    for _ in range(steps):
        loss = (torch.nn.functional.linear(x, params["weight"], params["bias"]) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for n, p in params.items():
                g = p.grad
                state[n].mul_(0.9).addcmul_(g, g, value=0.1)  # plain state, DTensor grad
                p.addcdiv_(g, state[n].sqrt().add_(1e-8), value=-0.05)  # DTensor p, plain denom
                ema[n].mul_(0.8).add_(p, alpha=0.2)  # plain EMA of a DTensor
                ema[n].lerp_(p, 0.5)
                p.grad = None
    with torch.no_grad():
        rollout = {n: torch.empty(p.shape) for n, p in params.items()}
        for n, p in params.items():
            rollout[n].copy_(p)  # weight sync to a rollout engine's plain copy
        restored = {n: full(p).clone() for n, p in params.items()}
        for n, p in params.items():
            p.copy_(ema[n])  # a plain checkpoint value copied into the parameter
            p.data.add_(state[n] * 0)  # a plain tensor beside a parameter's .data
    return {
        "ema": ema,
        "state": state,
        "rollout": rollout,
        "restored": restored,
        "params": {n: full(p).detach().clone() for n, p in params.items()},
    }


def _data() -> torch.Tensor:
    return torch.linspace(-1, 1, 12).reshape(3, 4)


def _training_case(mesh_shape: tuple[int, ...], kind: str) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_patches import patched
    from dtensor_patches.testing import spec_disagreement

    mesh = _mesh(mesh_shape)
    with patched():
        if kind == "fsdp2":  # FSDP2's parameters, used outside the module (data the same)
            from torch.distributed.fsdp import fully_shard

            layer = torch.nn.Linear(4, 6)
            with torch.no_grad():
                for n, p in layer.named_parameters():
                    p.copy_(_weights()[n])
            fully_shard(layer, mesh=mesh)
            params = dict(layer.named_parameters())
        else:  # TP: rows of the weight and the bias sharded, replicated over dp on a 2-D mesh
            outer = [Replicate()] * (mesh.ndim - 1)
            params = {
                n: torch.nn.Parameter(distribute_tensor(w, mesh, [*outer, Shard(0)]))
                for n, w in _weights().items()
            }
        got = _training_program(params, _data())
        got["spec"] = [spec_disagreement(p) for p in params.values()]
        return got


@pytest.mark.parametrize("kind", ["fsdp2", "tp"])
def test_plain_optimizer_state_ema_and_weight_sync(pool2: RankPool, kind: str) -> None:
    _check_training(pool2.run(_training_case, (2,), kind))


@pytest.mark.parametrize(
    ("mesh_shape", "kind"), [((4,), "fsdp2"), ((2, 2), "tp")], ids=["1d-4-fsdp2", "2x2-tp"]
)
def test_plain_state_on_four_ranks(pool4: RankPool, mesh_shape: tuple[int, ...], kind: str) -> None:
    _check_training(pool4.run(_training_case, mesh_shape, kind))


def _check_training(rows: list[dict[str, Any]]) -> None:
    params = {n: torch.nn.Parameter(w) for n, w in _weights().items()}
    expected = _training_program(params, _data())
    for row in rows:
        assert row["spec"] == [None, None], row["spec"]
        for key in ("ema", "state", "rollout", "restored", "params"):
            for n in params:
                torch.testing.assert_close(row[key][n], expected[key][n], msg=f"{key} {n}")


def _per_rank_data_case() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import dtensor_patches
    from dtensor_patches.errors import MixedTensorError

    mesh = _mesh((dist.get_world_size(),))
    layer = torch.nn.Linear(4, 6)
    with dtensor_patches.patched():
        fully_shard(layer, mesh=mesh)
        x = _data() + dist.get_rank()  # each rank's own batch
        before = {n: p.full_tensor().clone() for n, p in layer.named_parameters()}
        try:
            torch.nn.functional.linear(x, layer.weight, layer.bias)
            error: Exception | None = None
        except MixedTensorError as exc:
            error = exc
        with torch.no_grad():
            try:
                layer.weight.add_(x.sum() * torch.ones(6, 4) * (dist.get_rank() + 1))
                write_error: Exception | None = None
            except MixedTensorError as exc:
                write_error = exc
        unchanged = all(
            torch.equal(p.full_tensor(), before[n]) for n, p in layer.named_parameters()
        )
        with dtensor_patches.gathered_locally():
            local = torch.nn.functional.linear(x, layer.weight, layer.bias)
        full_w = layer.weight.full_tensor().detach()
        full_b = layer.bias.full_tensor().detach()
    return {
        "error": str(error),
        "write_error": str(write_error),
        "unchanged": unchanged,
        "local": (local.detach() - torch.nn.functional.linear(x, full_w, full_b)).abs().max(),
    }


def test_per_rank_data_beside_fsdp2_weight_is_refused_with_both_readings(
    pool2: RankPool,
) -> None:
    for row in pool2.run(_per_rank_data_case):
        for key in ("error", "write_error"):
            text = row[key]
            assert "differ between the ranks" in text, text
            assert "implicit_replication()" in text and "gathered_locally()" in text, text
        assert "aten." in row["error"] and "[3, 4]" in row["error"], row["error"]
        assert row["unchanged"], row
        assert row["local"] < 1e-6, row
