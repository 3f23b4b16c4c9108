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
  ``use_local_output=True``) know the global shape: the local tensor is tagged with it (in
  its autograd node's ``metadata``, or a weak dict entry where it has no node). No
  communication; about 1 us.
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
    "current",
    "note_dtensor_inputs",
    "resolve",
    "tag",
]

_NODE_KEY = "dtensor_patches.global_shape"

# local tensor without an autograd node -> (weak mesh, global shape, local shape) from the
# boundary that produced it (a tensor with a node keeps its tag on the node: a dict write,
# where this weak dict costs a weak reference per write and per lookup).
_TAGS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# id(mesh) of meshes on which a boundary met an uneven shard; id(site) -> whether the boundary
# (a module, a style, a function) is a root, for those called once. Plain dicts by id, the
# entry dropped when its object dies: these are read on every layer.
_UNEVEN: dict[int, bool] = {}
_SEEN: dict[int, bool] = {}
# id(mesh) -> (weak mesh, the size of each mesh dim): DeviceMesh.size() reads a tensor.
_SIZES: dict[int, tuple[Any, tuple[int, ...]]] = {}
_CURRENT = threading.local()


def _remember(table: dict[int, bool], owner: Any, value: bool) -> None:
    """``table[id(owner)] = value``, dropped when ``owner`` dies."""
    key = id(owner)
    if key not in table:
        try:
            weakref.finalize(owner, table.pop, key, None)
        except TypeError:  # not weak-referenceable: kept for the process, like the object
            pass
    table[key] = value


def mesh_sizes(mesh: Any) -> tuple[int, ...]:
    """The size of each dim of ``mesh``, read once per mesh."""
    entry = _SIZES.get(id(mesh))
    if entry is not None and entry[0]() is mesh:
        return entry[1]
    sizes = tuple(int(mesh.size(d)) for d in range(mesh.ndim))
    _SIZES[id(mesh)] = (weakref.ref(mesh), sizes)
    return sizes


class boundary:
    """``with boundary(site, last_dim_of=f) as built:`` marks this thread as inside the
    boundary ``site`` (a module, a style, a ``local_map`` function); ``last_dim_of(site)``: the
    global size of the last dim of its input where the module knows it (a ``RowwiseParallel``
    linear's ``in_features``), asked only where the tags do not tell. ``built`` collects the
    global shapes of the DTensors ``from_local`` builds in it. A class, not a generator: it
    runs on every layer."""

    __slots__ = ("built", "last_dim_of", "outer", "site")

    def __init__(self, site: Any, last_dim_of: Any = None) -> None:
        self.site = site
        self.last_dim_of = last_dim_of
        self.built: list[torch.Size] = []

    def __enter__(self) -> list[torch.Size]:
        self.outer = getattr(_CURRENT, "frame", None)
        _CURRENT.frame = self
        return self.built

    def __exit__(self, *exc: object) -> None:
        _CURRENT.frame = self.outer


def tag(local: torch.Tensor, mesh: Any, shape: Sequence[int]) -> None:
    """Record that ``local`` is this rank's part of a tensor of global ``shape`` on ``mesh``."""
    size = shape if type(shape) is torch.Size else torch.Size(shape)
    entry = (weakref.ref(mesh), size, local.shape)
    node = local.grad_fn
    if node is not None:
        node.metadata[_NODE_KEY] = entry
    else:
        _TAGS[local] = entry


def _uneven(shape: Sequence[int], mesh: Any, placements: Sequence[Any]) -> bool:
    sizes = mesh_sizes(mesh)
    return any(
        p.is_shard() and int(shape[p.dim % len(shape)]) % sizes[m] != 0
        for m, p in enumerate(placements)
        if len(shape)
    )


def note_dtensor_inputs(values: Sequence[Any]) -> None:
    """Mark the mesh of every unevenly sharded DTensor among ``values`` (``local_map``'s
    inputs)."""
    from torch.distributed.tensor import DTensor

    for value in values:
        if isinstance(value, DTensor) and _uneven(value.shape, value.device_mesh, value.placements):
            _remember(_UNEVEN, value.device_mesh, True)


def _known(local: torch.Tensor, mesh: Any) -> torch.Size | None:
    node = local.grad_fn
    if node is None:
        entry = _TAGS.get(local)
    else:
        # Its own node (tagged at an output boundary), else one of the nodes of its direct
        # inputs with the same local shape (a residual add of a tagged tensor).
        entry = node.metadata.get(_NODE_KEY)
        if entry is not None and entry[2] != local.shape:
            entry = None  # another output of a node with several
        if entry is None:
            for parent, _ in node.next_functions:
                if parent is None:
                    continue
                candidate = parent.metadata.get(_NODE_KEY)
                if candidate is not None and candidate[2] == local.shape:
                    entry = candidate
                    break
    if entry is None or entry[0]() is not mesh:
        return None
    return entry[1]


def _even_reading(local: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> tuple[int, ...]:
    """The global shape torch's ``from_local`` assumes: each sharded dim times the mesh size
    (a tuple: it is only compared with a ``torch.Size``)."""
    shape = list(local.shape)
    sizes = mesh_sizes(mesh)
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            shape[placement.dim % local.ndim] *= sizes[mesh_dim]
    return tuple(shape)


def _last_dim_factor(local: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> int:
    """How many parts ``placements`` cut the last dim of ``local`` into (the product of the
    sizes of the mesh dims that shard it); 0 where another dim is sharded, or none is."""
    ndim = local.ndim
    if not ndim:
        return 0
    sizes = mesh_sizes(mesh)
    factor = 0
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            if placement.dim % ndim != ndim - 1:
                return 0
            factor = max(factor, 1) * sizes[mesh_dim]
    return factor


def resolve(
    frame: boundary,
    local: torch.Tensor,
    mesh: Any,
    placements: Sequence[Any],
    exchange: Any,
) -> tuple[torch.Size, tuple[int, ...]] | None:
    """The global shape and stride for ``from_local(local, mesh, placements,
    run_check=False)`` inside the boundary ``frame`` (see the module doc), or ``None`` where
    torch's even reading stands. ``exchange(local, mesh, placements)`` is the collective that
    asks every rank.

    Raises:
        ValueError: a tagged ``local`` whose shape is not DTensor's layout of its global shape
            under ``placements``; or what ``exchange`` raises.
    """
    site = frame.site
    shape = None
    even = False
    # The module's own width first (a linear layer's input is ``in_features`` wide): it costs
    # less than following autograd nodes, and it is the common case of a RowwiseParallel input.
    last_dim = None if frame.last_dim_of is None else frame.last_dim_of(site)
    if last_dim is not None:
        factor = _last_dim_factor(local, mesh, placements)
        if factor:
            shape = torch.Size((*local.shape[:-1], last_dim))
            even = local.shape[-1] * factor == last_dim
    if shape is None:
        shape = _known(local, mesh)
        even = shape is not None and shape == _even_reading(local, mesh, placements)
    if shape is not None:
        if id(site) not in _SEEN:
            _remember(_SEEN, site, False)
        if even:
            return None  # torch's own reading is right: nothing to add to its call
        expected, _ = local_shape_and_offset(shape, mesh, placements)
        if tuple(expected) != tuple(local.shape):
            raise ValueError(
                f"DTensor.from_local in a parallel style: the local tensor of shape "
                f"{list(local.shape)} is this rank's part of a tensor of global shape "
                f"{list(shape)}, which placements {tuple(placements)} would cut into "
                f"{list(expected)} here: the layouts given to the style do not describe it"
            )
        result = (shape, stride_like(local, shape))
    else:
        root = _SEEN.get(id(site))
        if root is None:
            # First call: untagged while autograd records means fed from outside the styles
            # (a root), which is exchanged on every call; under no_grad nothing is known.
            root = torch.is_grad_enabled()
            _remember(_SEEN, site, root)
        elif not root and id(mesh) not in _UNEVEN:
            return None
        result = exchange(local, mesh, placements)
    if _uneven(result[0], mesh, placements):
        _remember(_UNEVEN, mesh, True)
    return result


def current() -> boundary | None:
    """The boundary this thread is inside, if any (``boundary.built`` collects the global
    shapes of the DTensors ``from_local`` builds in it, to tag the local tensors the boundary
    returns for them)."""
    return getattr(_CURRENT, "frame", None)
