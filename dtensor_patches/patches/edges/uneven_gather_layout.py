"""An uneven ``Shard(d)`` gathered to ``Replicate()`` keeps a padded layout: the next ``view``
fails.

Gathering shards of different lengths along a dim other than 0, torch pads each shard to the
longest, all-gathers, and cuts the padding off with a narrowing view. The local tensor of the
``Replicate()`` result is then not laid out as its spec says (strides of the padded length:
``(48, 8, 1)`` for a ``[2, 5, 8]`` tensor whose spec says ``(40, 8, 1)``), and the next op that
needs the layout, a ``view`` (``F.linear`` on a 3-D input flattens it), raises ``view size is
not compatible with input tensor's size and stride``. This is what torch's own
``SequenceParallel`` -> ``ColwiseParallel`` step does on every odd sequence length (measured
on 2.9.1 and 2.11.0; 2.13.0 makes the gathered tensor contiguous).

Fix: ``Shard._to_replicate_tensor`` (torch's shard-to-replicate transform) is wrapped: a
result that is not contiguous is made contiguous, which happens only where padding was cut.
Cost: one ``is_contiguous()`` look per such redistribution; one copy of the gathered tensor
where the shards were uneven.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, WrappedFunction

OPS = ("_c10d_functional.all_gather_into_tensor.default",)  # the gather whose layout is kept


def _laid_out(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def to_replicate_tensor(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = original(self, *args, **kwargs)
        return result if result.is_contiguous() else result.contiguous()

    return to_replicate_tensor


def _registrations() -> list[WrappedFunction]:
    return [
        WrappedFunction(
            "_to_replicate_tensor",
            _laid_out,
            "torch.distributed.tensor.placement_types:Shard",
        )
    ]


def reproduce(mesh: Any) -> str | None:
    """A ``[2, 2k + 1, 8]`` tensor sharded along dim 1 over ``k`` ranks (lengths differ),
    redistributed to ``Replicate()`` and viewed as ``[2 (2k + 1), 8]``, against the plain
    tensor."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    parts = mesh.size()
    if parts == 1:
        return None
    full = torch.arange(2 * (2 * parts + 1) * 8, dtype=torch.float32).reshape(2, -1, 8)
    gathered = distribute_tensor(full, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    try:
        flat = gathered.view(-1, 8)
    except RuntimeError as exc:
        return f"view of an uneven Shard(1) gathered to Replicate(): {str(exc).splitlines()[0]}"
    return None if torch.equal(flat.full_tensor(), full.view(-1, 8)) else "values differ"


PATCH = Patch(
    name="uneven_gather_layout",
    summary="an uneven Shard(d) gathered to Replicate() is laid out as its spec says",
    ops=OPS,
    gate=SpecifierSet(">=2.9,<2.13"),
    registrations=_registrations,
    reproduce=reproduce,
    overrides_existing=True,
    communication="none (one local copy of the gathered tensor where the shards were uneven)",
)
