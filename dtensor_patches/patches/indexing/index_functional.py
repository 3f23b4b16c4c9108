"""Out-of-place ``index_add``, ``index_copy`` and ``index_fill`` fail on DTensors on torch 2.9
to 2.11.

Measured (2-rank CPU gloo mesh, index and source ``Replicate()`` DTensors): no sharding
strategy on 2.9 and 2.10 (``index_copy``/``index_fill`` also on 2.11); on 2.11
``torch.index_add(x, 0, idx, src)`` with ``x`` ``Shard(0)`` raises inside the local kernel
(``Number of indices (4) should be equal to source.size(dim): (2)``). Native strategies from
torch 2.12 give the single-device result.

Fix: the same handlers as ``index_writes`` (``dtensor_patches.patches._indexed``): the result
is a copy of ``x`` with its placements, written rank by rank; shards on dims other than ``dim``
stay local, and a shard on ``dim`` keeps the index entries of each rank's block (no gather of
``x``).
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Handler, Patch
from dtensor_patches.patches.indexing._indexed import indexed_functional
from dtensor_patches.reproducers import Case, randn

OPS = (
    "aten.index_add.default",
    "aten.index_copy.default",
    "aten.index_fill.int_Scalar",
    "aten.index_fill.int_Tensor",
)


def _registrations() -> list[Handler]:
    return [Handler(op, indexed_functional) for op in OPS]


# The tripwire's cases: Out-of-place ``index_add``/``index_copy``/``index_fill`` on sharded inputs vs single-device.
CASES = [
    Case(
        "index_add(x, 0, idx, src), x Shard(0)",
        lambda x, i, s: torch.index_add(x, 0, i, s, alpha=2),
        lambda: [randn(5, 6), torch.tensor([0, 3, 4, 3]), randn(4, 6, seed=1)],
        ["S0", "R", "R"],
    ),
    Case(
        "index_copy(x, 1, idx, src), x Shard(0)",
        lambda x, i, s: torch.index_copy(x, 1, i, s),
        lambda: [randn(5, 6), torch.tensor([0, 5]), randn(5, 2, seed=1)],
        ["S0", "R", "R"],
    ),
    Case(
        "index_fill(x, 1, idx, v), x Shard(1)",
        lambda x, i: torch.index_fill(x, 1, i, 3.0),
        lambda: [randn(5, 6), torch.tensor([0, 5])],
        ["S1", "R"],
    ),
    Case(
        "index_fill(x, 0, idx, tensor v), x Replicate()",
        lambda x, i: torch.index_fill(x, 0, i, torch.tensor(3.0)),
        lambda: [randn(5, 6), torch.tensor([4])],
        ["R", "R"],
    ),
]


PATCH = Patch(
    name="index_functional",
    summary="out-of-place index_add, index_copy, index_fill (torch 2.9 to 2.11)",
    ops=OPS,
    gate=SpecifierSet(">=2.9,<2.12"),
    registrations=_registrations,
    cases=CASES,
    upstream_fix="native strategies from torch 2.12 (measured)",
    overrides_existing=True,
    communication="as `index_writes`",
)
