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
    # Partial inputs drawn too although the op is not linear: it must reduce them first
    # (gradients are compared for them as well).
    partial: bool = False
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


_UNSORTED = torch.tensor([0.5, -1.0, 1.5, 0.0, -0.5, 1.0, -1.5])


def _copy(x: Any) -> Any:
    """A copy with the same placements (``clone`` may reduce a ``Partial`` first)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return DTensor.from_local(
            x.to_local().clone(),
            x.device_mesh,
            x.placements,
            run_check=False,
            shape=x.shape,
            stride=x.stride(),
        )
    return x.clone()


def _dim(p: dict[str, Any], ndim: int) -> tuple[int, ...]:
    return (p["dim"] % ndim,)


def _none(p: dict[str, Any], ndim: int) -> tuple[int, ...]:
    """Elementwise: works along no dim (shards stay, ``Partial`` is reduced unless linear)."""
    return ()


def _all(p: dict[str, Any], ndim: int) -> tuple[int, ...]:
    return tuple(range(ndim))


def _sharded_dim(placement: str) -> int | None:
    return int(placement[1:]) if placement.startswith("S") else None


def _unbind_refused(placement: str, p: dict[str, Any], shape: tuple[int, ...]) -> bool:
    """From 2.10 torch refuses to unbind along a sharded dim (a clear error)."""
    from dtensor_patches._torch.versions import torch_release

    return torch_release().minor >= 10 and _sharded_dim(placement) == p["dim"] % len(shape)


def _squeeze_refused(placement: str, p: dict[str, Any], shape: tuple[int, ...]) -> bool:
    """From 2.12 torch refuses to squeeze a sharded size-1 dim (a clear error)."""
    from dtensor_patches._torch.versions import torch_release

    dim = _sharded_dim(placement)
    return torch_release().minor >= 12 and dim is not None and shape[dim] == 1


def _keep(p: dict[str, Any], ndim: int) -> tuple[int, ...]:
    """In-place writes (on a copy of ``x`` here) keep ``x``'s placements: no dim is consumed."""
    return ()


def _rows(x: Any, p: dict[str, Any]) -> tuple[int, list[int]]:
    """The drawn dim and a 1-D index along it with repeats: last, first, last."""
    d = p["dim"] % x.ndim
    n = x.shape[d]
    return d, [n - 1, 0, n - 1]


def _ints(shape: tuple[int, ...], high: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, max(high, 1), shape, generator=torch.Generator().manual_seed(seed))


def _source(x: Any, shape: tuple[int, ...]) -> Any:
    n = 1
    for size in shape:
        n *= size
    return _like(x, torch.arange(n, dtype=torch.float32).reshape(shape).to(x.dtype) / 7 - 1)


def _getitem(x: Any, p: dict[str, Any]) -> Any:
    d, rows = _rows(x, p)
    return x[(slice(None),) * d + (rows,)]


def _index_add_(x: Any, p: dict[str, Any]) -> Any:
    d, rows = _rows(x, p)
    shape = tuple(3 if i == d else s for i, s in enumerate(x.shape))
    return x.clone().index_add_(d, _like(x, torch.tensor(rows)), _source(x, shape), alpha=2)


def _index_fill_(x: Any, p: dict[str, Any]) -> Any:
    d, rows = _rows(x, p)
    return x.clone().index_fill_(d, _like(x, torch.tensor(rows[:2])), -1)


def _scatter_add_(x: Any, p: dict[str, Any]) -> Any:
    d = p["dim"] % x.ndim
    index = _like(x, _ints(tuple(x.shape), x.shape[d]))
    return x.clone().scatter_add_(d, index, _source(x, tuple(x.shape)))


_REDUCE = {"none": "amax", "mean": "mean", "sum": "sum"}


def _scatter_reduce(x: Any, p: dict[str, Any]) -> Any:
    d = p["dim"] % x.ndim
    index = _like(x, _ints(tuple(x.shape), x.shape[d]))
    return torch.scatter_reduce(
        x, d, index, _source(x, tuple(x.shape)), _REDUCE[p["reduction"]], include_self=p["keepdim"]
    )


def _put_(x: Any, p: dict[str, Any]) -> Any:
    index = _like(x, _ints((4,), x.numel()))
    return x.clone().put_(index, _source(x, (4,)), accumulate=True)


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
        lambda x, p: (x.squeeze(), x.squeeze(p["dim"]), x.squeeze(()), x.squeeze((p["dim"],)))[
            p["shift"] % 4
        ],
        None,
        dtypes=("float32", "int64"),
        differentiable=True,
        needs_nonempty=True,
        refused=_squeeze_refused,
    ),
    "masked_fill": OracleOp(
        "elementwise_strategies",
        lambda x, p: x.masked_fill(x > 0.5, torch.tensor(-1.0)),
        None,
        differentiable=True,
    ),
    "argmax": OracleOp(
        "dim_reductions",
        lambda x, p: x.argmax(p["dim"], keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        dtypes=("float32", "int64"),
        needs_nonempty=True,
    ),
    "argmin_all": OracleOp(
        "dim_reductions",
        lambda x, p: x.argmin(),
        _all,
        keepdim=lambda p: False,
        needs_nonempty=True,
    ),
    # Small ints: ties across shards, resolved in flattened order as on one device.
    "argmax_all": OracleOp(
        "argmax_all",
        lambda x, p: torch.argmax(x, None, p["keepdim"]),
        _all,
        keepdim=lambda p: p["keepdim"],
        dtypes=("float32", "int64"),
        needs_nonempty=True,
    ),
    "logsumexp": OracleOp(
        "dim_reductions",
        lambda x, p: torch.logsumexp(x, p["dim"], keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        differentiable=True,
    ),
    "std": OracleOp(
        "dim_reductions",
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
    "std_mean": OracleOp(
        "var_mean",
        lambda x, p: torch.std_mean(x, p["dim"], correction=0, keepdim=p["keepdim"]),
        _dim,
        keepdim=lambda p: p["keepdim"],
        differentiable=True,
        needs_nonempty=True,
    ),
    # No placement claim: a shard on a reduced dim becomes Partial(sum), not Replicate.
    "nansum": OracleOp(
        "nansum",
        lambda x, p: torch.nansum(
            x.masked_fill(x > 1.0, float("nan")), p["dim"], keepdim=p["keepdim"]
        ),
        None,
        differentiable=True,
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
    "median_all": OracleOp(
        "order_stats",
        lambda x, p: torch.median(x),
        _all,
        keepdim=lambda p: False,
        dtypes=("float32", "int64"),
        differentiable=True,
        needs_nonempty=True,
    ),
    "nanmedian_all": OracleOp(
        "order_stats",
        lambda x, p: torch.nanmedian(x.masked_fill(x > 1.0, float("nan"))),
        _all,
        keepdim=lambda p: False,
        needs_nonempty=True,
    ),
    # Negative dims included (the bug); no placement claim: the output's shard dims shift
    # past the new dim, which ``_expected_placement`` does not model. Not differentiable here:
    # on 2.9 stack's backward fails in ``select.int`` of the expanded gradient of ``sum()``
    # with or without this patch (a separate gap).
    "stack": OracleOp(
        "stack_dim",
        lambda x, p: torch.stack([x, x * 2], p["dim"]),
        None,
        dtypes=("float32", "int64"),
        linear=True,
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
    "searchsorted_sorter": OracleOp(
        "isin_searchsorted",
        lambda x, p: torch.searchsorted(
            _like(x, _UNSORTED), x, right=p["keepdim"], sorter=_like(x, _UNSORTED.argsort())
        ),
        lambda p, ndim: (),
    ),
    # The hidden (last) dim may be sharded; no placement claim (torch's mul/rsqrt decide).
    "rms_norm": OracleOp(
        "inplace_writes",
        lambda x, p: F.rms_norm(
            x, (x.shape[-1],), _like(x, torch.linspace(0.5, 1.5, x.shape[-1])), 1e-6
        ),
        None,
        differentiable=True,
    ),
    # A Partial target is reduced first and becomes Replicate (inplace_writes): no claim here,
    # tests/test_inplace_writes.py checks the placements.
    "add_scalar_inplace": OracleOp(
        "inplace_writes",
        lambda x, p: torch.ops.aten.add_.Scalar(_copy(x), 2, alpha=p["shift"]),
        None,
        dtypes=("float32", "int64"),
        linear=True,
        differentiable=True,
    ),
    "mse_loss": OracleOp(
        "elementwise_losses",
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
    # Partial inputs of out-of-place pointwise ops: the pending sum must be reduced first
    # wherever the op is not linear in it (torch 2.9/2.10 add a scalar once per rank).
    "partial_add_scalar": OracleOp(
        "partial_add_scalar",
        lambda x, p: x + 10 if p["keepdim"] else x.add(p["shift"], alpha=2),
        _none,
        differentiable=True,
        partial=True,
    ),
    "partial_sum_plus_scalar": OracleOp(
        "partial_add_scalar",
        lambda x, p: x.sum(p["dim"]) + 1.5,
        None,
        differentiable=True,
        partial=True,
    ),
    "partial_to_int": OracleOp(
        "partial_int_cast",
        lambda x, p: (x * 4).to(torch.int64 if p["keepdim"] else torch.bool),
        _none,
        partial=True,
    ),
    "partial_to_float": OracleOp(
        "partial_int_cast",
        lambda x, p: x.to(torch.float64),
        _none,
        differentiable=True,
        linear=True,
    ),
    "partial_add_partial": OracleOp(
        "partial_add_scalar",
        lambda x, p: x + x * 0.5 - _like(x, torch.tensor(0.25)),
        None,
        differentiable=True,
        partial=True,
    ),
    # Non-linear ops on Partial inputs that torch handles itself on every release: guards for
    # the in-place handler, which computes through these out-of-place ops.
    "partial_nonlinear": OracleOp(
        "partial_add_scalar",
        lambda x, p: torch.where(x > 0, x.exp(), x.sigmoid()) + x.clamp(-0.5, 0.5).abs() ** 2,
        None,
        differentiable=True,
        partial=True,
    ),
    "partial_times_partial": OracleOp(
        "partial_add_scalar",
        lambda x, p: x * x - 1 / (x.abs() + 1) + 2 - x,
        None,
        differentiable=True,
        partial=True,
    ),
    # Elementwise ops with no strategy on older releases (and their backward ops).
    "activations": OracleOp(
        "elementwise_strategies",
        lambda x, p: _ACTIVATIONS[p["shift"] % len(_ACTIVATIONS)](x),
        _none,
        differentiable=True,
    ),
    "fmax_fmin_rsub": OracleOp(
        "elementwise_strategies",
        lambda x, p: torch.rsub(torch.fmax(x, _row(x)), torch.fmin(_row(x), x)),
        None,
        differentiable=True,
    ),
    "activation_grads": OracleOp(
        "activations",
        lambda x, p: _BACKWARD_ONLY[p["shift"] % len(_BACKWARD_ONLY)](x),
        _none,
        differentiable=True,
        partial=True,
    ),
    "glu": OracleOp(
        "ne_glu_entr",
        lambda x, p: F.glu(x, p["dim"]),
        _dim,
        differentiable=True,
        needs_nonempty=True,
    ),
    "ne_entr": OracleOp(
        "ne_glu_entr",
        lambda x, p: (torch.special.entr(x.abs()), x != _row(x)),
        None,
        differentiable=True,
    ),
    "mv": OracleOp(
        "mv",
        lambda x, p: x @ _row(x) if p["keepdim"] else torch.addmv(_row(x.T), x, _row(x)),
        None,
        min_ndim=2,
        linear=True,
        differentiable=True,
    ),
    # Indexing and indexed writes: the in-place ops run on a copy of x (gradients flow to x).
    # No Partial() for those: clone() reduces it on some releases; test_index_writes.py
    # covers in-place writes into Partial() tensors.
    "getitem": OracleOp(
        "getitem",
        _getitem,
        _dim,
        dtypes=("float32", "int64", "bool"),
        linear=True,
        differentiable=True,
        needs_nonempty=True,
    ),
    "getitem_mask": OracleOp(
        "getitem", lambda x, p: x[x > 0], None, dtypes=("float32", "int64"), differentiable=True
    ),
    "index_add_": OracleOp(
        "index_writes", _index_add_, _keep, differentiable=True, needs_nonempty=True
    ),
    "index_fill_": OracleOp(
        "index_writes", _index_fill_, _keep, dtypes=("float32", "int64"), needs_nonempty=True
    ),
    "scatter_add_": OracleOp(
        "index_writes", _scatter_add_, _keep, differentiable=True, needs_nonempty=True
    ),
    "scatter_reduce": OracleOp("index_writes", _scatter_reduce, _keep, needs_nonempty=True),
    "put_": OracleOp("index_writes", _put_, _keep, needs_nonempty=True),
    "cumsum": OracleOp(
        "cumsum_negative_dim",
        lambda x, p: torch.cumsum(x, p["dim"]),
        _dim,
        dtypes=("float32", "int64"),
        linear=True,
        differentiable=True,
        # Non-empty: distribute_tensor itself fails on 2.9 for Shard(0) of shape (1, 0).
        needs_nonempty=True,
    ),
    "cumsum_": OracleOp(
        "cumsum_inplace",
        lambda x, p: x.clone().cumsum_(p["dim"]),
        _keep,
        dtypes=("float32", "int64"),
        differentiable=True,
        # Non-empty: distribute_tensor itself fails on 2.9 for Shard(0) of shape (1, 0).
        needs_nonempty=True,
    ),
}

_ACTIVATIONS: list[Callable[[Any], Any]] = [
    lambda t: F.softplus(t, beta=2.0),
    F.leaky_relu,
    F.elu,
    F.celu,
    F.mish,
    F.selu,
]


# Their backward ops have no strategy on any release (torch 2.9 to 2.15).
_BACKWARD_ONLY: list[Callable[[Any], Any]] = [
    lambda t: F.logsigmoid(t * 2),
    lambda t: F.relu6(t * 4),
    lambda t: F.hardswish(t * 4),
    lambda t: F.hardsigmoid(t * 4),
    F.hardshrink,
    F.softshrink,
    lambda t: F.hardtanh(t, -0.5, 0.5),
]


def _row(x: Any) -> Any:
    """A table broadcast along every dim but the last (replicated when ``x`` is a DTensor)."""
    n = x.shape[-1] if x.dim() else 1
    return _like(x, torch.linspace(-1.0, 1.0, n).reshape(n) if x.dim() else torch.tensor(0.5))


def make_input(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """Deterministic input: normals for floats, small ints (repeats likely) for ints/bools."""
    g = torch.Generator().manual_seed(seed)
    if dtype == "int64":
        return torch.randint(-3, 8, shape, generator=g)
    if dtype == "bool":
        return torch.rand(shape, generator=g) > 0.5
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))
