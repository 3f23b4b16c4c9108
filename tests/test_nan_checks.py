"""NaN/inf guards on DTensors (issue 20): ``isfinite(x).all()``, ``isnan(x).any()`` over one
dim, several dims or all, ``torch._is_any_true`` / ``torch._is_all_true``, over ``Shard`` (uneven too), ``Partial`` and
``Replicate`` tensors, with the only NaN on one rank's part; and autograd anomaly mode on a
DTensor step. Every answer is compared with the same check on the single device's tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtensor_patches.testing import RankPool

CHECKS = {
    "isfinite_all": lambda x: torch.isfinite(x).all(),
    "isfinite_all_dim0": lambda x: torch.isfinite(x).all(0),
    "isfinite_all_dims": lambda x: torch.isfinite(x).all(dim=(0, 1)),
    "isnan_any": lambda x: torch.isnan(x).any(),
    "isnan_any_dim1": lambda x: torch.isnan(x).any(1),
    "isnan_any_dims_keepdim": lambda x: torch.isnan(x).any(dim=(0, 1), keepdim=True),
    "is_any_true": lambda x: torch.ops.aten._is_any_true.default(torch.isnan(x)),
    "is_all_true": lambda x: torch.ops.aten._is_all_true.default(torch.isfinite(x)),
}


def _full(with_nan: bool) -> torch.Tensor:
    x = torch.arange(15.0).reshape(5, 3)
    if with_nan:
        x[4, 2] = float("nan")  # the last rank's rows (Shard(0)) and columns (Shard(1))
    return x


def _checks_on_rank(with_nan: bool, placement: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from dtensor_patches import patched
    from dtensor_patches.testing import world_mesh

    mesh, rank, n = world_mesh(), dist.get_rank(), dist.get_world_size()
    full = _full(with_nan)
    out: dict[str, Any] = {}
    with patched():
        if placement == "P":
            # Partial(sum) shares: the NaN only in the last rank's share.
            share = torch.where(full.isnan(), full, full / n) if rank == n - 1 else full / n
            x = DTensor.from_local(share, mesh, [Partial()], run_check=False)
        else:
            chosen = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}[placement]
            x = distribute_tensor(full, mesh, [chosen])
        for name, check in CHECKS.items():
            got = check(x)
            out[name] = (got.full_tensor() if isinstance(got, DTensor) else got).tolist()
            out[name + ".item"] = bool(got) if got.dim() == 0 else None
    return out


@pytest.mark.parametrize("placement", ["S0", "S1", "P", "R"])
@pytest.mark.parametrize("with_nan", [True, False], ids=["nan", "finite"])
def test_nan_checks_match_the_single_device(
    pool2: RankPool, with_nan: bool, placement: str
) -> None:
    full = _full(with_nan)
    for rank, got in enumerate(pool2.run(_checks_on_rank, with_nan, placement)):
        for name, check in CHECKS.items():
            expected = check(full)
            assert got[name] == expected.tolist(), (rank, name, got[name])
            if expected.dim() == 0:
                assert got[name + ".item"] == bool(expected), (rank, name)


def _anomaly_on_rank(make_nan: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    from dtensor_patches import patched
    from dtensor_patches.testing import world_mesh

    mesh = world_mesh()
    out: dict[str, Any] = {}
    for where in ("dtensor", "plain"):
        w0 = torch.full((5, 3), 2.0)
        if make_nan:
            w0[4, 0] = -1.0  # sqrt of a negative: NaN in the last rank's rows
        with patched():
            w = torch.nn.Parameter(
                distribute_tensor(w0, mesh, [Shard(0)]) if where == "dtensor" else w0.clone()
            )
            try:
                with torch.autograd.detect_anomaly(check_nan=True):
                    loss = torch.sqrt(w).sum()
                    loss.backward()
                out[where] = "ok"
            except RuntimeError as exc:
                out[where] = "nan" if "nan" in str(exc).lower() else f"other: {exc}"
    return out


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize("make_nan", [True, False], ids=["nan", "finite"])
def test_anomaly_mode_on_a_dtensor_step(pool2: RankPool, make_nan: bool) -> None:
    """A NaN that backward makes on one rank's shard is found as on one device; a finite step
    passes. (On a DTensor step each rank checks its own local tensors: the rank without the
    NaN passes its check, so a NaN makes at least one rank raise.)"""
    results = pool2.run(_anomaly_on_rank, make_nan)
    plain = {r["plain"] for r in results}
    assert plain == ({"nan"} if make_nan else {"ok"}), results
    dtensor = [r["dtensor"] for r in results]
    if make_nan:
        assert "nan" in dtensor and all(d in ("nan", "ok") for d in dtensor), results
    else:
        assert dtensor == ["ok"] * len(results), results
