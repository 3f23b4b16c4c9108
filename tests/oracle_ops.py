"""The correctness oracle's op table, shared by the test process and the rank processes.

Each entry says how to call one patched op on a tensor ``x`` with drawn parameters, which dims
it works along (for the placement the strategy promises), and whether it is linear (``Partial``
inputs allowed and kept) or differentiable (gradients compared too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class OracleOp:
    patch: str
    run: Callable[[Any, dict[str, Any]], Any]
    dims: Callable[[dict[str, Any], int], Any] | None  # dims it works along; None: no claim
    keepdim: Callable[[dict[str, Any]], bool] = lambda p: True
    min_ndim: int = 1
    dtypes: tuple[str, ...] = ("float32",)
    linear: bool = False
    differentiable: bool = False
    needs_nonempty: bool = False
    # Combinations torch refuses on purpose on some releases (placement, params, shape) -> bool.
    refused: Callable[[str, dict[str, Any], tuple[int, ...]], bool] | None = None


def _like(x: Any, table: torch.Tensor) -> Any:
    """``table`` as a replicated DTensor on ``x``'s mesh when ``x`` is one (DTensor refuses to
    mix plain tensors in by design), else as is."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if isinstance(x, DTensor):
        return distribute_tensor(table, x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return table


def _dim(p: dict[str, Any], ndim: int) -> tuple[int, ...]:
    return (p["dim"] % ndim,)


def _all(p: dict[str, Any], ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim))


def _sharded_dim(placement: str) -> int | None:
    return int(placement[1:]) if placement.startswith("S") else None


def _unbind_refused(placement: str, p: dict[str, Any], shape: tuple[int, ...]) -> bool:
    """From 2.10 torch refuses to unbind along a sharded dim (a clear error)."""
    from dtensor_patches.compat import torch_release

    return torch_release().minor >= 10 and _sharded_dim(placement) == p["dim"] % len(shape)


def _squeeze_refused(placement: str, p: dict[str, Any], shape: tuple[int, ...]) -> bool:
    """From 2.12 torch refuses to squeeze a sharded size-1 dim (a clear error)."""
    from dtensor_patches.compat import torch_release

    dim = _sharded_dim(placement)
    return torch_release().minor >= 12 and dim is not None and shape[dim] == 1


ORACLE: dict[str, OracleOp] = {
    "max_dim": OracleOp(
        "max_min_indices",
        lambda x, p: torch.max(x, p["dim"], keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        dtypes=("float32", "int64"),
        needs_nonempty=True,
    ),
    "mean": OracleOp(
        "mean_uneven",
        lambda x, p: x.mean(p["dim"], keepdim=p["keepdim"]),
        None,
        differentiable=True,
        linear=True,
    ),
    # Non-empty: squeezing tensors with size-0 sharded dims raises or mislabels the output on
    # 2.13 (a separate gap, noted in the README).
    "squeeze": OracleOp(
        "squeeze",
        lambda x, p: x.squeeze() if p["keepdim"] else x.squeeze(p["dim"]),
        None,
        dtypes=("float32", "int64"),
        differentiable=True,
        needs_nonempty=True,
        refused=_squeeze_refused,
    ),
    "masked_fill": OracleOp(
        "pointwise_gaps",
        lambda x, p: x.masked_fill(x > 0.5, torch.tensor(-1.0)),
        None,
        differentiable=True,
    ),
    "argmax": OracleOp(
        "reductions_2_9",
        lambda x, p: x.argmax(p["dim"], keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        dtypes=("float32", "int64"),
        needs_nonempty=True,
    ),
    "argmin_all": OracleOp(
        "reductions_2_9",
        lambda x, p: x.argmin(),
        _all,
        keepdim=lambda p: False,
        needs_nonempty=True,
    ),
    "logsumexp": OracleOp(
        "reductions_2_9",
        lambda x, p: torch.logsumexp(x, p["dim"], keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        differentiable=True,
    ),
    "std": OracleOp(
        "reductions_2_9",
        lambda x, p: x.std(p["dim"], correction=0, keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        differentiable=True,
        needs_nonempty=True,
    ),
    "unbind": OracleOp(
        "unbind",
        lambda x, p: x.unbind(p["dim"]),
        _dim,
        keepdim=lambda p: False,
        dtypes=("float32", "int64", "bool"),
        refused=_unbind_refused,
    ),
    "count_nonzero": OracleOp(
        "count_nonzero",
        lambda x, p: torch.count_nonzero(x, p["dim"]),
        _dim,
        keepdim=lambda p: False,
        dtypes=("float32", "int64", "bool"),
    ),
    "var_mean": OracleOp(
        "var_mean",
        lambda x, p: torch.var_mean(x, p["dim"], correction=0, keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        differentiable=True,
        needs_nonempty=True,
    ),
    # Not differentiable here: autograd's cumprod backward mixes plain tensors into DTensor
    # ops (a known, unfixed gap; see test_known_gaps.py).
    "cumprod": OracleOp("scans", lambda x, p: torch.cumprod(x, p["dim"]), _dim),
    "logcumsumexp": OracleOp(
        "scans", lambda x, p: torch.logcumsumexp(x, p["dim"]), _dim, differentiable=True
    ),
    "cummax": OracleOp(
        "scans", lambda x, p: torch.cummax(x, p["dim"]), _dim, dtypes=("float32", "int64")
    ),
    "kthvalue": OracleOp(
        "order_stats",
        lambda x, p: torch.kthvalue(x, 1, p["dim"], keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        needs_nonempty=True,
    ),
    "median": OracleOp(
        "order_stats",
        lambda x, p: torch.median(x, p["dim"], keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        dtypes=("float32", "int64"),
        needs_nonempty=True,
    ),
    "flip": OracleOp(
        "flip_roll",
        lambda x, p: torch.flip(x, [p["dim"]]),
        _dim,
        dtypes=("float32", "int64", "bool"),
        linear=True,
        differentiable=True,
    ),
    "roll": OracleOp(
        "flip_roll",
        lambda x, p: torch.roll(x, p["shift"], p["dim"]),
        _dim,
        dtypes=("float32", "bfloat16", "int64"),
        linear=True,
        differentiable=True,
    ),
    "unfold": OracleOp(
        "unfold",
        lambda x, p: x.unfold(p["dim"], 1 + p["shift"] % 2, 1),
        _dim,
        linear=True,
        needs_nonempty=True,
    ),
    "isin": OracleOp(
        "isin_searchsorted",
        lambda x, p: torch.isin(x, _like(x, torch.arange(0, 8, 3))),
        lambda p, ndim: (),
        dtypes=("int64",),
    ),
    "searchsorted": OracleOp(
        "isin_searchsorted",
        lambda x, p: torch.searchsorted(
            _like(x, torch.linspace(-1.5, 1.5, 7)), x, right=p["keepdim"]
        ),
        lambda p, ndim: (),
    ),
    "mse_loss": OracleOp(
        "mse_loss",
        lambda x, p: F.mse_loss(x, x.detach() * 0.5 + 0.25, reduction=p["reduction"]),
        None,
        differentiable=True,
        needs_nonempty=True,
    ),
    # The target is derived from the drawn input so that it has the input's placements.
    "smooth_l1_loss": OracleOp(
        "elementwise_losses",
        lambda x, p: F.smooth_l1_loss(
            x, x.detach() * -0.5 + 0.25, reduction=p["reduction"], beta=0.5
        ),
        None,
        differentiable=True,
        needs_nonempty=True,
    ),
    "huber_loss": OracleOp(
        "elementwise_losses",
        lambda x, p: F.huber_loss(x, x.detach() * -0.5 + 0.25, reduction=p["reduction"], delta=0.5),
        None,
        differentiable=True,
        needs_nonempty=True,
    ),
    "soft_margin_loss": OracleOp(
        "elementwise_losses",
        lambda x, p: F.soft_margin_loss(x, torch.sign(x.detach() - 0.3), reduction=p["reduction"]),
        None,
        differentiable=True,
        needs_nonempty=True,
    ),
    "binary_cross_entropy": OracleOp(
        "elementwise_losses",
        lambda x, p: F.binary_cross_entropy(
            torch.sigmoid(x), torch.sigmoid(x.detach() * 2), reduction=p["reduction"]
        ),
        None,
        differentiable=True,
        needs_nonempty=True,
    ),
    "bce_with_logits": OracleOp(
        "elementwise_losses",
        lambda x, p: F.binary_cross_entropy_with_logits(
            x, torch.sigmoid(x.detach() * -2), reduction=p["reduction"]
        ),
        None,
        differentiable=True,
        needs_nonempty=True,
    ),
    # Labels (0 or 1) from the input itself, so that they are sharded like its batch dims
    # (not argmax: torch's own argmax handler hangs on empty shards); ``shift`` doubles as
    # ``ignore_index`` (hits a real label when 0 or 1), ``keepdim`` switches class weights on.
    "cross_entropy": OracleOp(
        "nll_loss",
        lambda x, p: F.cross_entropy(
            x,
            (x.detach().sum(1) > 0).long() * min(1, x.shape[1] - 1),
            weight=_like(x, torch.linspace(0.5, 2.0, x.shape[1])) if p["keepdim"] else None,
            ignore_index=p["shift"],
            reduction=p["reduction"],
        ),
        None,
        min_ndim=2,
        differentiable=True,
        needs_nonempty=True,
    ),
    "nonzero": OracleOp(
        "data_dependent", lambda x, p: torch.nonzero(x > 0), None, dtypes=("float32", "int64")
    ),
    "masked_select": OracleOp("data_dependent", lambda x, p: torch.masked_select(x, x > 0), None),
    "unique": OracleOp(
        "data_dependent",
        lambda x, p: torch.unique(x, return_inverse=True, return_counts=True),
        None,
        dtypes=("int64",),
    ),
}


def make_input(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """Deterministic input: normals for floats, small ints (repeats likely) for ints/bools."""
    g = torch.Generator().manual_seed(seed)
    if dtype == "int64":
        return torch.randint(-3, 8, shape, generator=g)
    if dtype == "bool":
        return torch.rand(shape, generator=g) > 0.5
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))
