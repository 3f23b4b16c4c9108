"""``gathered_locally()``'s gradients and writes, and the fallback's plain write targets.

Issue 23, items 1, 3, 2 and 19. Each case runs on a real 2-rank gloo mesh and is compared with
the same computation on plain single-device tensors (every tensor written, on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtensor_patches.testing import RankPool


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _place(t: torch.Tensor, mesh: Any, placement: str) -> Any:
    """``t`` as a DTensor: ``S0``/``S1``/``R`` by ``distribute_tensor``, ``P`` as shares that
    differ per rank and sum to ``t``."""
    from torch.distributed.tensor import DTensor, Partial

    from dtensor_patches.reproducers import parse_placement

    p = parse_placement(placement)
    if isinstance(p, Partial):
        n = mesh.size()
        share = t * (dist.get_rank() + 1) * 2 / (n * (n + 1))
        return DTensor.from_local(share, mesh, [p], run_check=False)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, mesh, [p])


def _same(got: Any, expected: torch.Tensor, what: str) -> str | None:
    from dtensor_patches.reproducers import compare

    full = got.full_tensor() if hasattr(got, "full_tensor") else got
    return compare(full, expected, what=what, atol=1e-5)


def _problems(pairs: list[tuple[Any, torch.Tensor, str]]) -> list[str]:
    return [p for got, exp, what in pairs if (p := _same(got, exp, what)) is not None]


# ---------------------------------------------------------------- item 1: gradients over ranks


def _gradient_case(placement: str, rows: int) -> dict[str, Any]:
    """``with gathered_locally(): y = h_rank @ w.T``, a different ``h_rank`` on each rank; the
    gradient of ``w`` is the single-device gradient of ``cat(h_ranks) @ w.T``."""
    import dtensor_patches

    mesh, rank, world = _mesh(), dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(23)
    h_all = torch.randn(world * 3, 4, generator=g)
    w = torch.randn(rows, 4, generator=g)
    weights = torch.randn(world * 3, rows, generator=g)
    w_plain = w.clone().requires_grad_()
    ((h_all @ w_plain.T) * weights).sum().backward()
    h_rank = h_all[3 * rank : 3 * rank + 3]
    with dtensor_patches.patched():
        wd = _place(w.clone(), mesh, placement).requires_grad_()
        with dtensor_patches.gathered_locally():
            y = h_rank @ wd.T
            loss = (y * weights[3 * rank : 3 * rank + 3]).sum()
        loss.backward()
    grad = wd.grad
    problems = _problems([(y, h_rank @ w.T, "y"), (grad, w_plain.grad, "w.grad")])
    expected_placements = tuple("R" if p.is_partial() else str(p) for p in wd.placements)
    got_placements = tuple("R" if p.is_replicate() else str(p) for p in grad.placements)
    if got_placements != expected_placements:
        problems.append(f"grad placements {grad.placements} for {wd.placements}")
    # The replicated gradient must be the same on every rank.
    return {"problems": problems, "local": grad.to_local().clone()}


@pytest.mark.parametrize(
    ("placement", "rows"), [("S0", 6), ("S0", 5), ("S1", 6), ("R", 6), ("P", 6)]
)
def test_gathered_locally_sums_gradients_over_ranks(
    pool2: RankPool, placement: str, rows: int
) -> None:
    results = pool2.run(_gradient_case, placement, rows)
    for rank, row in enumerate(results):
        assert row["problems"] == [], (rank, row["problems"])
    if placement in ("R", "P"):
        torch.testing.assert_close(results[0]["local"], results[1]["local"])


def _backward_inside_case() -> list[str]:
    """``loss.backward()`` inside the block, then an SGD step inside it too."""
    import dtensor_patches

    mesh, rank, world = _mesh(), dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    h_all, w = torch.randn(world * 2, 4, generator=g), torch.randn(6, 4, generator=g)
    w_plain = torch.nn.Parameter(w.clone())
    (h_all @ w_plain.T).square().sum().backward()
    with torch.no_grad():
        expected = w_plain - 0.1 * w_plain.grad
    with dtensor_patches.patched():
        wd = torch.nn.Parameter(_place(w.clone(), mesh, "S0"))
        opt = torch.optim.SGD([wd], lr=0.1)
        with dtensor_patches.gathered_locally():
            (h_all[2 * rank : 2 * rank + 2] @ wd.T).square().sum().backward()
            opt.step()
    return _problems([(wd.grad, w_plain.grad, "w.grad"), (wd, expected, "w after step")])


def test_backward_and_step_inside_the_block(pool2: RankPool) -> None:
    assert pool2.run(_backward_inside_case) == [[], []]


# ---------------------------------------------------------------- item 3: writes in the block

_WRITES: dict[str, Callable[[Any, torch.Tensor], Any]] = {
    "mul_": lambda w, p: w.mul_(0.5),
    "add_plain": lambda w, p: w.add_(p),
    "copy_plain": lambda w, p: w.copy_(p),
    "add_out": lambda w, p: torch.add(p, 1, out=w),
    "setitem": lambda w, p: w.__setitem__(0, 1.0),
    "setitem_slice": lambda w, p: w.__setitem__((slice(None), slice(1, 3)), p[:, :2]),
    "view_fill": lambda w, p: w[1].fill_(7.0),
    "view_then_read": lambda w, p: (v := w.T, v.mul_(2.0), w.sum())[-1],
    "chain": lambda w, p: w.mul_(2.0).add_(p),
    "foreach": lambda w, p: torch._foreach_add_([w], [p], alpha=2.0),
    "zero_": lambda w, p: w.zero_(),
}


def _write_case(name: str, placement: str, rows: int) -> list[str]:
    import dtensor_patches

    fn = _WRITES[name]
    mesh = _mesh()
    g = torch.Generator().manual_seed(31)
    w, p = torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g)
    expected = w.clone()
    fn(expected, p.clone())
    with dtensor_patches.patched():
        wd = _place(w.clone(), mesh, placement)
        before = tuple(wd.placements)
        with torch.no_grad(), dtensor_patches.gathered_locally():
            fn(wd, p.clone())
            inside = wd.sum()
    problems = _problems([(wd, expected, "w"), (inside, expected.sum(), "read in the block")])
    if tuple(wd.placements) != before:
        problems.append(f"placements {before} -> {wd.placements}")
    return problems


@pytest.mark.parametrize("name", sorted(_WRITES))
def test_writes_inside_the_block_reach_the_shards(pool2: RankPool, name: str) -> None:
    assert pool2.run(_write_case, name, "S0", 5) == [[], []]


@pytest.mark.parametrize("placement", ["S1", "R", "P"])
def test_writes_inside_the_block_other_placements(pool2: RankPool, placement: str) -> None:
    for name in ("mul_", "setitem", "add_out"):
        assert pool2.run(_write_case, name, placement, 6) == [[], []], name


def _sgd_case(foreach: bool) -> list[str]:
    import dtensor_patches

    mesh = _mesh()
    g = torch.Generator().manual_seed(37)
    w, grad = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    w_plain = torch.nn.Parameter(w.clone())
    w_plain.grad = grad.clone()
    torch.optim.SGD([w_plain], lr=0.1, momentum=0.9, foreach=foreach).step()
    with dtensor_patches.patched():
        wd = torch.nn.Parameter(_place(w.clone(), mesh, "S0"))
        wd.grad = _place(grad.clone(), mesh, "S0")
        opt = torch.optim.SGD([wd], lr=0.1, momentum=0.9, foreach=foreach)
        with dtensor_patches.gathered_locally():
            opt.step()
    return _problems([(wd, w_plain.detach(), "w after step"), (wd.grad, grad, "grad kept")])


@pytest.mark.parametrize("foreach", [False, True])
def test_sgd_step_inside_the_block(pool2: RankPool, foreach: bool) -> None:
    assert pool2.run(_sgd_case, foreach) == [[], []]


def _refused_write_case(kind: str) -> dict[str, Any]:
    """A differentiable write into a DTensor that requires grad: stock raises for a leaf
    (``a leaf Variable that requires grad``); here it is refused, nothing written."""
    import dtensor_patches

    mesh = _mesh()
    w = torch.arange(10.0).reshape(5, 2)
    with dtensor_patches.patched():
        leaf = _place(w.clone(), mesh, "S0").requires_grad_()
        target = leaf if kind == "leaf" else leaf * 1.0
        local_before = target.to_local().detach().clone()
        try:
            with dtensor_patches.gathered_locally():
                target.mul_(2.0)
            error = None
        except RuntimeError as exc:
            error = str(exc)
        unchanged = torch.equal(target.to_local().detach(), local_before)
    plain_error = None
    plain = w.clone().requires_grad_()
    if kind == "leaf":
        try:
            plain.mul_(2.0)
        except RuntimeError as exc:
            plain_error = str(exc)
    return {"error": error, "unchanged": unchanged, "plain_error": plain_error}


@pytest.mark.parametrize("kind", ["leaf", "non_leaf"])
def test_differentiable_write_is_refused_clearly(pool2: RankPool, kind: str) -> None:
    for row in pool2.run(_refused_write_case, kind):
        assert row["error"] is not None and "gathered_locally()" in row["error"], row
        assert row["unchanged"], row
        if kind == "leaf":
            assert row["plain_error"] is not None and "leaf Variable" in row["error"], row


# ---------------------------------------------------------------- item 2: plain write targets


def _plain_call(name: str, a: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
    """The call ``name`` on the inputs ``a``, writing the plain targets ``t``."""
    from torch.distributed.tensor.experimental import implicit_replication

    if name == "aminmax_0dim":
        torch.aminmax(a["x"], out=(t["mn"], t["mx"]))
    elif name == "renorm_x11":
        torch.renorm(a["x11"], 2, 0, 1.0, out=t["out11"])
    elif name == "renorm_view_out":
        torch.renorm(a["x"], 2, 0, 1.0, out=t["base"][1:5])
    elif name == "renorm_implicit":
        with implicit_replication():
            torch.renorm(a["x"], 2, 0, 1.0, out=t["out"])
    elif name == "renorm_view_implicit":
        with implicit_replication():
            torch.renorm(a["x"], 2, 0, 1.0, out=t["base"][1:5])
    elif name == "addr_implicit":
        with implicit_replication():
            t["out"].addr_(a["v1"], a["v2"])
    elif name == "addr_view_implicit":
        with implicit_replication():
            t["base"][2:].addr_(a["v1"], a["v2"])
    elif name == "renorm_expanded_implicit":
        # One device refuses an expand-ed out=; nothing may be written.
        with implicit_replication():
            torch.renorm(a["x"], 2, 0, 1.0, out=t["row"].expand(4, 3))
    elif name == "kthvalue_expanded_implicit":
        # A DTensor and a plain target; the plain one is refused, so neither is written.
        with implicit_replication():
            torch.kthvalue(a["x"], 1, dim=1, out=(a["mn4"], t["one"].expand(4)))
    elif name == "run_gathered_ambiguous":
        # A patch handler sees a call before torch's mixed-tensor check: a plain out= of
        # more than one element outside implicit_replication() is ambiguous, so refused.
        if isinstance(a["x"], torch.Tensor) and type(a["x"]) is torch.Tensor:
            torch.renorm(a["x"], 2, 0, 1.0, out=t["out"])
        else:
            from dtensor_patches.dispatch.gather import run_gathered

            run_gathered(torch.ops.aten.renorm.out, (a["x"], 2, 0, 1.0), {"out": t["out"]}, "t")
    else:
        raise AssertionError(name)


def _plain_target_case(name: str) -> dict[str, Any]:
    """A fallback call that writes plain tensors (``out=``, ``self``), compared with the single
    device: either every plain target (the base of a view target included) holds its values,
    or the call raised and every target is as it was."""
    import dtensor_patches

    mesh = _mesh()
    g = torch.Generator().manual_seed(41)
    x, x11 = torch.randn(4, 3, generator=g) * 2, torch.randn(1, 1, generator=g) * 3
    v1, v2 = torch.randn(4, generator=g), torch.randn(3, generator=g)
    mn4 = torch.randn(4, generator=g)
    targets = {
        "row": torch.zeros(3),
        "one": torch.zeros(1, dtype=torch.long),
        "mn": torch.zeros(()),
        "mx": torch.zeros(()),
        "out11": torch.zeros(1, 1),
        "out": torch.randn(4, 3, generator=g),
        "base": torch.randn(6, 3, generator=g),
    }
    expected = {k: v.clone() for k, v in targets.items()}
    plain_inputs = {"x": x, "x11": x11, "v1": v1, "v2": v2, "mn4": mn4.clone()}
    try:
        _plain_call(name, plain_inputs, expected)
        plain_error = None
    except RuntimeError as exc:
        plain_error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    with dtensor_patches.patched():
        inputs = {
            "x": _place(x.clone(), mesh, "S0"),
            "x11": _place(x11.clone(), mesh, "S0"),
            "v1": _place(v1.clone(), mesh, "S0"),
            "v2": _place(v2.clone(), mesh, "S0"),
            "mn4": _place(mn4.clone(), mesh, "S0"),
        }
        got = {k: v.clone() for k, v in targets.items()}
        try:
            _plain_call(name, inputs, got)
            error = None
        except RuntimeError as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    row: dict[str, Any] = {"error": error, "plain_error": plain_error}
    if error is not None:
        written = {**got, "mn4": inputs["mn4"]}
        before = {**targets, "mn4": mn4}
        changed = [k for k in before if not torch.equal(_full(written[k]), before[k])]
        row["problems"] = [f"{k} changed by a failed call" for k in changed]
        return row
    got_all = [(got[k], expected[k], k) for k in targets]
    row["problems"] = _problems([*got_all, (inputs["mn4"], plain_inputs["mn4"], "mn4")])
    return row


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


_PLAIN_TARGETS = [
    "aminmax_0dim",
    "renorm_x11",
    "renorm_view_out",
    "renorm_implicit",
    "renorm_view_implicit",
    "addr_implicit",
    "addr_view_implicit",
    "renorm_expanded_implicit",
    "kthvalue_expanded_implicit",
    "run_gathered_ambiguous",
]


@pytest.mark.parametrize("name", _PLAIN_TARGETS)
def test_fallback_writes_plain_targets(pool2: RankPool, name: str) -> None:
    rows = pool2.run(_plain_target_case, name)
    for row in rows:
        assert row["problems"] == [], row
    # The same outcome on every rank.
    assert rows[0]["error"] == rows[1]["error"], rows
    if rows[0]["plain_error"] is not None:
        # One device refuses: so does the DTensor call (nothing written, checked above).
        assert rows[0]["error"] is not None, rows
    elif name.endswith("implicit") or name in ("renorm_x11", "aminmax_0dim"):
        # A plain tensor taken as replicated: the single-device values, no error.
        assert rows[0]["error"] is None, rows
    if name == "run_gathered_ambiguous":
        assert rows[0]["error"].startswith("MixedTensorError"), rows


# ---------------------------------------------------------------- item 19: double backward


def _double_backward_case(kind: str, placement: str) -> dict[str, Any]:
    """First and second derivatives through a fallback op (reflect/replicate pad), compared
    with the single device: ``g = grad(f(x), x, create_graph=True)``, then
    ``grad((g * g).sum(), x)`` (and ``.backward()`` into ``x.grad`` for ``"backward"``)."""
    import torch.nn.functional as F

    import dtensor_patches

    mesh = _mesh()
    g = torch.Generator().manual_seed(19)
    x = torch.randn(4, 3, 5, generator=g)
    w = torch.randn(4, 3, 7, generator=g)
    mode = "replicate" if kind == "replicate" else "reflect"

    def f(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        padded = F.pad(t, (1, 1), mode=mode)
        if kind == "linear":
            return (padded * weights).sum()
        return (padded**2 * weights).sum()

    xp = x.clone().requires_grad_()
    (g1,) = torch.autograd.grad(f(xp, w), xp, create_graph=True)
    (g2,) = torch.autograd.grad((g1 * g1).sum(), xp, allow_unused=True)
    g2 = torch.zeros_like(x) if g2 is None else g2
    with dtensor_patches.patched():
        xd = _place(x.clone(), mesh, placement).requires_grad_()
        wd = _place(w.clone(), mesh, placement)
        try:
            (g1d,) = torch.autograd.grad(f(xd, wd), xd, create_graph=True)
            if kind == "backward":
                (g1d * g1d).sum().backward()
                g2d = xd.grad
            else:
                (g2d,) = torch.autograd.grad((g1d * g1d).sum(), xd, allow_unused=True)
        except RuntimeError as exc:
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "problems": []}
    problems = _problems([(g1d, g1.detach(), "first"), (g2d, g2, "second")])
    if g2d is not None and type(g2d) is torch.Tensor:
        problems.append("the second derivative of a DTensor is a plain tensor")
    return {"error": None, "problems": problems}


@pytest.mark.parametrize(
    ("kind", "placement"),
    [
        ("square", "S0"),
        ("square", "S2"),
        ("square", "R"),
        ("linear", "S0"),
        ("replicate", "S1"),
        ("backward", "S0"),
    ],
)
def test_double_backward_through_fallback(pool2: RankPool, kind: str, placement: str) -> None:
    rows = pool2.run(_double_backward_case, kind, placement)
    for row in rows:
        assert row == {"error": None, "problems": []}, row


def _double_backward_under_eager_gc(kind: str, placement: str) -> dict[str, Any]:
    """The same with the garbage collector running at every allocation: torch 2.9 cleared the
    slots of a saved DTensor (``'DTensor' object has no attribute '_local_tensor'``) when a
    refused call's stored error kept the caller frames in a reference cycle (issue 20)."""
    import gc

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        return _double_backward_case(kind, placement)
    finally:
        gc.set_threshold(*thresholds)


@pytest.mark.parametrize(("kind", "placement"), [("square", "S0"), ("backward", "S0")])
def test_double_backward_through_fallback_under_eager_gc(
    pool2: RankPool, kind: str, placement: str
) -> None:
    for row in pool2.run(_double_backward_under_eager_gc, kind, placement):
        assert row == {"error": None, "problems": []}, row
