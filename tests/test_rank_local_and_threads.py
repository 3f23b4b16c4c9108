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
