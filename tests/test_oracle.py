"""Correctness oracle: every patched op, on real multi-rank CPU gloo meshes, equals the plain
single-device computation, for random shapes (uneven, size-1, empty dims), placements
(``Shard(d)``, ``Replicate()``, ``Partial()`` where the op is linear), dtypes and arguments;
gradients too where the op is differentiable; and the output placements are the ones the
strategy promises.

Hypothesis draws the examples in this process; every rank of a long-lived pool evaluates them
with all applicable patches applied (``patched()`` per example, so other tests see stock torch).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dtensor_patches.testing import RankPool
from tests.oracle_ops import ORACLE, make_input

_MESHES: dict[tuple[int, ...], Any] = {}


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:  # sub-groups of a 2-D mesh are costly: build each mesh once
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def _expected_placement(op_name: str, placement: Any, params: dict[str, Any], ndim: int) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    op = ORACLE[op_name]
    assert op.dims is not None
    along = op.dims(params, ndim)
    if type(placement) is Shard and placement.dim not in along:
        if op.keepdim(params):
            return placement
        return Shard(placement.dim - sum(1 for d in along if d < placement.dim))
    if isinstance(placement, Partial) and op.linear:
        return placement
    return Replicate()


def _outputs(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.is_floating_point():
        tol = 2e-2 if expected.dtype == torch.bfloat16 else 1e-5
        return torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol, equal_nan=True)
    return torch.equal(got, expected)


def evaluate(
    op_name: str,
    shape: tuple[int, ...],
    dtype: str,
    placements: list[str],
    mesh_shape: tuple[int, ...],
    params: dict[str, Any],
    seed: int,
) -> dict[str, Any]:
    """On every rank: run the op patched on DTensors and plain; say what differs, if anything."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    import dtensor_patches
    from dtensor_patches import get
    from dtensor_patches.reproducers import parse_placement
    from dtensor_patches.testing import layout_agrees

    op = ORACLE[op_name]
    mesh = _mesh(mesh_shape)
    plain = make_input(shape, dtype, seed)
    parsed = [parse_placement(p) for p in placements]
    if any(isinstance(p, Partial) for p in parsed):
        n, rank = dist.get_world_size(), dist.get_rank()
        if op.partial:
            # Shares of both signs (rank 0: x + d, the others -d / (n - 1)), so that an op
            # applied to each share before the reduction (abs, clamp, + scalar) shows.
            d = make_input(shape, dtype, seed + 1)
            share = plain + d if rank == 0 else -d / (n - 1)
        else:
            share = plain * (rank + 1) * 2 / (n * (n + 1))
        dx = DTensor.from_local(share, mesh, parsed, run_check=False)
    else:
        dx = distribute_tensor(plain, mesh, parsed)
    grads = (
        op.differentiable
        and plain.is_floating_point()
        and (op.partial or not any(isinstance(p, Partial) for p in parsed))
    )
    if grads:
        dx = dx.detach().requires_grad_()
        plain = plain.detach().requires_grad_()
    with dtensor_patches.patched():
        got = _outputs(op.run(dx, params))
        expected = _outputs(op.run(plain, params))
        problems = []
        if len(got) != len(expected):
            problems.append(f"{len(got)} outputs != {len(expected)}")
        for i, (g, e) in enumerate(zip(got, expected, strict=False)):
            if isinstance(g, DTensor) and not layout_agrees(g):
                problems.append(
                    f"output {i}: local strides {g.to_local().stride()} contradict the "
                    f"spec's {g.stride()}"
                )
            full = g.full_tensor() if isinstance(g, DTensor) else g
            if not _close(full.detach(), e.detach()):
                problems.append(f"output {i}: {full.detach()!r} != {e.detach()!r}")
        if grads and not problems:
            floats = [o for o in got if o.is_floating_point()]
            plain_floats = [o for o in expected if o.is_floating_point()]
            sum(o.sum() for o in floats).backward()
            sum(o.sum() for o in plain_floats).backward()
            if not _close(dx.grad.full_tensor(), plain.grad):
                problems.append(f"grad: {dx.grad.full_tensor()!r} != {plain.grad!r}")
        out_placements = [tuple(o.placements) for o in got if isinstance(o, DTensor)]
        promised = None
        if op.dims is not None and get(op.patch).applies_to():
            promised = tuple(_expected_placement(op_name, p, params, len(shape)) for p in parsed)
            for i, actual in enumerate(out_placements):
                if actual != promised:
                    problems.append(f"output {i} placements {actual} != promised {promised}")
    return {"problems": problems, "placements": [str(p) for p in out_placements]}


@st.composite
def examples(draw: st.DrawFn, op_name: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    op = ORACLE[op_name]
    ndim = draw(st.integers(op.min_ndim, 3))
    low = 1 if op.needs_nonempty else 0
    shape = tuple(draw(st.lists(st.integers(low, 6), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(op.dtypes))
    choices = ["R"] + [f"S{d}" for d in range(ndim)]
    if (op.linear or op.partial) and dtype in ("float32", "bfloat16") and len(mesh_shape) == 1:
        choices.append("P")
    placements = [draw(st.sampled_from(choices)) for _ in mesh_shape]
    params = {
        "dim": draw(st.integers(-ndim, ndim - 1)),
        "keepdim": draw(st.booleans()),
        "shift": draw(st.integers(-3, 3)),
        "reduction": draw(st.sampled_from(["none", "mean", "sum"])),
    }
    if op.refused is not None:
        assume(not any(op.refused(p, params, shape) for p in placements))
    if op_name == "mv":
        assume(ndim == 2)
    if op_name == "glu":
        assume(shape[params["dim"] % ndim] % 2 == 0)
    if op_name == "unfold":
        assume(shape[params["dim"] % ndim] >= 1 + params["shift"] % 2)
    seed = draw(st.integers(0, 2**16))
    return {
        "shape": shape,
        "dtype": dtype,
        "placements": placements,
        "params": params,
        "seed": seed,
    }


def _check(
    pool: RankPool, op_name: str, mesh_shape: tuple[int, ...], example: dict[str, Any]
) -> None:
    results = pool.run(
        evaluate,
        op_name,
        example["shape"],
        example["dtype"],
        example["placements"],
        mesh_shape,
        example["params"],
        example["seed"],
    )
    for rank, result in enumerate(results):
        assert not result["problems"], f"rank {rank}: {result['problems']} for {example}"


_SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.mark.parametrize("op_name", sorted(ORACLE))
def test_oracle_two_ranks(pool2: RankPool, op_name: str) -> None:
    @_SETTINGS
    @given(example=examples(op_name, (2,)))
    def check(example: dict[str, Any]) -> None:
        _check(pool2, op_name, (2,), example)

    check()


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("op_name", sorted(ORACLE))
def test_oracle_four_ranks(pool4: RankPool, op_name: str, mesh_shape: tuple[int, ...]) -> None:
    # Our strategies on wider and 2-D meshes. Where the patch is gated out, torch's own
    # strategy runs; some of those hang on a 2x2 mesh (argmax on 2.13: ranks disagree and
    # block in a collective), which is torch's gap, not one this suite can time-box.
    from dtensor_patches import get

    if not get(ORACLE[op_name].patch).applies_to():
        pytest.skip("patch gated out on this torch: torch's own strategy runs")

    @_SETTINGS
    @given(example=examples(op_name, mesh_shape))
    def check(example: dict[str, Any]) -> None:
        _check(pool4, op_name, mesh_shape, example)

    check()
