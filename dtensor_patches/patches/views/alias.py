"""``aten.alias.default`` has no sharding strategy on torch 2.9.

Trigger: slicing a DTensor with a slice that spans a whole sharded dimension, e.g. ``x[:, :n]``
where dim 1 has size ``n`` and is ``Shard(1)``. ATen turns such a slice into ``alias``, and
DTensor 2.9 raises ``NotImplementedError: Operator aten.alias.default does not have a sharding
strategy registered``. In HF Qwen2 under TP + SP this is ``hidden_states[:, slice_indices, :]``
in ``Qwen2ForCausalLM.forward``.

Fix: the output keeps the input's placements, no communication. Reported upstream as
pytorch/pytorch#170427; torch 2.10 registers the same strategy (pytorch/pytorch#166867).
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, Strategy
from dtensor_patches.reproducers import compare, failure_of
from dtensor_patches.strategies import follow_input_strategy


def _registrations() -> list[Strategy]:
    return [Strategy("aten.alias.default", follow_input_strategy)]


def reproduce(mesh: Any) -> str | None:
    """Slice a ``Shard(1)`` DTensor over its whole dim 1, and call ``alias`` on it directly.

    Returns ``None`` when both equal the single-device result and keep ``Shard(1)``.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    n = 2 * mesh.size()
    full = torch.arange(4 * n, dtype=torch.float32).reshape(4, n)
    dx = distribute_tensor(full, mesh, [Shard(1)])
    for what, trigger in (
        ("x[:, :n]", lambda: dx[:, :n]),
        ("aten.alias.default(x)", lambda: torch.ops.aten.alias.default(dx)),
    ):
        out, error = failure_of(trigger)
        if error is not None:
            return f"{what}: {error}"
        if tuple(out.placements) != (Shard(1),):
            return f"{what}: placements {out.placements} != (Shard(dim=1),)"
        mismatch = compare(out.full_tensor(), full, what=what)
        if mismatch is not None:
            return mismatch
    return None


PATCH = Patch(
    name="alias",
    summary="sharding strategy for aten.alias.default (whole-dim slices of a sharded dim)",
    ops=("aten.alias.default",),
    gate=SpecifierSet(">=2.9,<2.10"),
    registrations=_registrations,
    reproduce=reproduce,
    upstream_issue="https://github.com/pytorch/pytorch/issues/170427",
    upstream_fix="https://github.com/pytorch/pytorch/pull/166867 (torch 2.10)",
    communication="none",
)
