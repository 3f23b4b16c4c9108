"""``out=`` variants of patched ops (``Patch.out_variants``) on a 2-rank gloo mesh.

Each call writes into a DTensor ``out`` and is compared with the same call on plain tensors.
Only ops whose patch applies on the running torch are checked (elsewhere torch's own strategy
for the ``out=`` overload runs, or none exists and the functional patch is gated out too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtensor_patches._torch.schemas import out_variant
from dtensor_patches.testing import RankPool

# name -> (patch, functional op whose out= overload is derived, call(x, out), call(x))
_CASES: dict[str, tuple[str, str, Callable[..., Any], Callable[..., Any]]] = {
    "cumprod": (
        "scans",
        "aten.cumprod.default",
        lambda x, o: torch.cumprod(x, 1, out=o[0]),
        lambda x: torch.cumprod(x, 1),
    ),
    "logsumexp": (
        "dim_reductions",
        "aten.logsumexp.default",
        lambda x, o: torch.logsumexp(x, 1, out=o[0]),
        lambda x: torch.logsumexp(x, 1),
    ),
    "std": (
        "dim_reductions",
        "aten.std.correction",
        lambda x, o: torch.std(x, 0, out=o[0]),
        lambda x: torch.std(x, 0),
    ),
    "flip": (
        "flip_roll",
        "aten.flip.default",
        lambda x, o: torch.ops.aten.flip.out(x, [0], out=o[0]),
        lambda x: torch.flip(x, [0]),
    ),
    "mean_uneven": (
        "mean_uneven",
        "aten.mean.dim",
        lambda x, o: torch.mean(x, 0, out=o[0]),
        lambda x: torch.mean(x, 0),
    ),
    "softplus": (
        "elementwise_strategies",
        "aten.softplus.default",
        lambda x, o: torch._C._nn.softplus(x, out=o[0]),
        lambda x: torch.nn.functional.softplus(x),
    ),
}


def _run_case(name: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches import get

    patch, _, call_out, call = _CASES[name]
    if not get(patch).applies_to():
        return {"skipped": True}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))  # uneven Shard(0)
    expected = call(full)
    expected = list(expected) if isinstance(expected, tuple) else [expected]
    with dtensor_patches.patched(only=[patch]):
        x = distribute_tensor(full, mesh, [Shard(0)])
        outs = [distribute_tensor(torch.zeros_like(e), mesh, [Shard(0)]) for e in expected]
        call_out(x, outs)
        got = [o.full_tensor() for o in outs]
    return {
        "skipped": False,
        "equal": [
            torch.allclose(g, e, atol=1e-5) if e.is_floating_point() else torch.equal(g, e)
            for g, e in zip(got, expected, strict=True)
        ],
    }


@pytest.mark.parametrize("name", sorted(_CASES))
def test_out_variant_matches_single_device(pool2: RankPool, name: str) -> None:
    results = pool2.run(_run_case, name)
    if results[0]["skipped"]:
        pytest.skip(f"patch {_CASES[name][0]} is gated out on this torch")
    for rank, r in enumerate(results):
        assert all(r["equal"]), f"rank {rank}: {name} out= differs from single device"


def test_out_overloads_are_found() -> None:
    # The derivation must find the out= overload of every op in the table.
    for name, (_, functional, _, _) in _CASES.items():
        assert out_variant(functional) is not None, name
    assert out_variant("aten.add_.Tensor") is None  # in-place ops have none
    # Several out tensors: DTensor leaves their placements stale (measured), so none.
    assert out_variant("aten.kthvalue.default") is None
