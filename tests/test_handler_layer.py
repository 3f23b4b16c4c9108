"""The handler layer: correct, all-or-nothing, thread-safe, off the hot path (issue 9).

Each numbered item of the issue has a test here; the multi-rank ones run on real gloo ranks
and compare with the same computation on plain tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dtensor_patches
from dtensor_patches import PatchError, Status, registry, state
from dtensor_patches._torch import tables as torch_tables
from dtensor_patches._torch.dtensors import spec_with_placements
from dtensor_patches._torch.schemas import resolve_op
from dtensor_patches.dispatch import hook
from dtensor_patches.testing import RankPool
from tests import synthetic

# --- rank functions (module level: sent to the ranks by reference) ------------------------


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _summed(full: torch.Tensor, mesh: Any) -> Any:
    """``full.sum(0)`` computed as DTensor ``x.sum(0)`` of ``Shard(0)`` rows: a ``Partial(sum)``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(full, mesh, [Shard(0)]).sum(0)


def _writes_into_views_of_partial() -> dict[str, Any]:
    mesh = _mesh()
    full = torch.arange(24.0).reshape(4, 6)
    out: dict[str, Any] = {}
    with dtensor_patches.patched():
        p = _summed(full, mesh)
        p[0] = 5.0
        expected = full.sum(0)
        expected[0] = 5.0
        out["setitem"] = (p.full_tensor().tolist(), expected.tolist(), str(p.placements))
        p = _summed(full, mesh)
        sibling = p[2:]
        p[:2].add_(1.0)
        expected = full.sum(0)
        expected[:2] += 1.0
        out["add_view"] = (p.full_tensor().tolist(), expected.tolist())
        out["sibling"] = (sibling.full_tensor().tolist(), expected[2:].tolist())
    return out


def test_item1_writes_into_a_view_of_partial_keep_the_base_consistent(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_writes_into_views_of_partial)):
        got, expected, placements = r["setitem"]
        assert got == expected, f"rank {rank}: p[0] = 5 gave {got}"
        assert "Partial" in placements, f"rank {rank}: base relabelled to {placements}"
        assert r["add_view"][0] == r["add_view"][1], f"rank {rank}: p[:2].add_(1) doubled"
        assert r["sibling"][0] == r["sibling"][1], f"rank {rank}: a sibling view went stale"


def _failed_copy_leaves_target() -> dict[str, Any]:
    mesh = _mesh()
    full = torch.arange(12.0).reshape(4, 3)
    with dtensor_patches.patched():
        p = _summed(full, mesh)
        before_local, before_placements = p.to_local().clone(), p.placements
        try:
            p.copy_(torch.ones(5))
            raised = False
        except RuntimeError:
            raised = True
        unchanged = torch.equal(p.to_local(), before_local) and p.placements == before_placements
        p.copy_(p)
        self_copy = p.full_tensor()
    gathered = [torch.empty_like(self_copy) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, self_copy)
    return {
        "raised": raised,
        "unchanged": unchanged,
        "self_copy": self_copy.tolist(),
        "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
        "expected": full.sum(0).tolist(),
    }


def test_item2_a_failed_write_leaves_the_target_exactly_as_it_was(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_failed_copy_leaves_target)):
        assert r["raised"], f"rank {rank}: a wrong-shape copy_ did not raise"
        assert r["unchanged"], f"rank {rank}: the failed copy_ changed the target"
        assert r["ranks_agree"] and r["self_copy"] == r["expected"], f"rank {rank}: {r}"


_MAX_MIN_OPS = {
    "mul_neg": lambda t: t.mul_(-1.0),
    "div_neg": lambda t: t.div_(-2.0),
    "neg": lambda t: t.neg_(),
    "mul_pos": lambda t: t.mul_(3.0),
    "add": lambda t: t.add_(1.0),
}


def _partial_max_min(reduce: str) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh()
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    out = {}
    with dtensor_patches.patched():
        for name, fn in _MAX_MIN_OPS.items():
            x = distribute_tensor(full, mesh, [Shard(0)])
            p = x.amax(0) if reduce == "max" else x.amin(0)
            expected = fn(full.amax(0) if reduce == "max" else full.amin(0))
            fn(p)
            out[name] = torch.allclose(p.full_tensor(), expected)
    return out


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_item3_max_min_targets_are_not_treated_as_linear(pool2: RankPool, reduce: str) -> None:
    for rank, r in enumerate(pool2.run(_partial_max_min, reduce)):
        assert all(r.values()), f"rank {rank}: wrong for Partial({reduce}): {r}"


# --- in-process registry tests (no ranks) --------------------------------------------------


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    before = torch_tables.registry_state()
    yield
    dtensor_patches.revert_all()
    assert torch_tables.registry_state() == before
    assert not hook.installed()


def test_item4_revert_while_other_threads_dispatch_leaks_nothing(
    clean_registry: None, pool2: RankPool
) -> None:
    # The hook never lifts entries out of torch's tables while a call runs, so a revert in
    # one thread cannot leave anything installed; the ranks check it with real in-place ops.
    for rank, r in enumerate(pool2.run(_revert_races, 20)):
        assert r["leaked"] == 0, f"rank {rank}: {r['leaked']} trials left entries behind"
        assert r["errors"] == [], f"rank {rank}: {r['errors']}"


def _revert_races(trials: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh()
    x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    before = torch_tables.registry_state()
    leaked, errors = 0, []
    for _ in range(trials):
        dtensor_patches.apply_all()
        stop = threading.Event()

        def spin(stop: threading.Event = stop) -> None:
            while not stop.is_set():
                try:
                    x.mul_(1.0)
                    x.add_(0.0)
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    errors.append(repr(exc))
                    return

        worker = threading.Thread(target=spin)
        worker.start()
        dtensor_patches.revert_all()
        stop.set()
        worker.join()
        if torch_tables.registry_state() != before or hook.installed():
            leaked += 1
            dtensor_patches.revert_all()
    return {"leaked": leaked, "errors": errors}


def _two_patches_on_one_op() -> tuple[Any, Any]:
    first = synthetic.make("first")
    second = synthetic.make("second")
    return first, second


@pytest.mark.parametrize("order", ["lifo", "fifo"])
def test_item5_patches_sharing_an_op_revert_in_any_order(clean_registry: None, order: str) -> None:
    op = resolve_op(synthetic.OP)
    table = "propagator.op_strategy_funcs"
    before = torch_tables.tables()[table].get(op)
    first, second = _two_patches_on_one_op()
    # Both install on the same op: the second overrides (as with argmax on 2.9).
    first = first.__class__(**{**first.__dict__, "overrides_existing": True})
    second = second.__class__(**{**second.__dict__, "overrides_existing": True})
    assert first.apply() and second.apply()
    top = torch_tables.tables()[table].get(op)
    if order == "lifo":
        second.revert()
        assert torch_tables.tables()[table].get(op) is state.LEDGER.owned(first)[(table, op)]
        first.revert()
    else:
        first.revert()
        assert torch_tables.tables()[table].get(op) is top, "reverting the lower layer changed it"
        second.revert()
    assert torch_tables.tables()[table].get(op) is before
    assert not first.is_applied and not second.is_applied


def test_item5_patched_blocks_in_two_threads(clean_registry: None) -> None:
    barrier = threading.Barrier(2)
    errors: list[str] = []

    def block(names: list[str], wait_first: bool) -> None:
        try:
            with dtensor_patches.patched(only=names):
                barrier.wait(timeout=30)
                if wait_first:
                    barrier.wait(timeout=30)
            if not wait_first:
                barrier.wait(timeout=30)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(repr(exc))

    # Overlapping blocks that leave out of order: the first to enter leaves first.
    shared = ["argmax_all", "dim_reductions", "inplace_writes"]
    a = threading.Thread(target=block, args=(shared, False))
    b = threading.Thread(target=block, args=(shared, True))
    a.start()
    b.start()
    a.join(60)
    b.join(60)
    assert errors == []


def test_item6_a_failed_cache_clear_still_reverts_the_patch(
    clean_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch = synthetic.make()
    monkeypatch.setattr(registry, "all_patches", lambda: (patch,))
    assert dtensor_patches.apply_all()["synthetic"].status is Status.APPLIED

    def broken() -> None:
        raise PatchError("cache moved", internal="test")

    with monkeypatch.context() as m:
        m.setattr(torch_tables, "clear_sharding_caches", broken)
        with pytest.raises(PatchError):
            patch.revert()
    assert not patch.is_applied, "the registry and the patch disagree after a failed revert"
    assert dtensor_patches.apply_all()["synthetic"].status is Status.APPLIED


def test_item7_call_time_internals_are_checked_at_apply_time(
    clean_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = torch_tables.registry_state()
    monkeypatch.delattr(torch._C, "_is_alias_of")
    report = dtensor_patches.apply_all(only=["inplace_writes"])
    outcome = report["inplace_writes"]
    assert outcome.status is Status.FAILED
    assert "_is_alias_of" in outcome.reason
    assert torch_tables.registry_state() == before
    assert not hook.installed()


def test_item8_keyboard_interrupt_propagates_after_rollback(
    clean_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = torch_tables.registry_state()
    patch = synthetic.make()

    def interrupted() -> list[Any]:
        raise KeyboardInterrupt

    patch = patch.__class__(**{**patch.__dict__, "registrations": interrupted})
    monkeypatch.setattr(registry, "all_patches", lambda: (patch,))
    with pytest.raises(KeyboardInterrupt):
        dtensor_patches.apply_all()
    assert not patch.is_applied
    assert torch_tables.registry_state() == before


def _other_threads_see_reverts() -> dict[str, Any]:
    # cumsum(x, -1) with x sharded on the last dim: per-shard prefix sums on stock 2.9 to 2.13
    # (a cached wrong decision); the cumsum_negative_dim patch replaces it.
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh()
    full = torch.arange(8.0).reshape(2, 4)
    x = distribute_tensor(full, mesh, [Shard(1)])
    results: dict[str, Any] = {}
    go, done = threading.Event(), threading.Event()

    def worker() -> None:
        results["stock"] = torch.equal(x.cumsum(-1).full_tensor(), full.cumsum(-1))
        go.wait(60)
        results["patched"] = torch.equal(x.cumsum(-1).full_tensor(), full.cumsum(-1))
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    while "stock" not in results:
        pass
    report = dtensor_patches.apply_all(only=["cumsum_negative_dim"])
    go.set()
    done.wait(60)
    thread.join()
    dtensor_patches.revert_all()
    results["applied"] = report["cumsum_negative_dim"].status is Status.APPLIED
    return results


def test_item9_other_threads_use_the_new_decision(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_other_threads_see_reverts)):
        if not r["applied"]:
            pytest.skip("cumsum_negative_dim is gated out on this torch")
        assert not r["stock"], f"rank {rank}: stock cumsum(-1) is right here; pick another op"
        assert r["patched"], f"rank {rank}: the thread kept its stale cached decision"


def _spec_copy_fields() -> dict[str, Any]:
    import dataclasses

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh()
    x = distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)])
    spec = x._spec
    copied = spec_with_placements(spec, (Replicate(),))
    names = [f.name for f in dataclasses.fields(spec)]
    kept = {
        name: getattr(copied, name) == getattr(spec, name)
        for name in names
        if name not in ("placements", "shard_order")
    }
    return {"fields": names, "kept": kept, "placements": str(copied.placements)}


def test_item10_spec_copies_keep_every_field(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_spec_copy_fields)):
        assert r["placements"] == "(Replicate(),)"
        assert all(r["kept"].values()), f"rank {rank}: fields lost: {r}"


def _tp_sp_embedding_across_registry_changes() -> list[str]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = _mesh()
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(16, 8)
    reference = torch.nn.Embedding(16, 8)
    reference.load_state_dict(embedding.state_dict())
    parallelize_module(
        embedding,
        mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
    )
    ids = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(1))
    expected = reference(ids)
    problems = []
    steps = [
        lambda: None,
        dtensor_patches.apply_all,
        dtensor_patches.revert_all,
        lambda: dtensor_patches.patched().__enter__(),
        dtensor_patches.revert_all,
    ]
    for i, change in enumerate(steps):
        change()
        try:
            got = embedding(ids).full_tensor()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            problems.append(f"forward {i}: {exc!r}")
            continue
        if not torch.allclose(got, expected):
            problems.append(f"forward {i}: wrong values")
    dtensor_patches.revert_all()
    return problems


def test_item11_registry_changes_between_forwards_break_nothing(pool2: RankPool) -> None:
    for rank, problems in enumerate(pool2.run(_tp_sp_embedding_across_registry_changes)):
        assert problems == [], f"rank {rank}: {problems}"


def _partial_sum_writes_match_stock() -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = _mesh()
    full = torch.arange(12.0).reshape(4, 3)

    def copy_into_partial() -> tuple[list[str], int, list[float]]:
        p, src = _summed(full, mesh), _summed(full * 2, mesh)
        with CommDebugMode() as comm:
            p.copy_(src)
        return [str(pl) for pl in p.placements], comm.get_total_counts(), p.full_tensor().tolist()

    def put_into_partial() -> tuple[list[str], int, list[float]]:
        q = _summed(full, mesh)
        with CommDebugMode() as comm:
            q.index_put_((torch.tensor([1]),), torch.tensor(7.0), accumulate=True)
        return [str(pl) for pl in q.placements], comm.get_total_counts(), q.full_tensor().tolist()

    out: dict[str, Any] = {"stock_copy": copy_into_partial()}
    try:
        out["stock_put"] = put_into_partial()
    except RuntimeError:  # 2.9 refuses it: then only our result is checked
        out["stock_put"] = None
    with dtensor_patches.patched():
        out["copy"], out["put"] = copy_into_partial(), put_into_partial()
    expected = full.sum(0)
    expected[1] += 7.0
    out["put_expected"] = expected.tolist()
    return out


def test_item13_no_extra_communication_where_torch_is_right(pool2: RankPool) -> None:
    from torch.distributed.tensor import Partial

    for rank, r in enumerate(pool2.run(_partial_sum_writes_match_stock)):
        assert r["copy"] == r["stock_copy"], f"rank {rank}: copy_ into Partial(sum) differs: {r}"
        if r["stock_put"] is not None:
            assert r["put"] == r["stock_put"], f"rank {rank}: index_put_ differs from stock: {r}"
        placements, collectives, values = r["put"]
        assert placements == [str(Partial())] and collectives == 0, f"rank {rank}: {r}"
        assert values == r["put_expected"], f"rank {rank}: index_put_ into Partial(sum) wrong"


def _masked_attention_keeps_head_shards() -> dict[str, Any]:
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = _mesh()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 4, 8, generator=g) for _ in range(3))  # [B, S, H, D]
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False  # left padding of the second sequence
    mask[1, :, :2, 0] = True

    def attend(q: Any, k: Any, v: Any, m: Any) -> Any:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        return out.transpose(1, 2).contiguous().reshape(2, 6, -1)

    expected = attend(q, k, v, mask)
    dq, dk, dv = (distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v))
    dmask = distribute_tensor(mask, mesh, [Replicate()])
    with dtensor_patches.patched(), CommDebugMode() as comm:
        out = attend(dq, dk, dv, dmask)
    counts = comm.get_total_counts()
    return {
        "values": torch.allclose(out.full_tensor(), expected, atol=1e-5),
        "collectives": counts,
        "placements": [str(p) for p in out.placements],
    }


def test_item14_masked_attention_keeps_heads_sharded(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_masked_attention_keeps_head_shards)):
        assert r["values"], f"rank {rank}: masked attention differs from single device"
        assert r["collectives"] == 0, f"rank {rank}: q/k/v were gathered ({r['collectives']})"


def _common_calls_take_no_python_path() -> dict[str, Any]:
    """After apply_all(), an ordinary add_/copy_/slice on a sharded DTensor consults no rule
    once its decision is cached: counted by wrapping the miss rules."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh()
    x = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])
    y = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])
    calls: list[str] = []
    with dtensor_patches.patched():
        rules = state.MISS_RULES
        wrapped = {}
        for key, rule in list(rules.items()):

            def counting(schema: Any, native: Any, rule: Any = rule) -> Any:
                calls.append(str(schema.op))
                return rule(schema, native)

            wrapped[key] = rule
            rules[key] = counting
        try:
            for _ in range(3):
                x.add_(y)
                x.copy_(y)
                _ = x[:, 1:3]
                x.mul_(2.0)
            first = len(calls)
            for _ in range(5):
                x.add_(y)
                x.copy_(y)
                _ = x[:, 1:3]
                x.mul_(2.0)
        finally:
            rules.update(wrapped)
    return {"first_rounds": first, "later": len(calls) - first}


def test_common_calls_are_decided_once(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_common_calls_take_no_python_path)):
        assert r["later"] == 0, f"rank {rank}: cached calls reached a rule {r['later']} times"
