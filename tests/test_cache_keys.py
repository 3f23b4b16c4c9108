"""A cached sharding decision reused for another integer argument (``size_arguments_keyed``):
``topk`` with another ``k``, ``kthvalue`` with another ``k``, ``histc`` with other ``bins``,
called the way user code calls them, against the same calls on plain tensors, on a 2-rank gloo
mesh; and the patch's reach (every op the rule finds on this release is one it lists) and its
exact revert."""

from __future__ import annotations

from typing import Any

import torch

from dtensor_patches.testing import RankPool


def _calls_after_other_values() -> list[tuple[str, list[int], list[int], bool]]:
    """(what, DTensor shape, expected shape, values equal) for each call, each op called first
    with another value of its integer argument on the same layouts."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    torch.manual_seed(0)
    logits = torch.randn(4, 10)  # [batch, vocab], the batch sharded: top-k sampling per row
    rows = distribute_tensor(logits, mesh, [Shard(0)])
    out = []
    for k in (3, 5, 1):
        values, indices = torch.topk(rows, k, dim=-1)
        expected = torch.topk(logits, k, dim=-1)
        out.append(
            (
                f"topk k={k}",
                list(values.shape),
                [4, k],
                torch.equal(values.full_tensor(), expected.values)
                and torch.equal(indices.full_tensor(), expected.indices),
            )
        )
        smallest = rows.topk(k, dim=1, largest=False).values
        out.append(
            (
                f"topk k={k} largest=False",
                list(smallest.shape),
                [4, k],
                torch.equal(smallest.full_tensor(), logits.topk(k, dim=1, largest=False).values),
            )
        )
    for k in (2, 6):
        try:
            value = torch.kthvalue(rows, k, dim=1).values
        except (NotImplementedError, RuntimeError):
            out.append((f"kthvalue k={k}", [], [4], False))  # stock 2.9-2.12: no strategy
            continue
        out.append(
            (
                f"kthvalue k={k}",
                list(value.shape),
                [4],
                torch.equal(value.full_tensor(), torch.kthvalue(logits, k, dim=1).values),
            )
        )
    points = torch.tensor([0.5, 1.5, 2.0, 7.0, 9.5])
    replicated = distribute_tensor(points, mesh, [Replicate()])
    for bins in (5, 8, 3):
        counts = torch.histc(replicated, bins=bins, min=0, max=10)
        out.append(
            (
                f"histc bins={bins}",
                list(counts.shape),
                [bins],
                torch.equal(counts.full_tensor(), torch.histc(points, bins=bins, min=0, max=10)),
            )
        )
    return out


def _schema_infos() -> dict[str, dict[Any, Any]]:
    """A copy of torch's schema-info tables, entry objects as they are."""
    from dtensor_patches._torch import tables

    return {name: dict(infos) for name, infos in tables.schema_infos().items()}


def _restored(before: dict[str, dict[Any, Any]]) -> bool:
    """Whether the tables hold exactly ``before``'s entries again: the same objects, none
    added."""
    after = _schema_infos()
    return after == before and all(
        after[name][op] is info for name, infos in before.items() for op, info in infos.items()
    )


def _patched_and_stock() -> dict[str, Any]:
    import dtensor_patches
    from dtensor_patches.patches.reductions import size_arguments_keyed

    dtensor_patches.revert_all()
    before = _schema_infos()
    stock = _calls_after_other_values()
    try:
        dtensor_patches.apply_all(only=["size_arguments_keyed"])
        patched = _calls_after_other_values()
        found = size_arguments_keyed.keyed_too_late()
    finally:
        dtensor_patches.revert_all()
    return {"stock": stock, "patched": patched, "found": found, "restored": _restored(before)}


def test_integer_arguments_key_the_decision(pool2: RankPool) -> None:
    for result in pool2.run(_patched_and_stock):
        for what, shape, expected, equal in result["patched"]:
            assert shape == expected and equal, (what, shape, expected)
        # Stock torch reuses the first call's output spec (what the tripwire watches).
        wrong = [what for what, shape, expected, _ in result["stock"] if shape != expected]
        assert any(w.startswith("topk") for w in wrong) and any(
            w.startswith("histc") for w in wrong
        ), result["stock"]
        # Once applied, no registered schema leaves an integer argument out of the key.
        assert result["found"] == [], result["found"]
        assert result["restored"], "revert did not put torch's RuntimeSchemaInfo back"


def test_every_op_the_rule_finds_is_listed() -> None:
    """A release whose tables leave another op's integer argument out of the key fails here
    until the op is in the patch's list (and checked)."""
    import dtensor_patches
    from dtensor_patches.patches.reductions import size_arguments_keyed

    dtensor_patches.revert_all()
    unlisted = [
        op
        for _, op, _ in size_arguments_keyed.keyed_too_late()
        if op not in size_arguments_keyed.OPS
    ]
    assert unlisted == []


def _out_calls() -> list[tuple[str, str, bool]]:
    """(what, the out's base placement after the call, base equal to the plain result) for
    matrix products written into views of preallocated DTensors, each after a call of the
    same op into an out of another placement (``out_tensors_keyed``)."""
    import warnings

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    torch.manual_seed(1)
    hidden, width = torch.randn(4, 6), torch.randn(6, 6)
    a = distribute_tensor(hidden, mesh, [Shard(1)])
    b = distribute_tensor(width, mesh, [Shard(1)])
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "an output was resized" on the bug
        for placement in (Shard(1), Replicate(), Shard(0)):
            # A buffer of two results, each written through a select view.
            buffer = distribute_tensor(torch.zeros(2, 4, 6), mesh, [placement])
            torch.mm(a, b, out=buffer[1])
            expected = torch.zeros(2, 4, 6)
            expected[1] = hidden @ width
            out.append(
                (
                    f"mm into buffer[1] of {placement}",
                    str(buffer.placements[0]),
                    torch.allclose(buffer.full_tensor(), expected, atol=1e-5),
                )
            )
            batched = distribute_tensor(torch.zeros(1, 4, 6), mesh, [placement])
            torch.bmm(a.unsqueeze(0), b.unsqueeze(0), out=batched.view(1, 4, 6))
            out.append(
                (
                    f"bmm into a view of {placement}",
                    str(batched.placements[0]),
                    torch.allclose(batched.full_tensor(), (hidden @ width)[None], atol=1e-5),
                )
            )
    return out


def _out_patched_and_stock() -> dict[str, Any]:
    import dtensor_patches
    from dtensor_patches.patches.writes import out_tensors_keyed

    dtensor_patches.revert_all()
    before = _schema_infos()
    stock = _out_calls()
    try:
        # Every patch: a select of the sharded dim of a ``Shard(0)`` buffer is a view DTensor
        # had to redistribute, whose write ``view_writes`` carries to the buffer.
        dtensor_patches.apply_all()
        patched = _out_calls()
        dtensor_patches.revert_all()
        # The patch alone keys every out= op of torch's own tables (ops other patches
        # register are theirs to key).
        dtensor_patches.apply_all(only=["out_tensors_keyed"])
        found = out_tensors_keyed.out_tensors_unkeyed()
    finally:
        dtensor_patches.revert_all()
    return {"stock": stock, "patched": patched, "found": found, "restored": _restored(before)}


def test_out_tensors_key_the_decision(pool2: RankPool) -> None:
    import pytest
    from packaging.version import Version

    if Version(torch.__version__.split("+")[0]) < Version("2.13"):
        pytest.skip("mm.out/bmm.out have no sharding strategy before 2.13 (the fallback's)")
    for result in pool2.run(_out_patched_and_stock):
        for what, placement, equal in result["patched"]:
            assert equal, (what, placement)
        # Stock torch reuses the first call's decision for an out of another placement.
        assert not all(equal for _, _, equal in result["stock"]), result["stock"]
        assert result["found"] == [], result["found"][:5]
        assert result["restored"], "revert did not put torch's schema infos back exactly"


def test_every_out_op_the_rule_finds_is_listed() -> None:
    import dtensor_patches
    from dtensor_patches.patches.writes import out_tensors_keyed

    dtensor_patches.revert_all()
    unlisted = [
        op
        for _, op, _ in out_tensors_keyed.out_tensors_unkeyed()
        if op not in out_tensors_keyed.OPS
    ]
    assert unlisted == []


def _decomposed_out_calls(into_views: bool = True) -> list[tuple[str, bool]]:
    """(what, the base holds the plain result) for matrix-vector products written into a view
    of a preallocated DTensor, each after the same call into a replicated out: ``mv.out`` is
    propagated through its decomposition from 2.11 (no strategy of its own). Without
    ``into_views``, only the calls into replicated outs."""
    import warnings

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    torch.manual_seed(2)
    hidden, head = torch.randn(6, 8), torch.randn(8)
    a = distribute_tensor(hidden, mesh, [Shard(1)])
    w = distribute_tensor(head, mesh, [Replicate()])
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "an output was resized" on the bug
        for name, product in (("mv", torch.mv), ("matmul", torch.matmul)):
            product(a, w, out=distribute_tensor(torch.zeros(6), mesh, [Replicate()]))
            if not into_views:
                continue
            # Values of two heads kept side by side, the first written through a flat view.
            values = distribute_tensor(torch.zeros(2, 3), mesh, [Shard(1)])
            product(a, w, out=values.view(-1))
            out.append(
                (
                    f"{name} into a view of Shard(1)",
                    torch.allclose(values.full_tensor().reshape(-1), hidden @ head, atol=1e-5),
                )
            )
    return out


def _decomposed_patched_and_stock() -> dict[str, Any]:
    import dtensor_patches
    from dtensor_patches._torch import tables

    dtensor_patches.revert_all()
    # 2.11 refuses the flat view of a shard: there, only the calls torch can make.
    try:
        stock = _decomposed_out_calls(into_views=_flattens_a_shard())
    except NotImplementedError:
        stock = []  # before 2.11 torch has no way to propagate mv (the mv patch's)
    # Taken after the stock calls: torch's own inferred entries for them are in the table.
    before = _schema_infos()
    try:
        dtensor_patches.apply_all()
        patched = _decomposed_out_calls()
        infos = tables.schema_infos()[tables.SCHEMA_INFO_TABLES[0]]
        unkeyed = [
            str(op)
            for op, outs in tables.decomposed_out_ops()
            if not set(outs) <= set(getattr(infos.get(op), "static_kwargkey", None) or ())
        ]
    finally:
        dtensor_patches.revert_all()
    return {"stock": stock, "patched": patched, "unkeyed": unkeyed, "restored": _restored(before)}


def _flattens_a_shard() -> bool:
    """Whether stock torch flattens a ``Shard(1)`` ``[2, 3]`` (2.11 refuses the view)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from dtensor_patches.testing import world_mesh

    try:
        distribute_tensor(torch.zeros(2, 3), world_mesh(), [Shard(1)]).view(-1)
    except RuntimeError:
        return False
    return True


def test_decomposed_out_tensors_key_the_decision(pool2: RankPool) -> None:
    from packaging.version import Version

    release = Version(torch.__version__.split("+")[0])
    for result in pool2.run(_decomposed_patched_and_stock):
        for what, equal in result["patched"]:
            assert equal, what
        assert result["restored"], "revert did not put torch's schema infos back exactly"
        if release >= Version("2.12"):
            # Every out= op propagated through its decomposition is keyed by its outs.
            assert result["unkeyed"] == [], result["unkeyed"][:5]
            # Stock torch reuses the replicated call's decision for the view.
            assert not all(equal for _, equal in result["stock"]), result["stock"]
