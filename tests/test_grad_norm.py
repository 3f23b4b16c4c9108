"""``dtensor_patches.grad_norm`` / ``clip_grad_norm_`` (issue 20): the global gradient norm over
gradients on any mix of meshes and placements, beside plain gradients.

Every case builds the same full gradients on every rank (one seeded generator), hands each
rank its part as FSDP2 / HSDP / TP / EP / PP would hold it, and compares with the norm of the
concatenated full gradients on one device (each element once; per-rank plain gradients of every
rank). The collectives are counted by wrapping ``torch.distributed.all_reduce`` on the rank:
one per distinct reduction group, no more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtensor_patches.testing import RankPool

NORMS = [1.0, 2.0, 3.0, math.inf]


@contextmanager
def _counted_all_reduces() -> Iterator[list[int]]:
    calls: list[int] = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _fulls(*shapes: tuple[int, ...], seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


def _expected(tensors: list[torch.Tensor], norm_type: float) -> float:
    """The single device's norm, in float64 (the reference the float32 result must meet to
    a relative 1e-6)."""
    flat = torch.cat([t.flatten().double() for t in tensors])
    return float(torch.linalg.vector_norm(flat, norm_type))


def _one_mesh_case(norm_type: float) -> dict[str, Any]:
    """FSDP2 / TP gradients of one 1-D mesh: uneven ``Shard(0)``, ``Shard(1)``, a TP-replicated
    ``Replicate()`` one, a ``Partial`` one, and a plain replicated one."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    mesh, rank, n = world_mesh(), dist.get_rank(), dist.get_world_size()
    a, b, c, d, e = _fulls((5, 3), (3, 4), (3, 5), (4,), (6,))
    shares = [d * (r + 1) / sum(range(1, n + 1)) for r in range(n)]  # sum to d
    grads = [
        distribute_tensor(a, mesh, [Shard(0)]),
        distribute_tensor(b, mesh, [Replicate()]),
        distribute_tensor(c, mesh, [Shard(1)]),
        DTensor.from_local(shares[rank], mesh, [Partial()], run_check=False),
        e.clone(),
    ]
    with _counted_all_reduces() as calls:
        norm = dtensor_patches.grad_norm(grads, norm_type)
    value = norm.item()
    return {
        "norm": value,
        "expected": _expected([a, b, c, d, e], norm_type),
        "all_reduces": len(calls),
        "is_dtensor": isinstance(norm, DTensor),
    }


@pytest.mark.parametrize("norm_type", NORMS)
def test_one_mesh_every_placement_counted_once(pool2: RankPool, norm_type: float) -> None:
    for rank, r in enumerate(pool2.run(_one_mesh_case, norm_type)):
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6), (rank, r)
        # The Partial gradient reduced (one), then the mesh's group, merged with the plain
        # gradients' (counted locally): one more.
        assert r["all_reduces"] == 2, (rank, r)
        assert not r["is_dtensor"], (rank, r)  # a plain gradient among them: a plain tensor


def _dtensors_only_case() -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    a, b = _fulls((7, 2), (3,))
    grads = [distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Replicate()])]
    with _counted_all_reduces() as calls:
        norm = dtensor_patches.grad_norm(grads)
    return {
        "placements": [p.is_replicate() for p in norm.placements]
        if isinstance(norm, DTensor)
        else None,
        "local": norm.to_local().item() if isinstance(norm, DTensor) else None,
        "expected": _expected([a, b], 2.0),
        "all_reduces": len(calls),
    }


def test_dtensors_of_one_mesh_give_a_replicated_dtensor(pool2: RankPool) -> None:
    """Read with no collective: ``.to_local()`` (and so ``.item()``) is the global norm."""
    for rank, r in enumerate(pool2.run(_dtensors_only_case)):
        assert r["placements"] == [True], (rank, r)
        assert r["local"] == pytest.approx(r["expected"], rel=1e-6), (rank, r)
        assert r["all_reduces"] == 1, (rank, r)


def _plain_per_rank_case(reading: str) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    mesh, rank, n = world_mesh(), dist.get_rank(), dist.get_world_size()
    a, *plains = _fulls((4, 3), *[(5,)] * n)
    grads = [distribute_tensor(a, mesh, [Shard(0)]), plains[rank].clone()]
    with _counted_all_reduces() as calls:
        norm = dtensor_patches.grad_norm(grads, plain=reading)
    return {
        "norm": float(norm),
        "expected": _expected([a, *plains], 2.0),
        "all_reduces": len(calls),
    }


@pytest.mark.parametrize("reading", ["per_rank", "auto"])
def test_per_rank_plain_gradients(pool2: RankPool, reading: str) -> None:
    """FSDP2 ``ignored_params``: each rank's plain gradient is its own. ``per_rank`` shares the
    mesh's all-reduce (the same ranks); ``auto`` tells by an all-gather."""
    for rank, r in enumerate(pool2.run(_plain_per_rank_case, reading)):
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6), (rank, r)
        assert r["all_reduces"] == 1, (rank, r)


def _non_finite_case(value: float, norm_type: float) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    (a,) = _fulls((4, 3))
    a[3, 1] = value  # on the last rank's shard only
    x = distribute_tensor(a, mesh, [Shard(0)])
    out: dict[str, Any] = {"norm": dtensor_patches.grad_norm([x], norm_type).item()}
    try:
        dtensor_patches.grad_norm([x], norm_type, error_if_nonfinite=True)
    except RuntimeError as exc:
        out["error"] = str(exc)
    return out


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nan_and_inf_on_one_rank_are_seen_on_every_rank(
    pool2: RankPool, value: float, norm_type: float
) -> None:
    for rank, r in enumerate(pool2.run(_non_finite_case, value, norm_type)):
        if math.isnan(value):
            assert math.isnan(r["norm"]), (rank, r)
        else:
            assert r["norm"] == math.inf, (rank, r)
        assert "non-finite" in r.get("error", ""), (rank, r)


def _clip_case(max_norm: float, via_torch: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    a, b, c = _fulls((5, 3), (2, 3), (4,))
    params = []
    for full, placement in ((a, Shard(0)), (b, Replicate())):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, [placement]))
        p.grad = distribute_tensor(
            full.clone(), mesh, [placement]
        )  # a replicated one aliases its input
        params.append(p)
    plain = torch.nn.Parameter(torch.zeros(4))
    plain.grad = c.clone()
    params.append(plain)
    with dtensor_patches.patched(), _counted_all_reduces() as calls:
        if via_torch:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = dtensor_patches.clip_grad_norm_(params, max_norm)
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
    full_norm = torch.linalg.vector_norm(torch.cat([a.flatten(), b.flatten(), c]))
    coefficient = torch.clamp(max_norm / (full_norm + 1e-6), max=1.0)
    return {
        "norm": float(norm),
        "expected": float(full_norm),
        "grads_right": all(
            torch.allclose(g, f * coefficient, atol=1e-6)
            for g, f in zip(grads, (a, b, c), strict=True)
        ),
        "all_reduces": len(calls),
    }


@pytest.mark.parametrize("via_torch", [False, True], ids=["ours", "torch_after_apply_all"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_scales_every_shard_by_the_global_coefficient(
    pool2: RankPool, max_norm: float, via_torch: bool
) -> None:
    """``torch.nn.utils.clip_grad_norm_`` after ``apply_all()`` routes to ``grad_norm`` for
    DTensor gradients: the same values and one all-reduce (``plain="auto"``'s all-gather is
    not an all-reduce)."""
    for rank, r in enumerate(pool2.run(_clip_case, max_norm, via_torch)):
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6), (rank, r)
        assert r["grads_right"], (rank, r)
        assert r["all_reduces"] == 1, (rank, r)


def _pipeline_case(norm_type: float) -> dict[str, Any]:
    """Two pipeline stages of one rank each (a ``(pp=2, dp=1)`` mesh): each stage holds its
    own parameters; ``pp_group`` combines them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("pp", "dp"))
    stages = _fulls((4, 2), (3,), (2, 2), (5,))
    mine = stages[2 * rank : 2 * rank + 2]
    grads = [distribute_tensor(mine[0], mesh["dp"], [Shard(0)]), mine[1].clone()]
    with _counted_all_reduces() as calls:
        norm = dtensor_patches.grad_norm(grads, norm_type, pp_group=mesh.get_group("pp"))
        alone = dtensor_patches.grad_norm(grads, norm_type)
    return {
        "norm": float(norm),
        "alone": float(alone),
        "expected": _expected(stages[: 2 * dist.get_world_size()], norm_type),
        "expected_alone": _expected(mine, norm_type),
        "all_reduces": len(calls),
    }


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_pipeline_stages_combined_over_pp_group(pool2: RankPool, norm_type: float) -> None:
    for rank, r in enumerate(pool2.run(_pipeline_case, norm_type)):
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6), (rank, r)
        assert r["alone"] == pytest.approx(r["expected_alone"], rel=1e-6), (rank, r)
        # The dp groups are of one rank (no collective); one over pp.
        assert r["all_reduces"] == 1, (rank, r)


def _two_d_case(norm_type: float) -> dict[str, Any]:
    """A (dp=2, tp=2) mesh: FSDP2 + TP gradients (``Shard`` on dp, ``Shard`` or ``Replicate``
    on tp), an HSDP-like one (``Replicate`` on dp, ``Shard`` on tp), and expert gradients on
    the ``tp`` sub-mesh (ranks {0, 1} and {2, 3}, each holding the same experts)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import dtensor_patches

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    w1, w2, w3, experts, w4 = _fulls((4, 6), (5, 3), (6, 2), (3, 4), (8, 6))
    # FSDP2 over a TP-sharded weight: (_StridedShard(0) on dp, Shard(0) on tp), on a mesh
    # object of FSDP2's own.
    linear = torch.nn.Linear(6, 8, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w4)
    parallelize_module(linear, mesh["tp"], ColwiseParallel())
    fully_shard(linear, mesh=mesh["dp"])
    grads = [
        distribute_tensor(w1, mesh, [Shard(0), Shard(1)]),
        distribute_tensor(w2, mesh, [Shard(0), Replicate()]),
        distribute_tensor(w3, mesh, [Replicate(), Shard(0)]),
        distribute_tensor(experts, mesh["tp"], [Shard(0)]),
        linear.weight.detach().clone(),
    ]
    with _counted_all_reduces() as calls:
        norm = dtensor_patches.grad_norm(grads, norm_type)
    return {
        "norm": float(norm),
        "expected": _expected([w1, w2, w3, experts, w4], norm_type),
        "all_reduces": len(calls),
        "fsdp_tp": [type(p).__name__ for p in grads[-1].placements],
    }


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_two_d_mesh_and_an_expert_sub_mesh(pool4: RankPool, norm_type: float) -> None:
    """Two reduction groups: the whole (dp, tp) mesh, and this rank's tp sub-mesh of the
    experts, whose dp replicas are counted once."""
    for rank, r in enumerate(pool4.run(_two_d_case, norm_type)):
        assert r["fsdp_tp"][1] == "Shard" and r["fsdp_tp"][0] != "Replicate", (rank, r)
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6), (rank, r)
        assert r["all_reduces"] == 2, (rank, r)


def _pending_gradients_case(norm_type: float) -> dict[str, Any]:
    """Sequence-parallel gradients on a (dp, tp) mesh, as TP + SP leaves them before FSDP2
    reduces them: norm weights ``Partial()`` on tp (each rank's sum over its sequence part),
    some ``Shard(0)`` on dp too, one ``Partial("avg")``, one float64, and a ``Partial("max")``
    on dp; beside ``Shard`` gradients. Each must be reduced before its norm is taken."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import dtensor_patches

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    fulls = _fulls((6,), (6,), (4, 6), (5,), (3,), (7,), (3, 4), seed=5)
    norm_a, norm_b, stacked, averaged, wide, maxed, dense = fulls

    def pending(full: torch.Tensor, share: int, placements: list[Any]) -> Any:
        # Rank shares 1/3 and 2/3 of ``full``: they add up to it.
        return DTensor.from_local(full * (share + 1) / 3, mesh, placements, run_check=False)

    fp64 = wide.double()
    rows = torch.chunk(stacked, 2)[dp]
    grads = [
        pending(norm_a, tp, [Replicate(), Partial()]),
        pending(norm_b, tp, [Replicate(), Partial()]),
        DTensor.from_local(rows * (tp + 1) / 3, mesh, [Shard(0), Partial()], run_check=False),
        DTensor.from_local(
            averaged * (1 + tp) * 2 / 3, mesh, [Replicate(), Partial("avg")], run_check=False
        ),
        DTensor.from_local(fp64 * (tp + 1) / 3, mesh, [Replicate(), Partial()], run_check=False),
        DTensor.from_local(maxed - dp, mesh, [Partial("max"), Replicate()], run_check=False),
        distribute_tensor(dense, mesh, [Shard(0), Shard(1)]),
    ]
    before = [g.to_local().clone() for g in grads]
    with _counted_all_reduces() as calls:
        norm = dtensor_patches.grad_norm(grads, norm_type)
    return {
        "norm": float(norm),
        "expected": _expected(fulls, norm_type),
        "all_reduces": len(calls),
        "left_as_they_were": all(
            torch.equal(g.to_local(), b) and g.placements[1].is_partial() == (i < 5)
            for i, (g, b) in enumerate(zip(grads, before, strict=True))
        ),
    }


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_pending_gradients_reduced_together(pool4: RankPool, norm_type: float) -> None:
    """``Partial`` gradients (sum, avg, max; float32 and float64) count as their reduced
    values, the gradients themselves untouched. Those of one mesh, pending dims and dtype go in
    one all-reduce: the tp ``Partial()`` float32 ones (three, one of them ``Shard`` on dp too:
    the same pending dim), the ``avg`` one, the float64 one, the dp ``max`` one: four, then
    one per reduction group (the whole mesh)."""
    for rank, r in enumerate(pool4.run(_pending_gradients_case, norm_type)):
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6), (rank, r)
        assert r["left_as_they_were"], (rank, r)
        assert r["all_reduces"] == 5, (rank, r)


def _dp_ep_beside_dp_tp(norm_type: float) -> dict[str, Any]:
    """Two separate meshes over the same 4 ranks, as MoE training lays them out: dense layers on
    a ``(dp, tp)`` mesh ``[[0, 1], [2, 3]]`` (FSDP2 ``Shard`` on dp, TP ``Shard`` or
    ``Replicate``), experts on a ``(dp, ep)`` mesh ``[[0, 2], [1, 3]]`` (sharded over ep,
    replicated over that mesh's dp), each element counted once."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dtensor_patches

    dense_mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    expert_mesh = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "ep"))
    w1, w2, up, down, router = _fulls((4, 6), (6, 4), (4, 6, 3), (4, 3, 6), (4, 6), seed=11)
    grads = [
        distribute_tensor(w1, dense_mesh, [Shard(0), Shard(1)]),
        distribute_tensor(w2, dense_mesh, [Shard(0), Replicate()]),
        distribute_tensor(up, expert_mesh, [Replicate(), Shard(0)]),
        distribute_tensor(down, expert_mesh, [Shard(1), Shard(0)]),
        distribute_tensor(router, dense_mesh, [Replicate(), Replicate()]),
    ]
    with _counted_all_reduces() as calls:
        norm = dtensor_patches.grad_norm(grads, norm_type)
    return {
        "norm": float(norm),
        "expected": _expected([w1, w2, up, down, router], norm_type),
        "all_reduces": len(calls),
    }


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_dp_ep_mesh_beside_dp_tp_mesh(pool4: RankPool, norm_type: float) -> None:
    """Experts on their own (dp, ep) mesh beside dense layers on a (dp, tp) mesh, 4 ranks: the
    global norm counts every element once. Both meshes span the same 4 ranks, so their sums
    (replicas weighted down) go in one all-reduce over those ranks."""
    for rank, r in enumerate(pool4.run(_dp_ep_beside_dp_tp, norm_type)):
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-6), (rank, r)
        assert r["all_reduces"] == 1, (rank, r)


def test_bad_arguments_are_refused() -> None:
    import dtensor_patches

    with pytest.raises(ValueError, match="norm_type must be > 0 or inf"):
        dtensor_patches.grad_norm([torch.ones(2)], -1.0)
    with pytest.raises(ValueError, match="plain must be"):
        dtensor_patches.grad_norm([torch.ones(2)], plain="sometimes")  # type: ignore[arg-type]


def test_plain_gradients_without_a_process_group() -> None:
    import dtensor_patches

    grads: list[Callable[[], torch.Tensor]] = [lambda: torch.tensor([3.0, 4.0])]
    assert float(dtensor_patches.grad_norm([g() for g in grads])) == pytest.approx(5.0)
    assert float(dtensor_patches.grad_norm([], 2.0)) == 0.0
