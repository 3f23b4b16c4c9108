"""Local tensors that become DTensors again inside torch's parallel styles and ``local_map``,
with the global shape they really have.

The styles (``SequenceParallel``, ``ColwiseParallel`` / ``RowwiseParallel`` with
``input_layouts=Shard(d)``, ``PrepareModuleInput`` / ``PrepareModuleOutput``) and ``local_map``
re-wrap plain local tensors with ``DTensor.from_local(..., run_check=False)`` on every layer,
which takes the global length to be ``local length x mesh size``. With a sequence length the TP
degree does not divide (RL batches have every length) the ranks then disagree on the global
shape: wrong values, or gloo aborts the process in the next all-gather.

Where the size is already known, and what each path costs:

- **Output boundaries** (a style turning its DTensor output into a local tensor,
  ``use_local_output=True``) know the global shape: the local tensor is tagged with it (a weak
  dict entry, and the autograd node's ``metadata`` when it has one). No communication.
- **Input boundaries** (a style re-wrapping a plain local tensor) take the global shape from
  the tag of the tensor itself, or of the autograd node of one of its direct inputs with the
  same local shape: ``h = x + attn_out`` inherits ``attn_out``'s tag, so a residual stream
  keeps its global shape from layer to layer with no communication while autograd records.
- Otherwise the ranks exchange their local shapes (one all-gather of a few integers), but only
  where the even reading could be wrong: on the first call of each boundary; on every call of
  a boundary that was first fed from outside the styles while autograd recorded (a *root*:
  the user's own local shards, one exchange per forward); and on a mesh where an uneven shard
  has been seen at a boundary. A program whose sequence lengths are always divisible pays one
  exchange per boundary module once, plus one per forward per root. Under ``torch.no_grad()``
  (no autograd nodes to follow) a program with odd lengths pays one exchange per untagged
  boundary.
- ``local_map`` outputs: exchanged when an input DTensor is unevenly sharded, or the mesh has
  seen an uneven boundary, or on the first call of the function.

Every decision here is the same on every rank (tags, the mesh's flag and a boundary's first
call are the same on every rank of an SPMD program), so the ranks always agree on whether to
exchange. A tagged local tensor whose shape is not DTensor's layout under the placements it is
re-wrapped with raises ``ValueError`` (the placements do not describe it).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dtensor_patches._torch.dtensors import local_shape_and_offset
from dtensor_patches.dispatch.shards import stride_like

__all__ = [
    "boundary",
    "note_built",
    "note_dtensor_inputs",
    "resolve",
    "tag",
]

_NODE_KEY = "dtensor_patches.global_shape"

# local tensor -> (weak mesh, global shape, local shape) from the boundary that produced it.
_TAGS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# meshes on which a boundary met an uneven shard; boundaries (modules, styles, functions)
# that have been called once.
_UNEVEN: WeakIdKeyDictionary = WeakIdKeyDictionary()
_SEEN: WeakIdKeyDictionary = WeakIdKeyDictionary()
_CURRENT = threading.local()


class boundary:
    """``with boundary(site, last_dim=n) as built:`` marks this thread as inside the boundary
    ``site`` (a module, a style, a ``local_map`` function); ``last_dim``: the global size of
    the last dim of its input where the module knows it (a ``RowwiseParallel`` linear's
    ``in_features``). ``built`` collects the global shapes of the DTensors ``from_local``
    builds in it. A class, not a generator: it runs on every layer."""

    __slots__ = ("built", "last_dim", "outer", "site")

    def __init__(self, site: Any, last_dim: int | None = None) -> None:
        self.site = site
        self.last_dim = last_dim
        self.built: list[torch.Size] = []

    def __enter__(self) -> list[torch.Size]:
        self.outer = getattr(_CURRENT, "frame", None)
        _CURRENT.frame = self
        return self.built

    def __exit__(self, *exc: object) -> None:
        _CURRENT.frame = self.outer


def tag(local: torch.Tensor, mesh: Any, shape: Sequence[int]) -> None:
    """Record that ``local`` is this rank's part of a tensor of global ``shape`` on ``mesh``."""
    entry = (weakref.ref(mesh), torch.Size(shape), local.shape)
    _TAGS[local] = entry
    node = local.grad_fn
    if node is not None:
        node.metadata[_NODE_KEY] = entry


def _uneven(shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> bool:
    return any(
        p.is_shard() and int(shape[p.dim % len(shape)]) % mesh.size(m) != 0
        for m, p in enumerate(placements)
        if len(shape)
    )


def note_dtensor_inputs(values: Sequence[Any]) -> None:
    """Mark the mesh of every unevenly sharded DTensor among ``values`` (``local_map``'s
    inputs)."""
    from torch.distributed.tensor import DTensor

    for value in values:
        if isinstance(value, DTensor) and _uneven(value.shape, value.device_mesh, value.placements):
            _UNEVEN[value.device_mesh] = True


def _known(local: torch.Tensor, mesh: Any) -> torch.Size | None:
    entry = _TAGS.get(local)
    if entry is None and local.grad_fn is not None:
        for parent, _ in local.grad_fn.next_functions:
            if parent is None:
                continue
            candidate = parent.metadata.get(_NODE_KEY)
            if candidate is not None and candidate[2] == local.shape:
                entry = candidate
                break
    if entry is None or entry[0]() is not mesh:
        return None
    return entry[1]


def _even_reading(local: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> torch.Size:
    """The global shape torch's ``from_local`` assumes: each sharded dim times the mesh size."""
    shape = list(local.shape)
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            shape[placement.dim % local.ndim] *= mesh.size(mesh_dim)
    return torch.Size(shape)


def _from_last_dim(
    local: torch.Tensor, placements: Sequence[Any], last_dim: int | None
) -> torch.Size | None:
    """The global shape when only the last dim is sharded and the module knows its size."""
    if last_dim is None or not local.ndim:
        return None
    sharded = {p.dim % local.ndim for p in placements if p.is_shard()}
    if sharded != {local.ndim - 1}:
        return None
    return torch.Size((*local.shape[:-1], last_dim))


def resolve(
    local: torch.Tensor, mesh: Any, placements: Sequence[Any], exchange: Any
) -> tuple[torch.Size, tuple[int, ...]] | None:
    """The global shape and stride for ``from_local(local, mesh, placements,
    run_check=False)`` inside a boundary (see the module doc), or ``None`` outside one and
    where torch's even reading stands. ``exchange(local, mesh, placements)`` is the
    collective that asks every rank.

    Raises:
        ValueError: a tagged ``local`` whose shape is not DTensor's layout of its global shape
            under ``placements``; or what ``exchange`` raises.
    """
    frame = getattr(_CURRENT, "frame", None)
    if frame is None:
        return None
    site = frame.site
    shape = _known(local, mesh)
    if shape is None:
        shape = _from_last_dim(local, placements, frame.last_dim)
    if shape is not None:
        if shape == _even_reading(local, mesh, placements):
            _SEEN.setdefault(site, False)
            return None  # torch's own reading is right: nothing to add to its call
        expected, _ = local_shape_and_offset(shape, mesh, placements)
        if tuple(expected) != tuple(local.shape):
            raise ValueError(
                f"DTensor.from_local in a parallel style: the local tensor of shape "
                f"{list(local.shape)} is this rank's part of a tensor of global shape "
                f"{list(shape)}, which placements {tuple(placements)} would cut into "
                f"{list(expected)} here: the layouts given to the style do not describe it"
            )
        _SEEN.setdefault(site, False)
        result = (shape, stride_like(local, shape))
    else:
        root = _SEEN.get(site)
        if root is None:
            # First call: untagged while autograd records means fed from outside the styles
            # (a root), which is exchanged on every call; under no_grad nothing is known.
            root = _SEEN[site] = torch.is_grad_enabled()
        elif not root and mesh not in _UNEVEN:
            return None
        result = exchange(local, mesh, placements)
    if _uneven(result[0], mesh, placements):
        _UNEVEN[mesh] = True
    return result


def note_built(dtensor: Any) -> None:
    """Inside a boundary, remember the global shape of a DTensor ``from_local`` built (to tag
    the local tensor the boundary returns for it)."""
    frame = getattr(_CURRENT, "frame", None)
    if frame is not None:
        frame.built.append(dtensor.shape)
