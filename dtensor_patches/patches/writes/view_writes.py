"""Writes through a view that DTensor had to redistribute reach the tensor it was made from.

Trigger (every release 2.9 to 2.15, measured): ``torch.nn.init.zeros_(w[:2])`` with ``w`` a
``Shard(0)`` parameter. Slicing a sharded dim makes DTensor gather a temporary first; the
view's local tensor points into that temporary, and the write never reaches ``w``. Also
``w[:2] = 0``, ``w.t()[:, 1:3].zero_()``, and every view op that redistributes (``slice``,
``select``, ``view``, ``unbind``, ``split``, ``chunk``...), and a write into the base after the
view was made, which the view must see (``v = x[2]; x.zero_(); v.add_(1)``).

Fix: tracked views (:mod:`dtensor_patches.dispatch.tracked_views`, registration
:class:`~dtensor_patches.dispatch.tracked_views.TrackViews`). Where it acts, and what that
costs: one miss rule for every op, consulted only when a call meets sharding propagation
without a cached decision, acting on *view ops whose input must be redistributed* (seen in
torch's own decision: ``needs_redistribute`` on the input). The view is made from the
redistributed input and returned as a ``TrackedView``, which records how it was made; only such
views take a Python path, and a write into one is carried into the tensor it was made from,
all or nothing. Cached calls (ordinary slices that need no redistribution) pay nothing.

Every release 2.9 to 2.15. Torch 2.10 and 2.11 dispatch DTensor subclasses through the C++
fast path without calling their ``__torch_dispatch__`` (measured; 2.12 honours it again, 2.9 is
Python); there a tracked view's ``__torch_function__`` (called before that dispatch, only for
calls with a tracked view among their arguments) takes the call to the tracked path. What
reaches no Python there stays lost as on stock torch: ``x[1:3] = v``, whose write torch makes
inside its C++ indexing (known gaps; ``x[1:3].copy_(v)`` lands).
"""

from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from dtensor_patches.patch import Patch, TrackViews
from dtensor_patches.reproducers import Case, randn

__all__ = ["PATCH"]


def _zeros_through_view(x: torch.Tensor) -> torch.Tensor:
    torch.nn.init.zeros_(x[1:3])
    return x


def _fill_slice(x: torch.Tensor) -> torch.Tensor:
    # ``fill_`` with a number: ``x[:2] = 0.5`` would need ``fill_.Tensor``'s strategy, which
    # the ``inplace_writes`` patch provides (a tripwire checks one patch alone).
    x[:2].fill_(0.5)
    return x


def _fill_transposed_slice(x: torch.Tensor) -> torch.Tensor:
    x.t()[:, 1:3].fill_(7.0)
    return x


def _select_and_write(x: torch.Tensor) -> torch.Tensor:
    x[2].mul_(-1.0)
    return x


# The tripwire's cases: Writes through views of sharded dims, compared after the write.
CASES = [
    Case(
        "nn.init.zeros_(x[1:3])", _zeros_through_view, lambda: [randn(5, 6)], ["S0"], inplace=True
    ),
    Case("x[:2].fill_(0.5)", _fill_slice, lambda: [randn(5, 6)], ["S0"], inplace=True),
    Case("x.t()[:, 1:3].fill_(7)", _fill_transposed_slice, lambda: [randn(5, 6)], ["S0"], True),
    Case("x[2].mul_(-1)", _select_and_write, lambda: [randn(4, 6)], ["S0"], True),
]


PATCH = Patch(
    name="view_writes",
    summary="writes through views that DTensor redistributed reach the tensor they came from",
    ops=("aten.slice.Tensor", "aten.select.int"),
    gate=SpecifierSet(">=2.9"),
    registrations=lambda: [TrackViews()],
    cases=CASES,
    replicates=True,
    overrides_existing=True,
    communication=(
        "nothing on cached calls; each op on a tracked view: a gather of its root "
        "(**replicates** the source once per op), and a write a gather of the new value"
    ),
)
