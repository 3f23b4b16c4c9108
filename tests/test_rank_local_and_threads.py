"""Issue 23, items 6, 11 and 13: calls made on one rank only, patches toggled while other
threads run DTensor ops, and the fallback mode a second ``apply_all()`` keeps.

Every case runs on a real 2-rank gloo mesh (the session pool ``pool2``) and compares with the
same computation on plain single-device tensors. A rank-local call runs on rank 0 only; each
such case then checks that an ``all_reduce`` of ones gives the world size on every rank, so a
rank-local call that paired with the other rank's collective fails the test instead of
hanging it (the pool's timeout fails it too).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtensor_patches.testing import RankPool


def _mesh() -> Any:
    from dtensor_patches.testing import world_mesh

    return world_mesh()


def _ones_all_reduce() -> float:
    """An all-reduce (sum) of ones on every rank: the world size, unless an earlier
    rank-local call left a collective unpaired."""
    t = torch.ones(())
    dist.all_reduce(t)
    return float(t)


# --- item 13: a second apply_all() keeps the fallback mode --------------------------------


def _cdist_outcome(x: torch.Tensor) -> dict[str, Any]:
    """``torch.cdist`` of a ``Shard(1)`` DTensor (no strategy: the fallback's case)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    xd = distribute_tensor(x, _mesh(), [Shard(1)])
    try:
        got = torch.cdist(xd, xd).full_tensor()
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        return {"error": type(exc).__name__}
    return {"error": None, "values": torch.allclose(got, torch.cdist(x, x), atol=1e-5)}


def _second_apply_all_case() -> dict[str, Any]:
    import dtensor_patches
    from dtensor_patches.dispatch import fallback

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    out: dict[str, Any] = {}
    dtensor_patches.revert_all()
    try:
        dtensor_patches.apply_all(fallback="error")
        dtensor_patches.apply_all()  # what ValueWorker.__init__ does
        out["error_kept"] = (fallback.mode(), _cdist_outcome(x))
        with dtensor_patches.patched():
            out["error_in_patched"] = fallback.mode()
        out["error_after_patched"] = fallback.mode()
        dtensor_patches.apply_all(fallback="warn")  # an explicit argument changes it
        out["warn_explicit"] = (fallback.mode(), _cdist_outcome(x))
        dtensor_patches.apply_all(fallback="off")
        dtensor_patches.apply_all()
        out["off_kept"] = (fallback.mode(), _cdist_outcome(x))
        dtensor_patches.revert_all()  # forgets the choice
        dtensor_patches.apply_all()
        out["warn_after_revert"] = (fallback.mode(), _cdist_outcome(x))
    finally:
        dtensor_patches.revert_all()
    return out


def test_second_apply_all_keeps_the_fallback_mode(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_second_apply_all_case)):
        assert r["error_kept"] == ("error", {"error": "PatchError"}), (rank, r)
        assert r["error_in_patched"] == "error", (rank, r)
        assert r["error_after_patched"] == "error", (rank, r)
        assert r["warn_explicit"] == ("warn", {"error": None, "values": True}), (rank, r)
        assert r["off_kept"] == ("off", {"error": "NotImplementedError"}), (rank, r)
        assert r["warn_after_revert"] == ("warn", {"error": None, "values": True}), (rank, r)


# --- item 11: patches changed while another thread runs DTensor ops -------------------------


def _local_ops_while(toggle: Any, seconds: float) -> dict[str, Any]:
    """Run DTensor ops that communicate on no path (slices and arithmetic of the local shards
    of a ``Shard(0)`` tensor, a fresh shape each time so that every call is a cache miss) in a
    worker thread, compared with the same ops on the plain shard, while this thread calls
    ``toggle()`` for ``seconds``. Thread switches are made frequent (``sys.setswitchinterval``)
    so that a miss meets a change of the table often."""
    import sys
    import threading
    import time
    import traceback

    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh()
    rank = dist.get_rank()
    errors: list[str] = []
    wrong: list[int] = []
    done = threading.Event()
    counts = {"ops": 0, "toggles": 0}

    def work() -> None:
        n = 0
        try:
            while not done.is_set():
                n += 1
                cols = 2 + n % 40
                lo = torch.arange(3.0 * cols).reshape(3, cols) + rank
                x = DTensor.from_local(lo, mesh, [Shard(0)], run_check=False)
                y = (x[:, 1:] * 2).sum(1)
                z = x.t()[1:]
                if not (
                    torch.equal(y.to_local(), (lo[:, 1:] * 2).sum(1))
                    and torch.equal(z.to_local(), lo.t()[1:])
                ):
                    wrong.append(n)
                counts["ops"] = n
        except Exception:  # noqa: BLE001 - reported to the test
            errors.append(traceback.format_exc(limit=4))

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    worker = threading.Thread(target=work)
    worker.start()
    start = time.monotonic()
    try:
        while time.monotonic() - start < seconds and not errors:
            toggle()
            counts["toggles"] += 1
    finally:
        done.set()
        worker.join()
        sys.setswitchinterval(before)
    return {"errors": errors[:1], "wrong": wrong[:3], **counts, "ones": _ones_all_reduce()}


class _Owner:
    name = "test owner"


def _rule_table_case(seconds: float) -> dict[str, Any]:
    """A miss rule for every op installed and removed again and again (the registration
    ``apply_all()`` and ``revert_all()`` make) while every patch is applied."""
    import dtensor_patches
    from dtensor_patches.dispatch import registration
    from dtensor_patches.dispatch.miss_rules import ANY_OP, MissRule

    owner = _Owner()

    def keeper(i: int) -> Any:
        def keep(schema: Any, native: Any) -> None:
            return None

        keep.__qualname__ = f"keep_{i}"  # one table key each
        return keep

    # Many rules: a table that changes size often, and long to iterate.
    rules = [MissRule(ANY_OP, keeper(i)) for i in range(24)]

    def toggle() -> None:
        registration.install(owner, rules)
        registration.remove(owner)

    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        return _local_ops_while(toggle, seconds)
    finally:
        registration.remove(owner)
        dtensor_patches.revert_all()


def test_miss_rules_changed_while_another_thread_misses(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_rule_table_case, 3.0)):
        assert not r["errors"], f"rank {rank}: {r['errors'][0]}"
        assert not r["wrong"], f"rank {rank}: wrong values at ops {r['wrong']}"
        assert r["ops"] > 0 and r["toggles"] > 0, (rank, r)
        assert r["ones"] == 2.0, (rank, r)


class _ChangesTheTableWhenRead:
    """A key of the miss-rule table whose type check (``isinstance(key, tuple)``, which reads
    ``__class__``) adds an entry to the table while ``armed``: what another thread's
    ``apply_all()`` does when it runs at that moment of an iteration over the table."""

    armed = False

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        from dtensor_patches import state

        if _ChangesTheTableWhenRead.armed:
            _ChangesTheTableWhenRead.armed = False
            state.MISS_RULES[("*", "added meanwhile")] = lambda schema, native: None
        return type(self)


def _table_changed_during_a_miss_case() -> dict[str, Any]:
    """A cache miss whose decision meets a change of the miss-rule table, at the one moment
    (the iteration) where that raised; the op's values against the plain shard."""
    from torch.distributed.tensor import DTensor, Shard

    import dtensor_patches
    from dtensor_patches import state

    mesh = _mesh()
    lo = torch.arange(21.0).reshape(3, 7) + dist.get_rank()
    key = _ChangesTheTableWhenRead()
    dtensor_patches.revert_all()
    dtensor_patches.apply_all()
    try:
        with state.LOCK:
            state.MISS_RULES[key] = lambda schema, native: None
        x = DTensor.from_local(lo, mesh, [Shard(0)], run_check=False)
        _ChangesTheTableWhenRead.armed = True
        try:
            got = (x[:, 2:] * 3).sum(1).to_local()  # a shape never seen: a miss
        except Exception as exc:  # noqa: BLE001 - the error is what the test checks
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            _ChangesTheTableWhenRead.armed = False
        return {"error": None, "values": torch.equal(got, (lo[:, 2:] * 3).sum(1))}
    finally:
        with state.LOCK:
            state.MISS_RULES.pop(key, None)
            state.MISS_RULES.pop(("*", "added meanwhile"), None)
        dtensor_patches.revert_all()


def test_miss_decided_while_the_rule_table_changes(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_table_changed_during_a_miss_case)):
        assert r == {"error": None, "values": True}, (rank, r)


def _apply_revert_case(seconds: float) -> dict[str, Any]:
    import dtensor_patches

    def toggle() -> None:
        dtensor_patches.apply_all()
        dtensor_patches.revert_all()

    dtensor_patches.revert_all()
    try:
        return _local_ops_while(toggle, seconds)
    finally:
        dtensor_patches.revert_all()


def test_apply_and_revert_while_another_thread_runs_ops(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_apply_revert_case, 2.0)):
        assert not r["errors"], f"rank {rank}: {r['errors'][0]}"
        assert not r["wrong"], f"rank {rank}: wrong values at ops {r['wrong']}"
        assert r["toggles"] > 0, (rank, r)
        assert r["ones"] == 2.0, (rank, r)


# --- item 6: a Partial scalar read on some ranks only -----------------------------------------
#
# ``.item()`` of a ``Partial`` DTensor needs every rank's share. The patched read runs on a side
# group with a fingerprint check (dtensor_patches.dispatch.scalar_reads), so a read on rank 0
# only raises RankLocalReadError and never pairs with another rank's collective. A rank-local
# read leaves the ranks disagreeing on their side groups, so those cases get two ranks of their
# own, with a short read timeout; a pool timeout fails a hang.

_READ_ENV = {"DTENSOR_PATCHES_RANK_CHECK_TIMEOUT": "4"}


def _partial_loss(scale: float = 1.0) -> Any:
    """``x.sum()`` of a ``Shard(0)`` ``[4, 3]`` arange: a ``Partial(sum)`` 0-dim DTensor whose
    single-device value is ``66 * scale`` (this rank's share: 15 or 51)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    x = distribute_tensor(torch.arange(12.0).reshape(4, 3) * scale, _mesh(), [Shard(0)])
    return x.sum()


def _rank_local_read_case(then_read_everywhere: bool) -> dict[str, Any]:
    import dtensor_patches
    from dtensor_patches.errors import RankLocalReadError

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with dtensor_patches.patched():
        loss = _partial_loss()
        other = _partial_loss(2.0)
        try:
            if rank == 0:
                out["logged"] = loss.item()  # the line under test: a read on rank 0 only
            if then_read_everywhere:
                out["other"] = other.item()
        except RankLocalReadError as exc:
            out["error"] = str(exc)
            out["site"] = exc.site
        out["ones"] = _ones_all_reduce()
    return out


def test_a_read_on_one_rank_only_raises_and_leaves_other_collectives_right() -> None:
    """``if rank == 0: print(loss.item())``: rank 0 gets a clear error naming its line (never
    a wrong number), and every rank's next all-reduce of ones still gives the world size."""
    with RankPool(2, env=_READ_ENV, timeout=120) as pool:
        results = pool.run(_rank_local_read_case, False)
    first, second = results
    assert "logged" not in first, first
    assert "did not all make this read" in first["error"], first
    assert first["site"].endswith("test_rank_local_and_threads.py:" + first["site"].split(":")[-1])
    assert "error" not in second, second
    assert [r["ones"] for r in results] == [2.0, 2.0]


def test_two_different_reads_that_meet_raise_on_every_rank() -> None:
    """A read on rank 0 only, then a read of another loss on every rank: rank 1's read meets
    rank 0's first one. Both raise (no rank gets a mix of the two values: 15 + 102, or 30 +
    51), and the next all-reduce is right."""
    with RankPool(2, env=_READ_ENV, timeout=120) as pool:
        results = pool.run(_rank_local_read_case, True)
    for rank, r in enumerate(results):
        assert "met in different reads" in r.get("error", ""), (rank, r)
        assert "logged" not in r and "other" not in r, (rank, r)
        assert r["ones"] == 2.0, (rank, r)


def _reads_on_every_rank() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    import dtensor_patches

    rank = dist.get_rank()
    full = torch.arange(12.0).reshape(4, 3) - 5.0
    got: dict[str, Any] = {}
    with dtensor_patches.patched():
        x = distribute_tensor(full, _mesh(), [Shard(0)])
        got["sum"] = x.sum().item()
        got["mean"] = float(x.mean())
        got["count"] = int((x > 0).sum())
        got["norm"] = torch.linalg.vector_norm(x).item()
        got["inf_norm"] = torch.linalg.vector_norm(x, float("inf")).item()
        got["any"] = bool((x > 5).any())
        got["one_element"] = x.sum(0)[1:2].sum().item()
        share = torch.tensor(float(rank + 3))
        got["max"] = DTensor.from_local(share, _mesh(), [Partial("max")], run_check=False).item()
        got["avg"] = DTensor.from_local(share, _mesh(), [Partial("avg")], run_check=False).item()
        # A 2-D mesh (1 x 2): Partial on both dims, the size-1 one needs no reduction.
        mesh2 = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
        y = distribute_tensor(full, mesh2, [Shard(1), Shard(0)])
        got["sum_2d"] = y.sum().item()
        for _ in range(3):  # repeated reads on the same line pair up, read after read
            got["again"] = x.sum().item()
        got["ones"] = _ones_all_reduce()
    return got


def test_reads_on_every_rank_give_the_single_device_number(pool2: RankPool) -> None:
    full = torch.arange(12.0).reshape(4, 3) - 5.0
    expected = {
        "sum": full.sum().item(),
        "mean": full.mean().item(),
        "count": int((full > 0).sum()),
        "norm": torch.linalg.vector_norm(full).item(),
        "inf_norm": torch.linalg.vector_norm(full, float("inf")).item(),
        "any": bool((full > 5).any()),
        "one_element": full.sum(0)[1:2].sum().item(),
        "max": 4.0,
        "avg": 3.5,
        "sum_2d": full.sum().item(),
        "again": full.sum().item(),
        "ones": 2.0,
    }
    for rank, got in enumerate(pool2.run(_reads_on_every_rank)):
        assert got.keys() == expected.keys()
        for key, want in expected.items():
            assert got[key] == pytest.approx(want, rel=1e-6), (rank, key, got[key], want)
            assert type(got[key]) is type(want), (rank, key, got[key])


def _rank_local_fallback_case(then_everywhere: bool) -> dict[str, Any]:
    """``torch.cdist`` of a ``Shard(1)`` tensor (no strategy: the fallback gathers it) on rank 0
    only, then (``then_everywhere``) another fallback call on every rank."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.errors import RankLocalCallError

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with dtensor_patches.patched():
        x = distribute_tensor(torch.arange(12.0).reshape(3, 4), _mesh(), [Shard(1)])
        y = distribute_tensor(torch.arange(8.0).reshape(2, 4), _mesh(), [Shard(1)])
        try:
            if rank == 0:
                out["local"] = torch.cdist(x, x).full_tensor().tolist()  # on rank 0 only
            if then_everywhere:
                out["everywhere"] = torch.cdist(y, y).full_tensor().tolist()
        except RankLocalCallError as exc:
            out["error"] = str(exc)
        out["ones"] = _ones_all_reduce()
    return out


def test_a_fallback_call_on_one_rank_only_raises_and_leaves_other_collectives_right() -> None:
    with RankPool(2, env=_READ_ENV, timeout=120) as pool:
        first, second = pool.run(_rank_local_fallback_case, False)
    assert "did not all make this call" in first.get("error", ""), first
    assert "aten._cdist_forward" in first["error"] and "local" not in first, first
    assert "error" not in second, second
    assert [first["ones"], second["ones"]] == [2.0, 2.0]


def test_two_different_fallback_calls_that_meet_raise_on_every_rank() -> None:
    with RankPool(2, env=_READ_ENV, timeout=120) as pool:
        results = pool.run(_rank_local_fallback_case, True)
    for rank, r in enumerate(results):
        assert "met in different calls" in r.get("error", ""), (rank, r)
        assert "local" not in r and "everywhere" not in r, (rank, r)
        assert r["ones"] == 2.0, (rank, r)
