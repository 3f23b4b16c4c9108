"""``torch.linalg.matrix_rank(A, ..., out=o)`` with a DTensor ``o`` (``matrix_rank_out``):
the ranks written into ``o`` as on plain tensors, for every overload a user writes and every
placement of ``A`` and ``o``; an ``o`` of the wrong shape raises and stays as it was; a plain
``out=`` and the wrapper's removal leave torch as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool, raised_on_any_rank

# name -> the call, given A and o (A: 4 matrices of 5x3, of ranks 3, 3, 2 and 1)
_CALLS: dict[str, Callable[[Any, Any], Any]] = {
    "default": lambda a, o: torch.linalg.matrix_rank(a, out=o),
    "hermitian": lambda a, o: torch.linalg.matrix_rank(a @ a.mT, hermitian=True, out=o),
    "atol_float": lambda a, o: torch.linalg.matrix_rank(a, atol=0.5, out=o),
    "atol_rtol_float": lambda a, o: torch.linalg.matrix_rank(a, atol=0.1, rtol=0.05, out=o),
    "tol_positional": lambda a, o: torch.linalg.matrix_rank(a, 0.5, out=o),
}
_LAYOUTS = [("S0", "S0"), ("S1", "R"), ("R", "S0"), ("S2", "R"), ("R", "R")]


def _matrices() -> torch.Tensor:
    torch.manual_seed(5)
    a = torch.randn(4, 5, 3)
    a[2, :, 2] = a[2, :, 0] + a[2, :, 1]  # rank 2
    a[3] = torch.outer(torch.randn(5), torch.randn(3))  # rank 1
    return a


def _placement(text: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if text == "R" else Shard(int(text[1:]))


def _ranks_written(name: str, a_layout: str, o_layout: str) -> tuple[str | None, list, list]:
    from torch.distributed.tensor import distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        mesh = world_mesh()
        full = _matrices()
        a = distribute_tensor(full.clone(), mesh, [_placement(a_layout)])
        o = distribute_tensor(torch.full((4,), -1), mesh, [_placement(o_layout)])
        returned, raised = raised_on_any_rank(lambda: _CALLS[name](a, o))
        if raised is not None:
            return raised, [], []
        want = _CALLS[name](full, torch.full((4,), -1))
        assert returned is o
        assert tuple(o.placements) == (_placement(o_layout),)
        return None, o.full_tensor().tolist(), want.tolist()
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("layouts", _LAYOUTS, ids=["/".join(p) for p in _LAYOUTS])
@pytest.mark.parametrize("name", list(_CALLS))
def test_ranks_written_into_a_dtensor_out(
    pool2: RankPool, name: str, layouts: tuple[str, str]
) -> None:
    for error, got, want in pool2.run(_ranks_written, name, *layouts):
        assert error is None, error
        assert got == want, (got, want)
        assert sorted(set(want)) != [-1]  # the call wrote something: the check can fail


def _empty_matrices(a_layout: str) -> tuple[str | None, list, list]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        mesh = world_mesh()
        full = torch.randn(4, 0, 3)
        a = distribute_tensor(full, mesh, [_placement(a_layout)])
        o = distribute_tensor(torch.full((4,), -1), mesh, [Replicate()])
        _, raised = raised_on_any_rank(lambda: torch.linalg.matrix_rank(a, out=o))
        return raised, o.full_tensor().tolist(), torch.linalg.matrix_rank(full).tolist()
    finally:
        dtensor_patches.revert_all()


@pytest.mark.parametrize("a_layout", ["S0", "S2", "R"])
def test_matrices_without_elements_have_rank_zero(pool2: RankPool, a_layout: str) -> None:
    """torch answers an empty batch of matrices with plain zeros on 2.13: written all the
    same."""
    for raised, got, want in pool2.run(_empty_matrices, a_layout):
        assert raised is None, raised
        assert got == want == [0, 0, 0, 0]


def _wrong_shape_and_plain() -> tuple[str | None, list, bool, bool]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    original = torch.linalg.matrix_rank
    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        mesh = world_mesh()
        a = distribute_tensor(_matrices(), mesh, [Replicate()])
        o = distribute_tensor(torch.full((3,), -1), mesh, [Replicate()])
        _, raised = raised_on_any_rank(lambda: torch.linalg.matrix_rank(a, out=o))
        untouched = o.full_tensor().tolist()
        # A plain out= goes to torch's own kernel, unchanged.
        plain = torch.full((4,), -1)
        torch.linalg.matrix_rank(_matrices(), out=plain)
        plain_ok = plain.tolist() == torch.linalg.matrix_rank(_matrices()).tolist()
    finally:
        dtensor_patches.revert_all()
    return raised, untouched, plain_ok, torch.linalg.matrix_rank is original


def test_wrong_shape_raises_and_writes_nothing_plain_out_unchanged(pool2: RankPool) -> None:
    for raised, untouched, plain_ok, restored in pool2.run(_wrong_shape_and_plain):
        assert raised is not None and "cannot be resized" in raised, raised
        assert untouched == [-1, -1, -1]
        assert plain_ok
        assert restored, "revert_all() restores torch.linalg.matrix_rank"
