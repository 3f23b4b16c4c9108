"""Indexed writes (``index_add_``, ``index_copy_``, ``index_fill_``, ``index_reduce_``,
``scatter_``, ``scatter_add_``, ``scatter_reduce_``, ``put_``) into a sharded DTensor are wrong
or fail on every release 2.9 to 2.15.

Measured (2-rank CPU gloo mesh, index and source ``Replicate()`` DTensors):

- 2.9 to 2.11: no sharding strategy for most of them (``scatter_`` fails in propagation).
- 2.12: the in-place ops along a sharded ``dim`` refuse the placement change.
- 2.13 to 2.15: ``x.index_add_(0, idx, src)``, ``index_copy_`` and ``scatter_add_`` along the
  sharded dim of a ``Shard(d)`` ``x`` relabel ``x`` as ``Replicate()`` while its local tensor
  keeps only the shard: **silently wrong** (``full_tensor()`` has the shard's shape); 2.13's
  ``scatter_add_`` into a ``Partial()`` ``x`` adds ``src`` once per rank.
- every release: ``scatter_reduce_``/``scatter_reduce`` and ``put_``/``put`` have no strategy.

Fix: custom handlers (``dtensor_patches.patches._indexed``): each rank writes into its own block
of the caller's local tensor, so ``x`` changes in place, keeps its placements, and no write
that lands on another rank's shard is lost. Shards on dims other than ``dim`` stay local (no
gather of ``x``); ``index_*`` along a sharded ``dim`` keep the index entries of each rank's
block (no gather of ``x`` either); ``scatter*`` along a sharded ``dim``, ``put_`` and
``Partial()`` inputs gather ``x``. The out-of-place ``scatter_reduce``, ``index_reduce`` and
``put`` return a result placed like ``x``.
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Handler, Patch
from dtensor_patches.patches.indexing._indexed import indexed_functional, indexed_inplace
from dtensor_patches.reproducers import Case, randn

INPLACE_OPS = (
    "aten.index_add_.default",
    "aten.index_copy_.default",
    "aten.index_fill_.int_Scalar",
    "aten.index_fill_.int_Tensor",
    "aten.index_reduce_.default",
    "aten.scatter_.src",
    "aten.scatter_.value",
    "aten.scatter_.reduce",
    "aten.scatter_.value_reduce",
    "aten.scatter_add_.default",
    "aten.scatter_reduce_.two",
    "aten.put_.default",
)
FUNCTIONAL_OPS = (
    "aten.scatter_reduce.two",
    "aten.index_reduce.default",
    "aten.put.default",
)


def _registrations() -> list[Handler]:
    return [Handler(op, indexed_inplace) for op in INPLACE_OPS] + [
        Handler(op, indexed_functional) for op in FUNCTIONAL_OPS
    ]


def _index(*shape: int, high: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _rows() -> torch.Tensor:
    return torch.tensor([0, 3, 4, 3])


# The tripwire's cases: In-place indexed writes into sharded and ``Partial()`` tensors, then the caller's tensor is compared with the single-device one; out-of-place forms compared as results.
CASES = [
    Case(
        "x.index_add_(0, idx, src), x Shard(0)",
        lambda x, i, s: x.index_add_(0, i, s),
        lambda: [randn(5, 6), _rows(), randn(4, 6, seed=1)],
        ["S0", "R", "R"],
        inplace=True,
    ),
    Case(
        "x.index_copy_(1, idx, src), x Shard(1)",
        lambda x, i, s: x.index_copy_(1, i, s),
        lambda: [randn(5, 6), torch.tensor([5, 0, 2]), randn(5, 3, seed=1)],
        ["S1", "R", "R"],
        inplace=True,
    ),
    Case(
        "x.scatter_add_(0, idx, src), x Shard(0)",
        lambda x, i, s: x.scatter_add_(0, i, s),
        lambda: [randn(5, 6), _index(4, 6, high=5), randn(4, 6, seed=1)],
        ["S0", "R", "R"],
        inplace=True,
    ),
    Case(
        "x.scatter_reduce_(1, idx, src, amax), x Shard(0)",
        lambda x, i, s: x.scatter_reduce_(1, i, s, "amax", include_self=False),
        lambda: [randn(5, 6), _index(4, 3, high=6), randn(5, 3, seed=1)],
        ["S0", "R", "R"],
        inplace=True,
    ),
    Case(
        "x.index_reduce_(0, idx, src, prod), x Shard(0)",
        lambda x, i, s: x.index_reduce_(0, i, s, "prod"),
        lambda: [randn(5, 6), _rows(), randn(4, 6, seed=1)],
        ["S0", "R", "R"],
        inplace=True,
    ),
    Case(
        "x.index_fill_(1, idx, v), x Shard(1)",
        lambda x, i: x.index_fill_(1, i, -1.0),
        lambda: [randn(5, 6), torch.tensor([1, -1])],
        ["S1", "R"],
        inplace=True,
    ),
    Case(
        "x.scatter_(1, idx, v), x Shard(1)",
        lambda x, i: x.scatter_(1, i, 2.5),
        lambda: [randn(5, 6), _index(5, 2, high=6)],
        ["S1", "R"],
        inplace=True,
    ),
    Case(
        "x.scatter_add_(1, idx, src), x Partial()",
        lambda x, i, s: x.scatter_add_(1, i, s),
        lambda: [randn(5, 6), _index(5, 3, high=6), randn(5, 3, seed=1)],
        ["P", "R", "R"],
        inplace=True,
    ),
    Case(
        "x.put_(idx, src, accumulate=True), x Shard(1)",
        lambda x, i, s: x.put_(i, s, accumulate=True),
        lambda: [randn(5, 6), torch.tensor([0, 7, 29, 7]), randn(4, seed=1)],
        ["S1", "R", "R"],
        inplace=True,
    ),
    Case(
        "scatter_reduce(x, 0, idx, src, mean), x Shard(1)",
        lambda x, i, s: torch.scatter_reduce(x, 0, i, s, "mean"),
        lambda: [randn(5, 6), _index(4, 6, high=5), randn(4, 6, seed=1)],
        ["S1", "R", "R"],
    ),
    Case(
        "index_reduce(x, 1, idx, src, amax), x Shard(1)",
        lambda x, i, s: torch.index_reduce(x, 1, i, s, "amax"),
        lambda: [randn(5, 6), torch.tensor([5, 1, 5]), randn(5, 3, seed=1)],
        ["S1", "R", "R"],
    ),
]


PATCH = Patch(
    name="index_writes",
    summary="index_add_/index_copy_/index_fill_/index_reduce_/scatter*_/put_ into sharded tensors",
    ops=INPLACE_OPS + FUNCTIONAL_OPS,
    gate=SpecifierSet(">=2.9"),
    registrations=_registrations,
    cases=CASES,
    overrides_existing=True,
    communication=(
        "none when sharded off `dim`; `index_*` along a sharded `dim` keep each rank's "
        "index entries (no gather of `x`); `scatter*` along a sharded `dim`, `put_`, "
        "`Partial`: **replicates**"
    ),
)
