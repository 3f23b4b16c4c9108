"""``layer_norm`` with its affine weight and bias sharded like the normalized features, or with
pending inputs: values and the gradients of input, weight and bias against plain tensors, with
``apply_all()`` (``layer_norm_backward_layouts`` on 2.9-2.11, where the backward raised, hung on
a rank whose shard is empty, or kept the shares of a pending input). Each rank reports whether it raised before any rank reads a result."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool, raised_on_any_rank

# name -> (input shape, normalized dims, placement of x / weight / bias: a dim placed Shard,
# None for Replicate(), "P" for Partial(sum) with shares of different sizes)
_LAYOUTS: dict[str, tuple[tuple[int, ...], int, tuple[int | str | None, ...]]] = {
    "weight_and_bias_sharded": ((2, 3, 4), 2, (None, 0, 0)),
    "weight_sharded_on_last_dim_x_on_batch": ((4, 3, 4), 2, (0, 1, None)),
    "empty_shard_of_a_normalized_dim": ((2, 1, 3), 2, (None, 0, 0)),
    "nothing_sharded_but_x": ((4, 6), 1, (0, None, None)),
    # A layer norm applied to a row-parallel output before its reduction.
    "input_weight_and_bias_pending": ((2, 3, 4), 2, ("P", "P", "P")),
    "input_pending_weight_replicated": ((4, 6), 1, ("P", None, None)),
}


def _placed(full: torch.Tensor, where: int | str | None, mesh: Any) -> Any:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    if where == "P":
        rank, size = dist.get_rank(), dist.get_world_size()
        share = full * (rank + 1) / (size * (size + 1) / 2)
        return DTensor.from_local(share, mesh, [Partial()], run_check=False)
    return distribute_tensor(full, mesh, [Replicate() if where is None else Shard(int(where))])


def _layer_norm(name: str) -> tuple[str | None, bool]:
    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        shape, normalized, dims = _LAYOUTS[name]
        gen = torch.Generator().manual_seed(4)
        full = [
            torch.randn(shape, generator=gen),
            torch.randn(shape[-normalized:], generator=gen),
            torch.randn(shape[-normalized:], generator=gen),
        ]
        mesh = world_mesh()

        def grads(x: Any, w: Any, b: Any) -> list[Any]:
            leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
            out = torch.nn.functional.layer_norm(leaves[0], shape[-normalized:], *leaves[1:])
            return [out.detach(), *torch.autograd.grad((out * out).sum(), leaves)]

        dist_in = [_placed(t, d, mesh) for t, d in zip(full, dims, strict=True)]
        got, raised = raised_on_any_rank(lambda: grads(*dist_in))
        if raised is not None or got is None:
            return raised, False
        want = grads(*full)
        return None, all(
            torch.allclose(g.full_tensor(), w, atol=1e-5) for g, w in zip(got, want, strict=True)
        )
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("name", list(_LAYOUTS))
def test_layer_norm_values_and_gradients(pool2: RankPool, name: str) -> None:
    for error, equal in pool2.run(_layer_norm, name):
        assert error is None, error
        assert equal, name
