"""Indexed writes and advanced indexing (``index_writes``, ``index_functional``, ``getitem``,
``cumsum_inplace``) on a real 2-rank CPU gloo mesh, against single-device results: in-place
ops return the caller's object and keep its placements, no write is lost on any rank,
``getitem`` keeps shards on unindexed dims, gradients match."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtensor_patches.testing import RankPool

# name -> (fn(x, index, src) mutating x, x shape, index, src shape or None).
_G = torch.Generator().manual_seed(7)
_INPLACE: dict[str, tuple[Callable[..., Any], tuple[int, ...], torch.Tensor, Any]] = {
    "index_add_(0)": (
        lambda x, i, s: x.index_add_(0, i, s, alpha=3),
        (5, 4),
        torch.tensor([4, 0, 4, 2, 1]),
        (5, 4),
    ),
    "index_add_(1)": (lambda x, i, s: x.index_add_(1, i, s), (5, 4), torch.tensor([3, 3]), (5, 2)),
    "index_copy_(0)": (
        lambda x, i, s: x.index_copy_(0, i, s),
        (5, 4),
        torch.tensor([4, 1]),
        (2, 4),
    ),
    "index_fill_(0, neg)": (
        lambda x, i, s: x.index_fill_(0, i, -2.0),
        (5, 4),
        torch.tensor([-1, 1]),
        None,
    ),
    "index_reduce_(0, mean)": (
        lambda x, i, s: x.index_reduce_(0, i, s, "mean", include_self=False),
        (5, 4),
        torch.tensor([2, 2, 4, 0]),
        (4, 4),
    ),
    "index_reduce_(1, prod)": (
        lambda x, i, s: x.index_reduce_(1, i, s, "prod"),
        (5, 4),
        torch.tensor([0, 3, 0]),
        (5, 3),
    ),
    "scatter_(0)": (
        lambda x, i, s: x.scatter_(0, i, s),
        (5, 4),
        torch.randperm(5, generator=_G)[:3].unsqueeze(1).expand(3, 4).contiguous(),
        (3, 4),
    ),
    "scatter_(1, value, reduce)": (
        lambda x, i, s: x.scatter_(1, i, 2.0, reduce="multiply"),
        (5, 4),
        torch.randint(0, 4, (4, 2), generator=_G),
        None,
    ),
    "scatter_add_(1)": (
        lambda x, i, s: x.scatter_add_(1, i, s),
        (5, 4),
        torch.randint(0, 4, (3, 3), generator=_G),
        (4, 3),
    ),
    "scatter_reduce_(0, amin)": (
        lambda x, i, s: x.scatter_reduce_(0, i, s, "amin", include_self=False),
        (5, 4),
        torch.randint(0, 5, (5, 4), generator=_G),
        (5, 4),
    ),
    "put_(accumulate)": (
        lambda x, i, s: x.put_(i, s, accumulate=True),
        (5, 4),
        torch.tensor([19, 0, 19, 6]),
        (4,),
    ),
    "cumsum_(0)": (lambda x, i, s: x.cumsum_(0), (5, 4), torch.tensor([0]), None),
    "cumsum_(1)": (lambda x, i, s: x.cumsum_(1), (5, 4), torch.tensor([0]), None),
}


def _inplace_results() -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import dtensor_patches

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    problems = []
    with dtensor_patches.patched():
        for name, (fn, shape, index, src_shape) in _INPLACE.items():
            base = torch.randn(shape, generator=torch.Generator().manual_seed(1))
            src = (
                None
                if src_shape is None
                else torch.randn(src_shape, generator=torch.Generator().manual_seed(2))
            )
            expected = base.clone()
            fn(expected, index, src)
            for placement in (Shard(0), Shard(1), Replicate(), Partial()):
                for plain_index in (False, True):
                    if isinstance(placement, Partial):
                        share = base / dist.get_world_size()
                        x = DTensor.from_local(share, mesh, [placement], run_check=False)
                    else:
                        x = distribute_tensor(base.clone(), mesh, [placement])
                    i = index if plain_index else distribute_tensor(index, mesh, [Replicate()])
                    s = None if src is None else distribute_tensor(src, mesh, [Replicate()])
                    label = f"{name} {placement} plain_index={plain_index}"
                    out = fn(x, i, s)
                    if out is not x:
                        problems.append(f"{label}: returned another object")
                    if tuple(x.placements) != (placement,):
                        problems.append(f"{label}: placements {x.placements}")
                    if not torch.allclose(x.full_tensor(), expected, atol=1e-5):
                        problems.append(f"{label}: values differ")
        # src sharded like x (aligned: used locally) and sharded otherwise (gathered).
        base = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
        index = torch.randint(0, 4, (5, 4), generator=torch.Generator().manual_seed(4))
        src = torch.randn(5, 4, generator=torch.Generator().manual_seed(5))
        expected = base.clone().scatter_add_(1, index, src)
        for src_placement in (Shard(0), Shard(1)):
            x = distribute_tensor(base.clone(), mesh, [Shard(0)])
            x.scatter_add_(
                1,
                distribute_tensor(index, mesh, [Shard(0)]),
                distribute_tensor(src, mesh, [src_placement]),
            )
            if not torch.allclose(x.full_tensor(), expected, atol=1e-5):
                problems.append(f"scatter_add_ with src {src_placement}: values differ")
        # An out-of-range index raises on every rank (torch's own error, no hang).
        x = distribute_tensor(base.clone(), mesh, [Shard(0)])
        try:
            x.index_add_(0, torch.tensor([5]), torch.ones(1, 4))
            problems.append("index_add_ with an out-of-range index did not raise")
        except (IndexError, RuntimeError):
            pass
    return problems


def test_inplace_indexed_writes(pool2: RankPool) -> None:
    for rank, problems in enumerate(pool2.run(_inplace_results)):
        assert problems == [], f"rank {rank}: {problems}"


def _functional_and_grad_results() -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches import get

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    problems = []
    base = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    src = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    index = torch.tensor([4, 1, 4])
    scatter_index = torch.randint(0, 5, (3, 4), generator=torch.Generator().manual_seed(3))
    calls: dict[str, Callable[..., Any]] = {
        "index_add": lambda x, s, i, j: torch.index_add(x, 0, i, s),
        "index_copy": lambda x, s, i, j: torch.index_copy(x, 0, i[:2], s[:2]),
        "scatter_reduce(sum)": lambda x, s, i, j: torch.scatter_reduce(x, 0, j, s, "sum"),
        "scatter_reduce(mean)": lambda x, s, i, j: torch.scatter_reduce(x, 0, j, s, "mean"),
        "index_add_ on a copy": lambda x, s, i, j: (x * 1).index_add_(0, i, s),
        "scatter_add_ on a copy": lambda x, s, i, j: (x * 1).scatter_add_(0, j, s),
    }
    with dtensor_patches.patched():
        for name, fn in calls.items():
            xp = base.clone().requires_grad_()
            sp = src.clone().requires_grad_()
            expected = fn(xp, sp, index, scatter_index)
            (expected * torch.arange(20.0).reshape(5, 4)).sum().backward()
            for placement in (Shard(0), Shard(1), Replicate()):
                label = f"{name} {placement}"
                dx = distribute_tensor(base.clone(), mesh, [placement]).requires_grad_()
                ds = distribute_tensor(src.clone(), mesh, [Replicate()]).requires_grad_()
                weights = distribute_tensor(torch.arange(20.0).reshape(5, 4), mesh, [placement])
                got = fn(
                    dx,
                    ds,
                    distribute_tensor(index, mesh, [Replicate()]),
                    distribute_tensor(scatter_index, mesh, [Replicate()]),
                )
                ours = not name.startswith("index_") or get("index_functional").applies_to()
                if ours and tuple(got.placements) != (placement,):
                    # Our handlers keep x's placements; torch's own strategies (2.12+) may not.
                    problems.append(f"{label}: output placements {got.placements}")
                if not torch.allclose(got.full_tensor(), expected.detach(), atol=1e-5):
                    problems.append(f"{label}: values differ")
                    continue
                (got * weights).sum().backward()
                if not torch.allclose(dx.grad.full_tensor(), xp.grad, atol=1e-5):
                    problems.append(f"{label}: grad of x differs")
                if not torch.allclose(ds.grad.full_tensor(), sp.grad, atol=1e-5):
                    problems.append(f"{label}: grad of src differs")
    return problems


def test_functional_indexed_writes_and_gradients(pool2: RankPool) -> None:
    for rank, problems in enumerate(pool2.run(_functional_and_grad_results)):
        assert problems == [], f"rank {rank}: {problems}"


def _index_like(x: Any, index: torch.Tensor, placement: Any) -> Any:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(x, DTensor):
        return distribute_tensor(index, x.device_mesh, [placement])
    return index


def _getitem_results() -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import dtensor_patches

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    problems = []
    base = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(1))
    row_mask = torch.tensor([True, False, True, True, False])
    # (label, fn, {input placement: the output placement promised}).
    cases: list[tuple[str, Callable[[Any], Any], dict[Any, Any]]] = [
        ("x[[1, 2]]", lambda x: x[[1, 2]], {Shard(0): Replicate(), Shard(2): Shard(2)}),
        ("x[:, [3, 0, 3]]", lambda x: x[:, [3, 0, 3]], {Shard(0): Shard(0), Shard(2): Shard(2)}),
        (
            "x[[[0], [4]], :, [1, 2]] (2-d index, non-adjacent)",
            lambda x: x[torch.tensor([[0], [4]]), :, torch.tensor([1, 2])],
            {Shard(1): Shard(2), Shard(0): Replicate()},
        ),
        (
            "x[:, [1, 2], [0, 2]] (adjacent)",
            lambda x: x[:, torch.tensor([1, 2]), torch.tensor([0, 2])],
            {Shard(0): Shard(0), Shard(1): Replicate()},
        ),
        ("x[row_mask]", lambda x: x[row_mask], {Shard(1): Shard(1), Shard(0): Replicate()}),
        ("x[x > 0]", lambda x: x[x > 0], {Shard(1): Replicate(), Replicate(): Replicate()}),
        ("x[..., [2]]", lambda x: x[..., [2]], {Shard(1): Shard(1), Partial(): Partial()}),
        (
            "x[:, idx] with idx a Shard(0) DTensor",
            lambda x: x[:, _index_like(x, torch.tensor([[3, 0], [1, 1], [2, 3]]), Shard(0))],
            {Replicate(): Shard(1), Shard(0): Shard(0), Shard(2): Shard(3)},
        ),
    ]
    with dtensor_patches.patched():
        for label, fn, promised in cases:
            xp = base.clone().requires_grad_()
            expected = fn(xp)
            expected.sum().backward()
            for placement, out_placement in promised.items():
                tag = f"{label} {placement}"
                if isinstance(placement, Partial):
                    from torch.distributed.tensor import DTensor

                    share = base / dist.get_world_size()
                    dx = DTensor.from_local(share, mesh, [placement], run_check=False)
                else:
                    dx = distribute_tensor(base.clone(), mesh, [placement]).requires_grad_()
                got = fn(dx)
                if tuple(got.placements) != (out_placement,):
                    problems.append(f"{tag}: placements {got.placements} != {out_placement}")
                if not torch.allclose(got.full_tensor(), expected.detach(), atol=1e-5):
                    problems.append(f"{tag}: values differ")
                    continue
                if dx.requires_grad:
                    got.sum().backward()
                    if not torch.allclose(dx.grad.full_tensor(), xp.grad, atol=1e-5):
                        problems.append(f"{tag}: grad differs")
    return problems


def test_getitem(pool2: RankPool) -> None:
    for rank, problems in enumerate(pool2.run(_getitem_results)):
        assert problems == [], f"rank {rank}: {problems}"
