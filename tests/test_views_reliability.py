"""Views and the writes through them, against the single device (issue 23, items 4, 5, 10,
12, 15, 17).

Each program runs once on plain tensors and once on DTensors of the same values (a 2-rank gloo
mesh, ``apply_all()``), and every tensor it touched is compared afterwards: the inputs (the
bases of the views), the views it wrote or read, and what it returned. A program the single
device refuses must be refused with the same error type, every tensor left as it was. Before
anything is gathered, the ranks agree that every DTensor is self-consistent (its local shape
is the one its spec implies): a corrupted one would abort gloo or hang in the gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtensor_patches.testing import RankPool

Program = Callable[[list[torch.Tensor]], Sequence[Any]]


def _squeeze_all(ts: list[torch.Tensor]) -> list[Any]:
    (x,) = ts
    r = x.squeeze_()
    return [r is x, tuple(x.shape), x * 1]


def _squeeze_dim_local_singleton(ts: list[torch.Tensor]) -> list[Any]:
    # [2, 4] Shard(0): dim 0 is size 1 on each rank, size 2 globally: no squeeze.
    (x,) = ts
    x.squeeze_(0)
    return [tuple(x.shape), x * 1]


def _squeeze_dims(ts: list[torch.Tensor]) -> list[Any]:
    (x,) = ts
    x.squeeze_((0, 1))
    return [tuple(x.shape), x + 1]


def _transposed_view(ts: list[torch.Tensor]) -> list[Any]:
    (x,) = ts
    return [x.t().view(-1)]


def _write_transposed_view(ts: list[torch.Tensor]) -> list[Any]:
    (x,) = ts
    x.t().view(-1).fill_(1.0)
    return []


def _legal_transposed_views(ts: list[torch.Tensor]) -> list[Any]:
    (x,) = ts
    return [x.t().contiguous().view(-1), x.t().reshape(-1), x.t().flatten()]


# name -> (program, input shapes, placements, patch the program needs or None)
PROGRAMS: dict[str, tuple[Program, list[tuple[int, ...]], list[str], str | None]] = {
    # item 10: squeeze_ of a sharded dim with one element per rank
    "squeeze_() [2, 1, 3] Shard(0)": (_squeeze_all, [(2, 1, 3)], ["S0"], None),
    "squeeze_() [3, 1, 3] Shard(0) uneven": (_squeeze_all, [(3, 1, 3)], ["S0"], None),
    "squeeze_() [1, 4, 1] Shard(1)": (_squeeze_all, [(1, 4, 1)], ["S1"], None),
    "squeeze_(0) [2, 4] Shard(0)": (_squeeze_dim_local_singleton, [(2, 4)], ["S0"], None),
    "squeeze_((0, 1)) [2, 1, 3] Shard(0)": (_squeeze_dims, [(2, 1, 3)], ["S0"], None),
    # item 15: a view the single device refuses
    "x.t().view(-1) Shard(0)": (_transposed_view, [(4, 3)], ["S0"], None),
    "x.t().view(-1) Shard(1)": (_transposed_view, [(4, 3)], ["S1"], None),
    "x.t().view(-1).fill_(1)": (_write_transposed_view, [(4, 3)], ["S0"], None),
    "x.t() legal flattening views": (_legal_transposed_views, [(4, 3)], ["S0"], None),
}


def _placement(text: str) -> Any:
    from dtensor_patches.reproducers import parse_placement

    return parse_placement(text)


def _run(program: Program, tensors: list[torch.Tensor]) -> tuple[str, Any]:
    try:
        return "ok", list(program(tensors))
    except Exception as exc:  # noqa: BLE001 - compared with the single device's error
        return "raised", f"{type(exc).__name__}: {exc}"


def _consistent(values: Sequence[Any]) -> bool:
    """Every DTensor among ``values`` has the local shape its spec implies, on every rank (a
    collective every rank makes: no rank gathers a corrupted tensor alone)."""
    from torch.distributed.tensor import DTensor

    from dtensor_patches._torch.dtensors import local_shape_and_offset

    ok = True
    for v in values:
        if isinstance(v, DTensor):
            implied, _ = local_shape_and_offset(v.shape, v.device_mesh, v.placements)
            ok = ok and tuple(v.to_local().shape) == tuple(implied)
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def _plain(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.shape == want.shape
            and got.dtype == want.dtype
            and torch.allclose(got, want, atol=1e-6, rtol=1e-6)
        )
    return bool(got == want)


def _program_case(name: str) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    program, shapes, placements, needs = PROGRAMS[name]
    if needs is not None and not dtensor_patches.get(needs).applies_to():
        return {"skipped": f"{needs} is gated out on torch {torch.__version__}"}
    mesh = world_mesh()
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=g) for s in shapes]
    plain = [f.clone() for f in fulls]
    want_kind, want = _run(program, plain)
    with dtensor_patches.patched():
        dts = [
            distribute_tensor(f.clone(), mesh, [_placement(p)])
            for f, p in zip(fulls, placements, strict=True)
        ]
        got_kind, got = _run(program, dts)
        touched = [*dts, *(got if got_kind == "ok" else [])]
        if not _consistent(touched):
            return {"skipped": None, "problems": ["a DTensor's local shape is not its spec's"]}
        bases = [_plain(d) for d in dts]
        outputs = [_plain(v) for v in got] if got_kind == "ok" else got
    problems = []
    if want_kind != got_kind:
        problems.append(f"single device {want_kind} ({want}), DTensor {got_kind} ({got})")
    elif want_kind == "raised":
        if want.split(":")[0] != got.split(":")[0]:
            problems.append(f"error {got} != single device {want}")
    else:
        if len(want) != len(outputs):
            problems.append(f"{len(outputs)} results != single device {len(want)}")
        for i, (o, w) in enumerate(zip(outputs, want, strict=False)):
            if not _same(o, w):
                problems.append(f"result {i}: {o} != single device {w}")
    for i, (b, p) in enumerate(zip(bases, plain, strict=True)):
        if not _same(b, p):
            problems.append(f"input {i} after the program: {b} != single device {p}")
    return {"skipped": None, "problems": problems}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_program_matches_single_device(pool2: RankPool, name: str) -> None:
    results = pool2.run(_program_case, name)
    if results[0]["skipped"]:
        pytest.skip(results[0]["skipped"])
    for rank, r in enumerate(results):
        assert not r["problems"], f"rank {rank}: {name}: " + "; ".join(r["problems"])
