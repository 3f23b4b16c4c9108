"""``out=`` into a DTensor of another placement than torch's decision (``out_keeps_placement``):
the out keeps its placements and holds the single-device result, a view's base gets the write,
the bytes moved are one redistribute of the result, a failing call leaves the out as it was,
and an out already placed as torch decides keeps torch's cached path (no communication)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool, raised_on_any_rank


def _placement(text: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if text == "R" else Shard(int(text[1:]))


def _inputs() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(4, 6)


# name -> (the call on x and the out, how the out is taken from its buffer, buffer shape)
_CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "amax(x, 1)": lambda x, o: torch.amax(x, 1, out=o),
    "amin(x, 0)": lambda x, o: torch.amin(x, 0, out=o),
    "sum(x, 1)": lambda x, o: torch.sum(x, 1, out=o),
    "mean(x, 0)": lambda x, o: torch.mean(x, 0, out=o),
    "var(x, 1)": lambda x, o: torch.var(x, 1, out=o),
    "x * 3": lambda x, o: torch.mul(x, 3, out=o),
}
_OUT_SHAPES = {
    "amax(x, 1)": (4,),
    "amin(x, 0)": (6,),
    "sum(x, 1)": (4,),
    "mean(x, 0)": (6,),
    "var(x, 1)": (4,),
    "x * 3": (4, 6),
}
# How the out is made from a [2, *shape] buffer: the buffer's row 1, or the whole of a
# buffer of the out's shape.
_VIEWS = ("whole", "row")


def _written(name: str, x_layout: str, buf_layout: str, view: str) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        mesh = world_mesh()
        full = _inputs()
        shape = _OUT_SHAPES[name]
        buf_shape = shape if view == "whole" else (2, *shape)
        x = distribute_tensor(full.clone(), mesh, [_placement(x_layout)])
        buf = distribute_tensor(torch.full(buf_shape, -7.0), mesh, [_placement(buf_layout)])
        plain_buf = torch.full(buf_shape, -7.0)
        out = buf if view == "whole" else buf[1]
        plain_out = plain_buf if view == "whole" else plain_buf[1]
        placements = tuple(out.placements)
        returned, raised = raised_on_any_rank(lambda: _CALLS[name](x, out))
        _CALLS[name](full, plain_out)
        return {
            "raised": raised,
            "returned_out": returned is out,
            "out_placements_kept": tuple(out.placements) == placements,
            "buf_placements_kept": tuple(buf.placements) == (_placement(buf_layout),),
            "buf": buf.full_tensor(),
            "want": plain_buf,
        }
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("view", _VIEWS)
@pytest.mark.parametrize(
    ("name", "x_layout", "buf_layout"),
    [
        ("amax(x, 1)", "S1", "R"),  # torch decides Partial(max)
        ("amax(x, 1)", "S0", "R"),  # Shard(0)
        ("amin(x, 0)", "S0", "R"),
        ("sum(x, 1)", "S1", "R"),  # Partial(sum)
        ("sum(x, 1)", "S1", "S0"),
        ("mean(x, 0)", "S0", "S0"),  # torch: Partial(avg)
        ("var(x, 1)", "S0", "R"),
        ("x * 3", "S0", "R"),
        ("x * 3", "R", "S1"),
    ],
)
def test_the_out_keeps_its_placements_and_a_views_base_gets_the_write(
    pool2: RankPool, name: str, x_layout: str, buf_layout: str, view: str
) -> None:
    if view == "row" and buf_layout == "S0":
        buf_layout = "S1"  # the row of a [2, n] buffer sharded along n
    got = pool2.run(_written, name, x_layout, buf_layout, view)
    for rank in got:
        assert rank["raised"] is None, rank["raised"]
        assert rank["returned_out"]
        assert rank["out_placements_kept"] and rank["buf_placements_kept"]
        torch.testing.assert_close(rank["buf"], rank["want"])


def _moved(name: str, x_layout: str, out_layout: str) -> dict[str, int]:
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        mesh = world_mesh()
        x = distribute_tensor(_inputs(), mesh, [_placement(x_layout)])
        out = distribute_tensor(torch.zeros(_OUT_SHAPES[name]), mesh, [_placement(out_layout)])
        _CALLS[name](x, out)  # the first call of a schema: torch's decision is made here
        with CommDebugMode() as comm:
            _CALLS[name](x, out)
        return {str(op): n for op, n in comm.get_comm_counts().items()}
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize(
    ("name", "x_layout", "out_layout", "expected"),
    [
        # Partial(max) -> Replicate: the one all-reduce of the [4] result any fix needs.
        ("amax(x, 1)", "S1", "R", {"all_reduce": 1}),
        # Shard(0) -> Replicate: one all-gather of the result.
        ("amax(x, 1)", "S0", "R", {"all_gather_into_tensor": 1}),
        # Placed as torch decides: torch's cached path, nothing moved.
        ("amax(x, 1)", "S0", "S0", {}),
        ("x * 3", "S0", "S0", {}),
    ],
)
def test_the_bytes_moved_are_one_redistribute_of_the_result(
    pool2: RankPool, name: str, x_layout: str, out_layout: str, expected: dict[str, int]
) -> None:
    from dtensor_patches.patches.writes.out_keeps_placement import PATCH

    if not PATCH.applies_to():
        pytest.skip("torch refuses or follows the out itself (2.14+): nothing of this patch's")
    for counts in pool2.run(_moved, name, x_layout, out_layout):
        assert {op.rsplit(".", 1)[-1]: n for op, n in counts.items()} == expected


def _failed_call_leaves_the_out() -> tuple[str | None, bool, bool]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        mesh = world_mesh()
        x = distribute_tensor(_inputs(), mesh, [Shard(1)])
        out = distribute_tensor(torch.full((4,), -3, dtype=torch.int64), mesh, [Replicate()])
        before = out.to_local().clone()
        # A float maximum into an integer out: torch refuses the dtype (as on plain tensors).
        _, raised = raised_on_any_rank(lambda: torch.amax(x, 1, out=out))
        return raised, torch.equal(out.to_local(), before), tuple(out.placements) == (Replicate(),)
    finally:
        dtensor_patches.revert_all()


def test_a_failing_call_leaves_the_out_as_it_was(pool2: RankPool) -> None:
    plain = torch.full((4,), -3, dtype=torch.int64)
    with pytest.raises(RuntimeError):
        torch.amax(_inputs(), 1, out=plain)  # the single device refuses it too
    for raised, unchanged, placed in pool2.run(_failed_call_leaves_the_out):
        assert raised is not None
        assert unchanged and placed


def test_the_keyed_ops_cover_what_the_running_release_leaves_unkeyed() -> None:
    from dtensor_patches._torch.versions import torch_release
    from dtensor_patches.patches.writes import out_keeps_placement, out_tensors_keyed

    if torch_release() in out_tensors_keyed.PATCH.gate:
        pytest.skip("out_tensors_keyed keys the out tensors on this release")
    unkeyed = {op for _, op, _ in out_tensors_keyed.out_tensors_unkeyed()}
    assert unkeyed <= set(out_keeps_placement.OPS), sorted(unkeyed - set(out_keeps_placement.OPS))
