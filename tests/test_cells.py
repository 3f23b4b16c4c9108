"""Cells (issue 19): the key verify gives a wrong call and the key the routing rule builds from
a schema agree; a recorded call replays with the same values and layouts; and each op family's
recorded wrong cells give the single-device result after ``apply_all()`` on this release,
while stock torch still gets them wrong (what the tripwires rely on)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtensor_patches.cells import cell_key, layout_of, wrong_cells
from dtensor_patches.testing import RankPool


class _P:
    """A placement stand-in: layout_of reads only the public predicates and attributes."""

    def __init__(self, kind: str, dim: int = 0, reduce_op: str = "sum") -> None:
        self.kind, self.dim, self.reduce_op = kind, dim, reduce_op

    def is_shard(self) -> bool:
        return self.kind == "S"

    def is_replicate(self) -> bool:
        return self.kind == "R"

    def is_partial(self) -> bool:
        return self.kind == "P"


def test_layout_text_marks_uneven_and_negative_dims() -> None:
    assert layout_of([_P("S", 0)], (4, 3), (2,)) == "S0"
    assert layout_of([_P("S", 0)], (5, 3), (2,)) == "S0~"
    assert layout_of([_P("S", -1)], (4, 3), (2,)) == "S1~"
    assert layout_of([_P("S", 0)], (1, 3), (2,)) == "S0~"  # an empty shard
    assert layout_of([_P("R"), _P("S", 1)], (4, 6), (2, 2)) == "R/S1"
    assert layout_of([_P("P", reduce_op="max")], (4,), (2,)) == "P.max"
    assert cell_key("aten.add.Tensor", ["S0", "R"]) == "aten.add.Tensor(S0, R)"


def _verify_and_rule_keys() -> list[tuple[str, str]]:
    """Each call's key as verify names it and as the routing rule computes it at a miss."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from dtensor_patches import verify
    from dtensor_patches.patches.validated.wrong_cells import schema_cell
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    x = distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)])
    y = distribute_tensor(torch.ones(5, 2), mesh, [Replicate()])
    z = distribute_tensor(torch.ones(5, 2), mesh, [Replicate()]).redistribute(mesh, [Replicate()])
    p = torch.distributed.tensor.DTensor.from_local(torch.ones(5, 2), mesh, [Partial()])
    out = []
    seen: list[Any] = []
    from dtensor_patches._torch import tables

    propagator = tables.sharding_propagator()
    original = propagator.propagate_op_sharding_non_cached
    # The spy is an instance attribute; restoring means removing it again where the instance
    # had none (else the bound method left behind hides every later class-level change).
    had_own = "propagate_op_sharding_non_cached" in vars(propagator)

    def spy(schema: Any) -> Any:
        seen.append(schema_cell(schema))
        return original(schema)

    propagator.propagate_op_sharding_non_cached = spy
    try:
        tables.clear_sharding_caches()
        with verify(raise_on_mismatch=False) as report:
            for a, b in ((x, y), (y, z), (x, p)):
                report.mismatches.clear()
                torch.ops.aten.add.Tensor(a, b)
                torch.ops.aten.cat.default([a, b], 1)
    finally:
        if had_own:
            propagator.propagate_op_sharding_non_cached = original
        else:
            del propagator.propagate_op_sharding_non_cached
        tables.clear_sharding_caches()
    layouts = [layout_of(t.placements, t.shape, mesh.shape) for t in (x, y, z, p)]
    for a, b in ((0, 1), (1, 2), (0, 3)):
        out.append((cell_key("aten.add.Tensor", [layouts[a], layouts[b]]), ""))
        out.append((cell_key("aten.cat.default", [layouts[a], layouts[b]]), ""))
    return [(key, "seen" if key in seen else "missing") for key, _ in out]


def test_verify_and_the_routing_rule_build_the_same_key(pool2: RankPool) -> None:
    for rank_result in pool2.run(_verify_and_rule_keys):
        assert rank_result, "no call was propagated"
        missing = [key for key, state in rank_result if state != "seen"]
        assert not missing, missing


def _round_trip() -> list[str]:
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    from dtensor_patches.cell_record import capture, decode
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    full = torch.linspace(-2, 2, 15).reshape(5, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    partial = DTensor.from_local(full / 2, mesh, [Partial()], run_check=False)
    args = (sharded, [partial, 3], 2.5, None, torch.float64)
    full_args = (full, [full, 3], 2.5, None, torch.float64)
    record = capture("aten.add.Tensor", args, {"alpha": 2}, full_args, {"alpha": 2})
    assert record is not None
    problems = []
    rebuilt = [decode(a, mesh) for a in record["args"]]
    if rebuilt[0].placements != sharded.placements or not torch.equal(
        rebuilt[0].full_tensor(), full
    ):
        problems.append("sharded input")
    if rebuilt[1][0].placements != partial.placements or not torch.allclose(
        rebuilt[1][0].full_tensor(), full
    ):
        problems.append("partial input")
    if rebuilt[1][1] != 3 or rebuilt[2] != 2.5 or rebuilt[3] is not None:
        problems.append("numbers")
    if rebuilt[4] is not torch.float64 or decode(record["kwargs"]["alpha"], mesh) != 2:
        problems.append("dtype or keyword")
    return problems


def test_a_recorded_call_decodes_to_the_same_values_and_layouts(pool2: RankPool) -> None:
    assert pool2.run(_round_trip) == [[], []]


def _families(mesh_shape: tuple[int, ...] = (2,)) -> dict[str, list[Any]]:
    """The recorded cells of this release by family, those recorded on ``mesh_shape``."""
    out: dict[str, list[Any]] = {}
    for cell in wrong_cells():
        if cell.call is not None and cell.call["mesh"] == list(mesh_shape):
            out.setdefault(cell.family, []).append(cell)
    return out


FAMILIES = sorted(_families())
FAMILIES_2X2 = sorted(_families((2, 2)))
# Families with routed 2x2 cells: those that tripwires would replay on stock torch. A family's
# other 2x2 cells are not replayed on stock: some (index_copy_ on 2.13) hang there after other
# replays in the same process, and nothing but the routed ones relies on stock being wrong.
FAMILIES_2X2_ROUTED = sorted(
    f for f, cells in _families((2, 2)).items() if any(c.routed for c in cells)
)


def _sample(cells: list[Any], count: int = 4) -> list[Any]:
    """Up to ``count`` cells of as many different ops, spread over the family's ops in key
    order (a family's first cells in key order are often one op's placements)."""
    first: dict[str, Any] = {}
    for cell in cells:
        first.setdefault(cell.op, cell)
    ops = list(first.values())
    if len(ops) <= count:
        return ops
    return [ops[i * len(ops) // count] for i in range(count)]


def _replay_sample(
    family: str, patched: bool, mesh_shape: tuple[int, ...] = (2,), every_routed: bool = False
) -> list[tuple[str, str | None]]:
    import dtensor_patches
    from dtensor_patches.cell_replay import replay
    from dtensor_patches.testing import grid_mesh

    recorded = _families(mesh_shape)[family]
    routed = [cell for cell in recorded if cell.routed]
    cells = routed if every_routed and routed else _sample(recorded)
    mesh = grid_mesh(mesh_shape)
    results = []
    dtensor_patches.revert_all()  # stock torch (this pool's tests apply in blocks only)
    if patched:
        dtensor_patches.apply_all()
    else:
        # What the validator measured stock torch with (tools.validate.runner.STOCK_KEEPS).
        dtensor_patches.apply_all(only=("empty_shard_padding",))
    try:
        for cell in cells:
            results.append((cell.key, replay(cell.call, mesh)))  # type: ignore[arg-type]
    finally:
        dtensor_patches.revert_all()
    return results


def _assert_right(results: list[list[tuple[str, str | None]]]) -> None:
    for rank_result in results:
        # Right, or the library's clear error where no correct result exists (an ``out=`` or
        # in-place write that would change a DTensor's shape).
        wrong = [
            (key, problem)
            for key, problem in rank_result
            if problem is not None and not problem.startswith("raises PatchError")
        ]
        assert not wrong, wrong


def _assert_still_wrong(results: list[list[tuple[str, str | None]]]) -> None:
    for rank_result in results:
        right = [key for key, problem in rank_result if problem is None]
        assert not right, f"torch now gets these right: regenerate the table: {right}"


@pytest.mark.skipif(not FAMILIES, reason="no wrong cell recorded for this torch release")
@pytest.mark.parametrize("family", FAMILIES)
def test_formerly_wrong_cells_give_the_single_device_result(pool2: RankPool, family: str) -> None:
    _assert_right(pool2.run(_replay_sample, family, True))


@pytest.mark.skipif(not FAMILIES, reason="no wrong cell recorded for this torch release")
@pytest.mark.parametrize("family", FAMILIES)
def test_stock_torch_still_gets_the_recorded_cells_wrong(pool2: RankPool, family: str) -> None:
    _assert_still_wrong(pool2.run(_replay_sample, family, False))


# The cells the validator found on a 2x2 mesh (FSDP2 over TP layouts: S0/S1, S0/P.sum, ...),
# replayed on a 2x2 mesh of 4 ranks. The tripwires (2 ranks) cannot form that mesh: on stock
# torch every routed 2x2 cell is replayed here instead, so a fixed one fails CI as stale.
@pytest.mark.skipif(not FAMILIES_2X2, reason="no 2x2-mesh cell recorded for this torch release")
@pytest.mark.parametrize("family", FAMILIES_2X2)
def test_formerly_wrong_2x2_mesh_cells_give_the_single_device_result(
    pool4: RankPool, family: str
) -> None:
    _assert_right(pool4.run(_replay_sample, family, True, (2, 2)))


@pytest.mark.skipif(not FAMILIES_2X2_ROUTED, reason="no routed 2x2-mesh cell for this release")
@pytest.mark.parametrize("family", FAMILIES_2X2_ROUTED)
def test_stock_torch_still_gets_the_routed_2x2_mesh_cells_wrong(
    pool4: RankPool, family: str
) -> None:
    _assert_still_wrong(pool4.run(_replay_sample, family, False, (2, 2), True))
