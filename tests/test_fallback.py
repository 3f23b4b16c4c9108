"""The fallback (``dtensor_patches.dispatch.fallback``): calls torch refuses run on gathered inputs.

Every example runs on real gloo ranks and is compared with the same call on plain tensors on
one device (values, shape, dtype; exact for integers), gradients included. The ops used have
no sharding strategy (or refuse the placement) on the supported releases, and each test also
checks that the fallback really ran (``fallback_report()``), so a pass is not torch's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtensor_patches.dispatch.fallback_report  # noqa: F401 - the tests call it
from dtensor_patches.testing import RankPool

_SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _place(t: torch.Tensor, mesh: Any, placements: list[str]) -> Any:
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    from dtensor_patches.reproducers import parse_placement

    objs = [parse_placement(p) for p in placements]
    if any(isinstance(p, Partial) for p in objs):
        # Shares that differ per rank and sum to t (Partial on every mesh dim listed so).
        n = mesh.size()
        share = t * (dist.get_rank() + 1) * 2 / (n * (n + 1))
        return DTensor.from_local(share, mesh, objs, run_check=False)
    return distribute_tensor(t, mesh, objs)


def _full(v: Any) -> Any:
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def _same(got: Any, expected: Any) -> str | None:
    from dtensor_patches.reproducers import compare

    got_list = list(got) if isinstance(got, (tuple, list)) else [got]
    exp_list = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    if len(got_list) != len(exp_list):
        return f"{len(got_list)} outputs != {len(exp_list)}"
    for i, (g, e) in enumerate(zip(got_list, exp_list, strict=True)):
        if isinstance(e, torch.Tensor):
            problem = compare(_full(g), e, what=f"output {i}", atol=1e-4)
            if problem is not None:
                return problem
        elif g != e:
            return f"output {i}: {g!r} != {e!r}"
    return None


def _grad_of(fn: Callable[..., Any], x: Any, *rest: Any) -> Any:
    x = x.detach().requires_grad_()
    out = fn(x, *rest)
    out = out[0] if isinstance(out, (tuple, list)) else out
    (grad,) = torch.autograd.grad((out * out).sum(), [x])
    return grad


# name -> (fn(x, y), x shape, y shape or None, differentiable). Each has no strategy for
# these placements on 2.9 to 2.15 (or refuses them), so only the fallback runs it.
_OPS: dict[str, tuple[Callable[..., Any], tuple[int, ...], tuple[int, ...] | None, bool]] = {
    "renorm": (lambda x, y: torch.renorm(x, 2, 0, 1.0), (5, 4), None, True),
    "trace": (lambda x, y: torch.trace(x), (5, 4), None, False),
    "kron": (lambda x, y: torch.kron(x, y), (3, 2), (2, 3), False),
    "cdist": (lambda x, y: torch.cdist(x, y), (5, 3), (4, 3), True),
    "aminmax": (lambda x, y: torch.aminmax(x, dim=1), (5, 4), None, False),
    "take": (lambda x, y: torch.take(x, (y.abs() * 7).long() % x.numel()), (5, 4), (6,), False),
    # Optional (bias=None) and list arguments; no strategy for 5-D inputs on 2.9.
    "conv3d_no_bias": (
        lambda x, y: torch.nn.functional.conv3d(x, y, None, stride=[1, 1, 1]),
        (3, 2, 3, 3, 3),
        (2, 2, 2, 2, 2),
        True,
    ),
    "unbind_sharded": (lambda x, y: torch.stack(x.unbind(0)) * 2, (5, 4), None, True),
    "flatten_uneven": (
        lambda x, y: x.reshape(x.shape[0], 2, 2).flatten(1, 2) + 1,
        (5, 4),
        None,
        True,
    ),
    "fill_diagonal": (lambda x, y: x.clone().fill_diagonal_(3.0), (5, 4), None, False),
    "bincount": (lambda x, y: torch.bincount((x.abs() * 3).long().flatten()), (5, 4), None, False),
}


def _op_case(
    name: str,
    x_rows: int,
    placements: list[str],
    other_placements: list[str],
    mesh_shape: tuple[int, ...],
    seed: int,
) -> dict[str, Any]:
    import dtensor_patches
    from dtensor_patches._torch.versions import subclass_dispatch_honoured
    from dtensor_patches.errors import PatchError

    fn, x_shape, y_shape, differentiable = _OPS[name]
    x_shape = (x_rows, *x_shape[1:]) if name not in ("kron", "trace") else x_shape
    mesh = _mesh(mesh_shape)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=g)
    y = torch.randn(y_shape, generator=g) if y_shape is not None else None
    expected = fn(x, y)
    dtensor_patches.dispatch.fallback_report.reset_report()
    with dtensor_patches.patched():
        xd = _place(x, mesh, placements)
        yd = _place(y, mesh, other_placements) if y is not None else None
        try:
            got = fn(xd, yd)
        except PatchError as exc:
            # torch 2.10/2.11: a view the fallback made could not carry its writes, so the
            # fallback refuses view ops there (issue 23, item 4), as stock torch does.
            if subclass_dispatch_honoured() or "could not carry writes" not in str(exc):
                raise
            return {"problem": None, "fallbacks": ["refused: view op"]}
        except RuntimeError as exc:
            # fill_diagonal_ reaches torch's as_strided handler, which refuses clearly, as
            # stock does, on the releases the as_strided patch lists as known unfixable.
            if "as_strided not supported" not in str(exc) or not _as_strided_unfixable():
                raise
            return {"problem": None, "fallbacks": ["refused: as_strided"]}
        problem = _same(got, expected)
        grad_problem = None
        if differentiable and problem is None and "P" not in placements:
            grad_problem = _same(_grad_of(fn, xd, yd), _grad_of(fn, x, y))
            grad_problem = grad_problem and f"gradient: {grad_problem}"
        report = dtensor_patches.fallback_report()
    return {"problem": problem or grad_problem, "fallbacks": [r.op for r in report]}


def _as_strided_unfixable() -> bool:
    from dtensor_patches import registry
    from dtensor_patches._torch.versions import torch_release

    unfixable = registry.get("as_strided").known_unfixable
    return unfixable is not None and torch_release() in unfixable


def _assert_ok(rows: list[dict[str, Any]]) -> None:
    assert rows[0]["problem"] is None, rows[0]
    assert all(r == rows[0] for r in rows), rows


@pytest.mark.parametrize("name", sorted(_OPS))
def test_op_matches_single_device(pool2: RankPool, name: str) -> None:
    rows = pool2.run(_op_case, name, 5, ["S0"], ["R"], (2,), 0)
    _assert_ok(rows)


def test_the_fallback_really_ran(pool2: RankPool) -> None:
    # cdist has no strategy on any supported release: a correct result is the fallback's.
    rows = pool2.run(_op_case, "cdist", 5, ["S1"], ["S1"], (2,), 1)
    _assert_ok(rows)
    assert any("cdist" in op for op in rows[0]["fallbacks"]), rows[0]


@_SETTINGS
@given(
    # conv3d included: its layouts torch's handler cannot compute reach the fallback's
    # machinery through the conv_layouts patch.
    name=st.sampled_from(sorted(_OPS)),
    rows=st.integers(1, 7),
    placement=st.sampled_from(["S0", "S1", "R", "P"]),
    other=st.sampled_from(["S0", "R"]),
    seed=st.integers(0, 2**16),
)
def test_ops_placements_uneven_shapes(
    pool2: RankPool, name: str, rows: int, placement: str, other: str, seed: int
) -> None:
    _assert_ok(pool2.run(_op_case, name, rows, [placement], [other], (2,), seed))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh_shape", "placements"), [((4,), ["S0"]), ((4,), ["S1"]), ((2, 2), ["S0", "S1"])]
)
@pytest.mark.parametrize(
    "name", ["renorm", "cdist", "aminmax", "unbind_sharded", "take", "conv3d_no_bias"]
)
def test_four_ranks_and_2d_mesh(
    pool4: RankPool, name: str, mesh_shape: tuple[int, ...], placements: list[str]
) -> None:
    other = ["R"] * len(mesh_shape)
    _assert_ok(pool4.run(_op_case, name, 7, placements, other, mesh_shape, 3))


# --- in-place and out=, keeping the caller's placements ------------------------------------


def _inplace_case(bad: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Shard

    import dtensor_patches

    mesh = _mesh((dist.get_world_size(),))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 4, generator=g) * 3
    out_plain = torch.zeros(5, 4)
    p = -1.0 if bad else 2.0
    with dtensor_patches.patched():
        xd = _place(x, mesh, ["S1"])
        out = _place(out_plain.clone(), mesh, ["S0"])
        before = out.to_local().clone()
        try:
            result = torch.renorm(xd, p, 0, 1.0, out=out)
            error = None
        except RuntimeError as exc:
            result, error = None, str(exc)
        try:
            expected = torch.renorm(x, p, 0, 1.0, out=out_plain)
            expected_error = None
        except RuntimeError as exc:
            expected, expected_error = None, str(exc)
        return {
            "same_object": result is out,
            "placements": list(out.placements) == [Shard(0)],
            "values": None if expected is None else _same(out, expected),
            "error": error is not None,
            "expected_error": expected_error is not None,
            "untouched": torch.equal(out.to_local(), before),
        }


def test_out_variant_writes_in_place_and_keeps_placements(pool2: RankPool) -> None:
    row = pool2.run(_inplace_case, False)[0]
    assert row["same_object"] and row["placements"], row
    assert row["values"] is None, row


def test_failed_call_leaves_the_out_tensor_as_it_was(pool2: RankPool) -> None:
    row = pool2.run(_inplace_case, True)[0]
    assert row["expected_error"], "renorm with p=-1 must fail on plain tensors too"
    assert row["error"] and row["untouched"], row


# --- random ops ---------------------------------------------------------------------------


def _random_case() -> dict[str, Any]:
    import dtensor_patches

    mesh = _mesh((dist.get_world_size(),))
    rates = torch.rand(6, 4, generator=torch.Generator().manual_seed(0)) * 5
    with dtensor_patches.patched():
        d = _place(rates, mesh, ["S0"])
        torch.manual_seed(11)
        got = torch.poisson(d).full_tensor()
    torch.manual_seed(11)
    expected = torch.poisson(rates)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, got)
    return {
        "agree": all(torch.equal(e, everyone[0]) for e in everyone),
        "single_device": torch.equal(everyone[0], expected) if dist.get_rank() == 0 else True,
    }


def test_random_op_gives_the_same_values_on_every_rank(pool2: RankPool) -> None:
    rows = pool2.run(_random_case)
    assert rows[0]["agree"], rows
    # Computed on coordinate 0 from its generator: what one device draws with that seed.
    assert rows[0]["single_device"], rows


# --- modes ----------------------------------------------------------------------------------


def _mode_case(mode: str, use_env: bool) -> dict[str, Any]:
    import dtensor_patches
    from dtensor_patches.dispatch.fallback import FALLBACK_ENV

    mesh = _mesh((dist.get_world_size(),))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    if use_env:
        os.environ[FALLBACK_ENV] = mode
    try:
        with dtensor_patches.patched(fallback=None if use_env else mode):
            xd = _place(x, mesh, ["S1"])
            try:
                torch.cdist(xd, xd)
                return {"error": None}
            except Exception as exc:  # noqa: BLE001 - the error is what the test checks
                return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        os.environ.pop(FALLBACK_ENV, None)


@pytest.mark.parametrize("use_env", [False, True])
def test_mode_error_names_op_and_placements(pool2: RankPool, use_env: bool) -> None:
    row = pool2.run(_mode_case, "error", use_env)[0]
    assert row["error"] == "PatchError", row
    assert "_cdist_forward" in row["message"] and "Shard(dim=1)" in row["message"], row


@pytest.mark.parametrize("use_env", [False, True])
def test_mode_off_is_torchs_own_error(pool2: RankPool, use_env: bool) -> None:
    row = pool2.run(_mode_case, "off", use_env)[0]
    assert row["error"] == "NotImplementedError", row
    assert "sharding strategy" in row["message"], row


def test_mode_warn_runs(pool2: RankPool) -> None:
    assert pool2.run(_mode_case, "warn", False)[0]["error"] is None


def test_unknown_mode_is_refused() -> None:
    from dtensor_patches.dispatch.fallback import resolve_mode

    with pytest.raises(ValueError, match="one of off, warn, error"):
        resolve_mode("loud")
    assert resolve_mode(None) == "warn"


# --- report -------------------------------------------------------------------------------


def _report_case() -> list[tuple[str, int, int]]:
    import dtensor_patches

    mesh = _mesh((dist.get_world_size(),))
    x = torch.randn(6, 4)
    dtensor_patches.dispatch.fallback_report.reset_report()
    with dtensor_patches.patched():
        xd = _place(x, mesh, ["S0"])
        for _ in range(3):
            torch.trace(torch.cdist(xd, xd))
        report = dtensor_patches.fallback_report()
    return [(r.op, r.calls, r.bytes) for r in report if "cdist" in r.op]


def test_report_counts_calls_and_bytes(pool2: RankPool) -> None:
    rows = pool2.run(_report_case)
    ((_op, calls, moved),) = rows[0]
    assert calls == 3
    # Each rank receives the other rank's 3 rows of both inputs: 2 x 3 x 4 float32, per call.
    assert moved == 3 * 2 * 3 * 4 * 4, rows


# --- calls torch can run are untouched ------------------------------------------------------


def _native_calls(fallback: str) -> list[Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    import dtensor_patches

    mesh = _mesh((dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 4, generator=g), torch.randn(4, 8, generator=g)
    dtensor_patches.dispatch.fallback_report.reset_report()
    out = []
    with dtensor_patches.patched(fallback=fallback):
        calls = [
            lambda: _place(x, mesh, ["S0"]) @ _place(w, mesh, ["R"]),
            lambda: _place(x, mesh, ["S1"]) @ _place(w, mesh, ["S0"]),
            lambda: _place(x, mesh, ["S0"]).sum(),
            lambda: (_place(x, mesh, ["S1"]).softmax(-1) * 2).mean(0),
            lambda: _place(x, mesh, ["P"]) + 1.0,
            lambda: _place(x, mesh, ["S0"]).view(6, 2, 2),
        ]
        for call in calls:
            with CommDebugMode() as comm:
                result = call()
            out.append(
                (
                    str(result.placements),
                    {str(k): v for k, v in comm.get_comm_counts().items()},
                    result.full_tensor().tolist(),
                )
            )
        out.append(len(dtensor_patches.fallback_report()))
    return out


def test_calls_torch_can_run_are_dispatched_as_without_the_library(pool2: RankPool) -> None:
    on = pool2.run(_native_calls, "warn")
    off = pool2.run(_native_calls, "off")
    assert on == off
    assert on[0][-1] == 0  # no fallback happened


# --- mixed kinds: optimizers and gradient clipping ----------------------------------------


def _optimizer_case(foreach: bool, fallback: str) -> dict[str, Any]:
    from torch.distributed.tensor import Shard

    import dtensor_patches

    mesh = _mesh((dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 4, generator=g), torch.randn(4, generator=g)
    gw, gb = torch.randn(6, 4, generator=g), torch.randn(4, generator=g)
    plain = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
    plain[0].grad, plain[1].grad = gw.clone(), gb.clone()
    with dtensor_patches.patched(fallback=fallback):
        wd = torch.nn.Parameter(_place(w.clone(), mesh, ["S0"]))
        bd = torch.nn.Parameter(b.clone())  # an FSDP2 ignored param: a plain tensor
        wd.grad = _place(gw.clone(), mesh, ["S0"])
        bd.grad = gb.clone()
        try:
            norm = torch.nn.utils.clip_grad_norm_([wd, bd], 1.0, foreach=foreach)
            opt = torch.optim.AdamW([wd, bd], lr=0.1, foreach=foreach)
            for _ in range(2):
                opt.step()
            error = None
        except Exception as exc:  # noqa: BLE001 - the error is what the test checks
            error = f"{type(exc).__name__}: {exc}"
            norm = None
    if error is not None:
        return {"error": error}
    expected_norm = torch.nn.utils.clip_grad_norm_(plain, 1.0, foreach=foreach)
    opt = torch.optim.AdamW(plain, lr=0.1, foreach=foreach)
    for _ in range(2):
        opt.step()
    return {
        "error": None,
        "norm": _same(_full(norm), expected_norm),
        "weight": _same(wd.detach(), plain[0].detach()),
        "bias": _same(bd.detach(), plain[1].detach()),
        "placements": list(wd.placements) == [Shard(0)],
    }


@pytest.mark.parametrize("foreach", [True, False])
def test_optimizer_and_clipping_over_mixed_params(pool2: RankPool, foreach: bool) -> None:
    row = pool2.run(_optimizer_case, foreach, "warn")[0]
    assert row == {"error": None, "norm": None, "weight": None, "bias": None, "placements": True}


def test_mixed_params_fail_without_the_grouping_fix(pool2: RankPool) -> None:
    # The tripwire of the grouping fix: stock torch still refuses these lists.
    row = pool2.run(_optimizer_case, True, "off")[0]
    assert row["error"] is not None and "mixed torch.Tensor and DTensor" in row["error"], row


def _two_meshes_case() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import dtensor_patches

    n = dist.get_world_size()
    dp = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    tp = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g)
    with dtensor_patches.patched():
        pa = torch.nn.Parameter(_place(a.clone(), dp, ["S0"]))
        pb = torch.nn.Parameter(_place(b.clone(), tp, ["S1"]))
        pa.grad, pb.grad = _place(a.clone(), dp, ["S0"]), _place(b.clone(), tp, ["S1"])
        norm = torch.nn.utils.get_total_norm([pa.grad, pb.grad])
        clipped = torch.nn.utils.clip_grad_norm_([pa, pb], 0.5)
        grads = (pa.grad.full_tensor(), pb.grad.full_tensor())
    expected = torch.linalg.vector_norm(torch.cat([a.flatten(), b.flatten()]))
    scale = min(1.0, 0.5 / (expected.item() + 1e-6))
    return {
        "norm": _same(_full(norm), expected),
        "clip_norm": _same(_full(clipped), expected),
        "grads": _same(grads, (a * scale, b * scale)),
    }


def test_global_norm_over_two_meshes(pool2: RankPool) -> None:
    assert pool2.run(_two_meshes_case)[0] == {"norm": None, "clip_norm": None, "grads": None}


def _gathered_locally_case() -> dict[str, Any]:
    import dtensor_patches

    mesh = _mesh((dist.get_world_size(),))
    g = torch.Generator().manual_seed(5)
    h0, w = torch.randn(3, 4, generator=g), torch.randn(6, 4, generator=g)
    h = h0 + dist.get_rank()  # this rank's own data: it differs between ranks
    w_plain = w.clone().requires_grad_()
    expected = h @ w_plain.T
    # The loss counts once per rank and the gradient is their sum, as FSDP's reduce-scatter
    # gives (issue 23, item 1).
    grads = [
        torch.autograd.grad(((h0 + r) @ w_plain.T).sum(), [w_plain])[0]
        for r in range(dist.get_world_size())
    ]
    with dtensor_patches.patched():
        wd = _place(w.clone(), mesh, ["S0"]).requires_grad_()
        try:
            h @ wd.T
            mixed_refused = False
        except RuntimeError as exc:
            text = str(exc)
            mixed_refused = "differ between the ranks" in text and "gathered_locally()" in text
        with dtensor_patches.gathered_locally():
            got = h @ wd.T
        (grad,) = torch.autograd.grad(got.sum(), [wd])
    return {
        "mixed_refused": mixed_refused,
        "plain": type(got) is torch.Tensor,
        "value": _same(got, expected),
        "grad": _same(grad, sum(grads)),
    }


def test_gathered_locally_is_the_second_reading(pool2: RankPool) -> None:
    row = pool2.run(_gathered_locally_case)[0]
    assert row == {"mixed_refused": True, "plain": True, "value": None, "grad": None}


def _plain_beside_case() -> dict[str, Any]:
    from torch.distributed.tensor._dispatch import OpDispatcher
    from torch.distributed.tensor.experimental import implicit_replication

    import dtensor_patches

    mesh = _mesh((dist.get_world_size(),))
    g = torch.Generator().manual_seed(8)
    scores, mask = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    own = mask + dist.get_rank()  # differs between ranks
    torch_check = OpDispatcher._try_replicate_spec_for_scalar_tensor
    with dtensor_patches.patched():
        wrapped = OpDispatcher._try_replicate_spec_for_scalar_tensor is not torch_check
        sd = _place(scores.clone(), mesh, ["S1"])
        same = sd + mask  # the same on every rank: checked, then taken as Replicate()
        try:
            sd + own
            error: BaseException | None = None
        except RuntimeError as exc:
            error = exc
        with implicit_replication():
            unchecked = sd + own  # the user's own choice: Replicate(), unchecked
        after_block = sd + mask  # leaving implicit_replication() keeps the checked reading
    restored = OpDispatcher._try_replicate_spec_for_scalar_tensor is torch_check
    try:
        sd + mask
        stock: str | None = None
    except RuntimeError as exc:
        stock = str(exc)
    text = str(error)
    return {
        "wrapped": wrapped,
        "restored": restored,
        "kind": type(error).__name__,
        "names_op": "aten.add.Tensor" in text,
        "names_both": "implicit_replication()" in text and "gathered_locally()" in text,
        "says_why": "differ between the ranks" in text,
        "same": _same(_full(same), scores + mask),
        "after_block": _same(_full(after_block), scores + mask),
        "unchecked_local": _same(unchecked.to_local(), (scores + own).chunk(2, 1)[dist.get_rank()]),
        "stock_refuses_after_revert": stock is not None and "mixed torch.Tensor" in stock,
    }


def test_plain_tensor_beside_dtensors_is_checked(pool2: RankPool) -> None:
    for row in pool2.run(_plain_beside_case):
        assert row == {
            "wrapped": True,
            "restored": True,
            "kind": "MixedTensorError",
            "names_op": True,
            "names_both": True,
            "says_why": True,
            "same": None,
            "after_block": None,
            "unchecked_local": None,
            "stock_refuses_after_revert": True,
        }, row


def test_ambiguity_error_message() -> None:
    from dtensor_patches.dispatch.mixed import ambiguity_error
    from dtensor_patches.errors import MixedTensorError

    error = ambiguity_error(
        "aten.mm.default", torch.ones(3, 4), None, RuntimeError("aten.mm.default: got mixed")
    )
    assert isinstance(error, MixedTensorError) and isinstance(error, RuntimeError)
    assert error.op == "aten.mm.default" and error.shape == (3, 4)
    text = str(error)
    for words in ("[3, 4]", "implicit_replication()", "gathered_locally()", "from_local"):
        assert words in text, (words, text)
