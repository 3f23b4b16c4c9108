"""The fallback's memory budget (issue 20): past it, a call that would gather its inputs is
refused with a clear error before anything is gathered; under it the call runs as before and
``fallback_report()`` / ``fallback_peak()`` show the bytes. On a real 2-rank gloo mesh, with
``torch.cdist`` of a ``Shard(1)`` tensor (no strategy on any release: the fallback's case)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dtensor_patches.testing import RankPool


def _budget_case(per_call: int | None, total: int | None, env: dict[str, str]) -> dict[str, Any]:
    import os

    from torch.distributed.tensor import Shard, distribute_tensor

    import dtensor_patches
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    a = torch.arange(24.0).reshape(4, 6)  # 96 bytes in full; cdist(x, x) gathers it twice
    out: dict[str, Any] = {}
    from dtensor_patches.dispatch.fallback_budget import reset_usage

    reset_usage()  # the total counts from here
    previous = dtensor_patches.set_fallback_budget(per_call=per_call, total=total)
    os.environ.update(env)
    try:
        with dtensor_patches.patched():
            x = distribute_tensor(a, mesh, [Shard(1)])
            before = x.to_local().clone()
            for attempt in range(2):
                try:
                    got = torch.cdist(x, x)
                    out[f"call{attempt}"] = bool(
                        torch.allclose(got.full_tensor(), torch.cdist(a, a))
                    )
                except dtensor_patches.FallbackBudgetError as exc:
                    out[f"call{attempt}"] = str(exc)
                    out["bytes_needed"] = exc.bytes_needed
            out["unchanged"] = bool(torch.equal(x.to_local(), before))
            out["peak"] = dtensor_patches.fallback_peak()
    finally:
        for key in env:
            os.environ.pop(key, None)
        dtensor_patches.set_fallback_budget(per_call=previous.per_call, total=previous.total)
    return out


def test_a_call_over_the_budget_is_refused_before_gathering(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_budget_case, 64, None, {})):
        for attempt in ("call0", "call1"):
            message = r[attempt]
            assert isinstance(message, str), (rank, r)
            assert "aten._cdist_forward" in message and "Shard(dim=1)" in message, message
            assert "192 bytes" in message and "per-call budget of 64 bytes" in message, message
            assert "set_fallback_budget" in message, message
        assert r["bytes_needed"] == 192 and r["unchanged"], (rank, r)


def test_under_the_budget_the_call_runs_and_is_counted(pool2: RankPool) -> None:
    for rank, r in enumerate(pool2.run(_budget_case, 1 << 20, None, {})):
        assert r["call0"] is True and r["call1"] is True, (rank, r)
        assert r["peak"] >= 192, (rank, r)


def test_the_total_budget_counts_every_call(pool2: RankPool) -> None:
    """192 bytes per call against a total of 300: the first call runs, the second is refused
    naming what was gathered already; a total of 0 from the environment refuses the first."""
    for rank, r in enumerate(pool2.run(_budget_case, None, 300, {})):
        assert r["call0"] is True, (rank, r)
        assert "total budget of 300 bytes (192 already gathered)" in r["call1"], (rank, r)
    results = pool2.run(_budget_case, None, 10**12, {"DTENSOR_PATCHES_FALLBACK_TOTAL_BUDGET": "0"})
    for rank, r in enumerate(results):
        assert "total budget of 0 bytes" in r["call0"], (rank, r)
        assert r["unchanged"], (rank, r)


def test_the_environment_overrides_and_none_lifts_it(pool2: RankPool) -> None:
    lifted = pool2.run(_budget_case, 8, None, {"DTENSOR_PATCHES_FALLBACK_CALL_BUDGET": "none"})
    assert all(r["call0"] is True for r in lifted), lifted
    lowered = pool2.run(_budget_case, None, None, {"DTENSOR_PATCHES_FALLBACK_CALL_BUDGET": "10"})
    assert all("per-call budget of 10 bytes" in r["call0"] for r in lowered), lowered


def test_bad_budgets_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import dtensor_patches

    with pytest.raises(ValueError, match="per_call must be >= 0"):
        dtensor_patches.set_fallback_budget(per_call=-1)
    monkeypatch.setenv("DTENSOR_PATCHES_FALLBACK_CALL_BUDGET", "lots")
    with pytest.raises(ValueError, match="DTENSOR_PATCHES_FALLBACK_CALL_BUDGET='lots'"):
        dtensor_patches.fallback_budget()
