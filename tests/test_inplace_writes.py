"""In-place writes: Partial targets and writes through views of sharded dims (``inplace_writes``).

Each example runs on real gloo ranks and is compared with the same in-place op on a plain
tensor: the caller's object must change in place, hold the single-device values, and carry
placements that describe its data.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtensor_patches.testing import RankPool

# name -> in-place op on (target, other). ``other`` has the target's shape.
_PARTIAL_OPS: dict[str, Any] = {
    "add_scalar": lambda t, o: t.add_(2.0),
    "iadd_scalar": lambda t, o: t.__iadd__(2),
    "sub_tensor": lambda t, o: t.sub_(o),
    "clamp": lambda t, o: t.clamp_(min=-0.5, max=0.5),
    "clamp_min": lambda t, o: t.clamp_min_(0.1),
    "exp": lambda t, o: t.exp_(),
    "pow": lambda t, o: t.pow_(2),
    "abs": lambda t, o: t.abs_(),
    "relu": lambda t, o: t.relu_(),
    "lerp": lambda t, o: t.lerp_(o, 0.3),
    "addcmul": lambda t, o: t.addcmul_(o, o, value=0.5),
    "mul_tensor": lambda t, o: t.mul_(o),
    "fill": lambda t, o: t.fill_(1.5),
    "copy": lambda t, o: t.copy_(o),
    "mul_scalar": lambda t, o: t.mul_(3.0),
    "div_scalar": lambda t, o: t.div_(4.0),
    "neg": lambda t, o: t.neg_(),
    "zero": lambda t, o: t.zero_(),
}

# name -> in-place op on a view (``other`` has the view's shape).
_VIEW_OPS: dict[str, Any] = {
    "zero": lambda v, o: torch.nn.init.zeros_(v),
    "fill": lambda v, o: v.fill_(-2.0),
    "fill_tensor": lambda v, o: v.fill_(torch.tensor(0.25)),
    "add": lambda v, o: v.add_(o),
    "mul": lambda v, o: v.mul_(3.0),
    "copy": lambda v, o: v.copy_(o),
    "clamp": lambda v, o: v.clamp_(max=0.0),
}


def _view(t: torch.Tensor, how: str, dim: int, start: int, stop: int) -> torch.Tensor:
    if how == "slice":
        return t.narrow(dim, start, stop - start)
    if how == "select":
        return t.select(dim, start)
    return t.transpose(0, 1).narrow(1 - dim if t.ndim == 2 else dim, start, stop - start)


def _partial_share(full: torch.Tensor, mesh: Any) -> Any:
    """A ``Partial(sum)`` DTensor whose shares differ per rank and sum to ``full``."""
    from torch.distributed.tensor import DTensor, Partial

    n = mesh.size()
    share = full * (dist.get_rank() + 1) * 2 / (n * (n + 1))
    return DTensor.from_local(share, mesh, [Partial()], run_check=False)


def _partial_case(op_name: str, shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor

    import dtensor_patches

    fn = _PARTIAL_OPS[op_name]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(seed)
    full, other = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    expected = fn(full.clone(), other)
    with dtensor_patches.patched(only=["inplace_writes"]):
        target = _partial_share(full, mesh)
        other_d = distribute_tensor(other, mesh, [Replicate()])
        out = fn(target, other_d)
        got = target.full_tensor()
        placement = target.placements[0]
    return {
        "same_object": out is target,
        "values": torch.allclose(got, expected, atol=1e-5, rtol=1e-5),
        # In place: the caller's tensor keeps its placements, its shares reduce to the value.
        "placement": isinstance(placement, Partial) and not isinstance(placement, Replicate),
        "got_placement": str(placement),
    }


def _view_case(
    op_name: str,
    shape: tuple[int, ...],
    placements: list[str],
    mesh_shape: tuple[int, ...],
    view: tuple[str, int, int, int],
    seed: int,
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import dtensor_patches
    from dtensor_patches.errors import LostWriteError
    from dtensor_patches.reproducers import parse_placement

    fn = _VIEW_OPS[op_name]
    if not dtensor_patches.get("view_writes").applies_to():
        return {"gated_out": True}
    mesh = init_device_mesh("cpu", mesh_shape)
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g)
    expected = full.clone()
    expected_view = _view(expected, *view)
    other = torch.randn(expected_view.shape, generator=g)
    fn(expected_view, other)
    placement_objs = [parse_placement(p) for p in placements]
    with dtensor_patches.patched(only=["inplace_writes", "view_writes"]):
        w = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, placement_objs))
        other_d = distribute_tensor(other, mesh, [parse_placement("R")] * len(mesh_shape))
        refused = False
        with torch.no_grad():
            v = _view(w, *view)
            try:
                out = fn(v, other_d)
            except LostWriteError:
                refused, out = True, v
        got = w.detach().full_tensor()
    return {
        "refused": refused,
        "values": torch.allclose(got, expected, atol=1e-6),
        "same_object": out is v,
        "placements_kept": list(w.placements) == placement_objs,
    }


_SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.mark.parametrize("op_name", sorted(_PARTIAL_OPS))
def test_inplace_op_on_partial_target(pool2: RankPool, op_name: str) -> None:
    @_SETTINGS
    @given(
        shape=st.lists(st.integers(0, 5), min_size=0, max_size=2).map(tuple),
        seed=st.integers(0, 2**16),
    )
    def check(shape: tuple[int, ...], seed: int) -> None:
        for rank, r in enumerate(pool2.run(_partial_case, op_name, shape, seed)):
            assert r["same_object"], f"rank {rank}: the op did not return the caller's tensor"
            assert r["values"], f"rank {rank}: values differ from single device for {shape}"
            assert r["placement"], f"rank {rank}: placement {r['got_placement']}"

    check()


@st.composite
def _view_examples(draw: st.DrawFn, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    shape = (draw(st.integers(1, 7)), draw(st.integers(1, 5)))
    placements = [draw(st.sampled_from(["S0", "S1", "R"])) for _ in mesh_shape]
    how = draw(st.sampled_from(["slice", "select", "transposed_slice"]))
    dim = draw(st.integers(0, 1))
    start = draw(st.integers(0, shape[dim] - 1))
    stop = draw(st.integers(start + 1, shape[dim]))
    if how == "transposed_slice":
        # narrow along the transposed view's dim ``1 - dim``, i.e. the base's ``dim``
        start, stop = draw(st.integers(0, shape[dim] - 1)), shape[dim]
    return {
        "op": draw(st.sampled_from(sorted(_VIEW_OPS))),
        "shape": shape,
        "placements": placements,
        "view": (how, dim, start, stop),
        "seed": draw(st.integers(0, 2**16)),
    }


def _check_view(pool: RankPool, mesh_shape: tuple[int, ...], ex: dict[str, Any]) -> None:
    results = pool.run(
        _view_case, ex["op"], ex["shape"], ex["placements"], mesh_shape, ex["view"], ex["seed"]
    )
    for rank, r in enumerate(results):
        if r.get("gated_out"):
            pytest.skip("view_writes is gated out on this torch (2.10/2.11)")
        # Every view op is replayed on the gathered source: no write is refused or lost.
        assert not r["refused"], f"rank {rank}: refused a write through a view: {ex}"
        assert r["values"], f"rank {rank}: write through the view lost or wrong: {ex}"
        assert r["same_object"], f"rank {rank}: the op did not return the view: {ex}"
        assert r["placements_kept"], f"rank {rank}: the base's placements changed: {ex}"


def test_writes_through_views_reach_the_base(pool2: RankPool) -> None:
    @settings(_SETTINGS, max_examples=max(settings().max_examples * 4, 24))
    @given(ex=_view_examples((2,)))
    def check(ex: dict[str, Any]) -> None:
        _check_view(pool2, (2,), ex)

    check()


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_writes_through_views_four_ranks(pool4: RankPool, mesh_shape: tuple[int, ...]) -> None:
    @_SETTINGS
    @given(ex=_view_examples(mesh_shape))
    def check(ex: dict[str, Any]) -> None:
        _check_view(pool4, mesh_shape, ex)

    check()


def _stock_and_patched_results() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import dtensor_patches

    inplace_writes = dtensor_patches.get("inplace_writes")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {"stock": inplace_writes.reproduce_on(mesh)}
    with dtensor_patches.patched(only=["inplace_writes"]):
        out["patched"] = inplace_writes.reproduce_on(mesh)
    out["reverted"] = inplace_writes.reproduce_on(mesh)
    return out


def test_reproducer_fails_on_stock_and_passes_patched(pool2: RankPool) -> None:
    for r in pool2.run(_stock_and_patched_results):
        assert r["stock"] is not None
        assert r["patched"] is None
        assert r["reverted"] == r["stock"]


def _partial_target_and_operands(op: str) -> list[bool]:
    """An in-place product on a ``Partial(sum)`` target whose other operands are pending sums
    too (found by tools/validate: the patch reduced the target only, and torch's strategy for
    ``addmv_(R, P, P)`` adds each rank's ``mat_i @ vec_i``). Stock torch is right here; the
    patch must stay right."""
    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    g = torch.Generator().manual_seed(3)
    s, m, v = (
        torch.randn(5, generator=g),
        torch.randn(5, 7, generator=g),
        torch.randn(7, generator=g),
    )
    calls = {
        "addmv_": (lambda a, b, c: a.addmv_(b, c), (s, m, v)),
        "addmm_": (
            lambda a, b, c: a.addmm_(b, c),
            (torch.randn(5, 3, generator=g), m, torch.randn(7, 3, generator=g)),
        ),
        "addcmul_": (lambda a, b, c: a.addcmul_(b, c), (s, s * 2, s - 1)),
    }
    fn, (a, b, c) = calls[op]
    expected = fn(a.clone(), b, c)
    out = []
    for patched in (False, True):
        dtensor_patches.revert_all()
        if patched:
            dtensor_patches.apply_all()
        try:
            target = _partial_share(a, mesh)
            fn(target, _partial_share(b, mesh), _partial_share(c, mesh))
            out.append(torch.allclose(target.full_tensor(), expected, atol=1e-5))
        except RuntimeError:
            if patched:
                raise
            out.append(False)  # stock torch refuses some (2.12+): a clear error
        finally:
            dtensor_patches.revert_all()
    return out


@pytest.mark.parametrize("op", ["addmv_", "addmm_", "addcmul_"])
def test_partial_target_with_partial_operands(pool2: RankPool, op: str) -> None:
    for stock_right, patched_right in pool2.run(_partial_target_and_operands, op):
        assert patched_right or not stock_right, "apply_all() made a right result wrong"
        assert patched_right


# name -> in-place foreach op on (targets, others): what clipping, gradient averaging and
# optimizers do to lists of gradients.
_FOREACH_OPS: dict[str, Any] = {
    "mul_scalar": lambda ts, os: torch._foreach_mul_(ts, 0.5),
    "mul_tensor": lambda ts, os: torch._foreach_mul_(ts, torch.tensor(0.25)),
    "div_scalar": lambda ts, os: torch._foreach_div_(ts, 4.0),
    "add_list_alpha": lambda ts, os: torch._foreach_add_(ts, os, alpha=-0.5),
    "mul_scalar_list": lambda ts, os: torch._foreach_mul_(ts, [0.5 + i for i in range(len(ts))]),
    "addcmul_scalar": lambda ts, os: torch._foreach_addcmul_(ts, os, os, value=0.3),
    "exp": lambda ts, os: torch._foreach_exp_(ts),
    "zero": lambda ts, os: torch._foreach_zero_(ts),
}


def _foreach_on_partial_targets(name: str) -> list[tuple[str, bool, bool]]:
    """``name`` on a list of gradients as TP + SP leaves them (``Partial()`` norm weights beside
    ``Shard(0)`` and ``Replicate()`` ones, ``Partial("avg")`` too), the others replicated: per
    target, (placement, full value equal to the plain op's, placements unchanged)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from dtensor_patches.testing import world_mesh

    mesh, rank = world_mesh(), dist.get_rank()
    g = torch.Generator().manual_seed(4)
    fulls = [torch.randn(4, 3, generator=g) for _ in range(4)]
    others = [torch.randn(4, 3, generator=g) for _ in range(4)]
    placements = [[Partial()], [Shard(0)], [Replicate()], [Partial("avg")]]
    targets = []
    for full, placement in zip(fulls, placements, strict=True):
        if placement[0].is_partial():
            share = full * (rank + 1) / 3 if placement[0].reduce_op == "sum" else full
            targets.append(DTensor.from_local(share.clone(), mesh, placement, run_check=False))
        else:
            targets.append(distribute_tensor(full.clone(), mesh, placement))
    other_dts = [distribute_tensor(o, mesh, [Replicate()]) for o in others]
    expected = [f.clone() for f in fulls]
    _FOREACH_OPS[name](expected, others)
    fn = _FOREACH_OPS[name]
    if name == "mul_tensor":
        coefficient = distribute_tensor(torch.tensor(0.25), mesh, [Replicate()])
        torch._foreach_mul_(targets, coefficient)
    else:
        fn(targets, other_dts)
    return [
        (
            str(p[0]),
            torch.allclose(t.full_tensor(), e, atol=1e-6),
            tuple(t.placements) == tuple(p),
        )
        for t, e, p in zip(targets, expected, placements, strict=True)
    ]


def _patched_foreach(name: str) -> list[tuple[str, bool, bool]]:
    import dtensor_patches

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        return _foreach_on_partial_targets(name)
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("name", list(_FOREACH_OPS))
def test_foreach_writes_reach_partial_targets(pool2: RankPool, name: str) -> None:
    """Up to 2.11 the ``Partial`` targets of an in-place foreach op kept their old values
    (``clip_grad_norm_`` left sequence-parallel gradients unclipped); with ``apply_all()`` every
    target holds the single-device result in its own placements, on every release."""
    for result in pool2.run(_patched_foreach, name):
        for placement, equal, kept in result:
            assert equal, (name, placement, result)
            assert kept, (name, placement, result)


def _foreach_linear_collectives(name: str) -> tuple[int, bool]:
    """``name`` (linear in its targets) on ``Partial(sum)``/``Partial("avg")`` gradients under
    ``apply_all()``: (collectives counted by ``CommDebugMode`` during the op, every target
    equal to the plain op's result)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        mesh, rank = world_mesh(), dist.get_rank()
        g = torch.Generator().manual_seed(6)
        fulls = [torch.randn(4, 3, generator=g) for _ in range(3)]
        placements = [[Partial()], [Partial("avg")], [Partial()]]
        targets = [
            DTensor.from_local(
                (f * (rank + 1) / 3 if p[0].reduce_op == "sum" else f).clone(),
                mesh,
                p,
                run_check=False,
            )
            for f, p in zip(fulls, placements, strict=True)
        ]
        expected = [f.clone() for f in fulls]
        _FOREACH_OPS[name](expected, None)
        coefficient = distribute_tensor(torch.tensor(0.25), mesh, [Replicate()])
        with CommDebugMode() as comm:
            if name == "mul_tensor":
                torch._foreach_mul_(targets, coefficient)
            else:
                _FOREACH_OPS[name](targets, None)
        equal = all(
            torch.allclose(t.full_tensor(), e, atol=1e-6)
            for t, e in zip(targets, expected, strict=True)
        )
        return comm.get_total_counts(), equal
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize(
    "name", ["mul_scalar", "mul_tensor", "div_scalar", "mul_scalar_list", "zero"]
)
def test_foreach_linear_writes_move_nothing(pool2: RankPool, name: str) -> None:
    """Scaling or zeroing pending sums needs no reduction (the lower bound is zero bytes):
    ``clip_grad_norm_``'s ``_foreach_mul_`` on sequence-parallel gradients, right and with no
    collective after ``apply_all()`` on every release."""
    for collectives, equal in pool2.run(_foreach_linear_collectives, name):
        assert equal, name
        assert collectives == 0, (name, collectives)


def _foreach_scale_of_max(factor: float) -> bool:
    """``_foreach_mul_`` by ``factor`` on a ``Partial("max")`` target (not linear for a
    negative factor: max(-a, -b) is not -max(a, b)) under ``apply_all()``: the full value
    equals the plain op's."""
    from torch.distributed.tensor import DTensor, Partial

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        mesh, rank = world_mesh(), dist.get_rank()
        g = torch.Generator().manual_seed(7)
        shares = [torch.randn(4, 3, generator=g) for _ in range(dist.get_world_size())]
        full = torch.stack(shares).amax(0)
        target = DTensor.from_local(shares[rank].clone(), mesh, [Partial("max")], run_check=False)
        torch._foreach_mul_([target], factor)
        return torch.allclose(target.full_tensor(), full * factor)
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("factor", [-2.0, 0.5])
def test_foreach_scale_of_partial_max(pool2: RankPool, factor: float) -> None:
    assert all(pool2.run(_foreach_scale_of_max, factor))


def _misplaced_inplace_2x2(name: str) -> tuple[str | None, bool, bool]:
    """An in-place op on a 2x2 mesh whose decided output placement is not its target's (torch
    2.13 propagates ``addmv_`` through its decomposition and wrote a local result of another
    layout into the target; the next collective aborted gloo): the target's value and layout
    against the same op on plain tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import grid_mesh, raised_on_any_rank

    mesh = grid_mesh((2, 2))
    g = torch.Generator().manual_seed(7)
    s, m, v = (
        torch.randn(5, generator=g),
        torch.randn(5, 5, generator=g),
        torch.randn(5, generator=g),
    )
    x, mask = torch.randn(5, 4, generator=g), torch.rand(5, 4, generator=g) > 0.5
    dp_only = [Shard(0), Replicate()]
    cases = {
        "addmv_": (
            lambda: s.clone().addmv_(m, v),
            lambda: distribute_tensor(s, mesh, dp_only).addmv_(
                distribute_tensor(m, mesh, dp_only), distribute_tensor(v, mesh, dp_only)
            ),
        ),
        "masked_fill_": (
            lambda: x.clone().masked_fill_(mask, 10.0),
            lambda: distribute_tensor(x, mesh, dp_only).masked_fill_(
                distribute_tensor(mask, mesh, [Replicate(), Shard(0)]), 10.0
            ),
        ),
    }
    want_fn, got_fn = cases[name]
    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        got, raised = raised_on_any_rank(got_fn)
        if raised is not None:
            return raised, False, False
        layout = tuple(got.placements) == tuple(dp_only) and got.to_local().shape[0] == (
            3 if dist.get_rank() < 2 else 2
        )
        return None, torch.allclose(got.full_tensor(), want_fn(), atol=1e-5), layout
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("name", ["addmv_", "masked_fill_"])
def test_inplace_op_whose_decision_misplaces_its_target_on_a_2x2_mesh(
    pool4: RankPool, name: str
) -> None:
    for raised, equal, layout in pool4.run(_misplaced_inplace_2x2, name):
        assert raised is None, raised
        assert equal and layout
