"""DTensor objects and their specs: the class, local tensors, specs, relabels, local shards.

The private pieces (``DTensor._local_tensor``, ``DTensor._spec``, ``DTensorSpec``,
``compute_local_shape_and_global_offset``) are stable from 2.9 to 2.15; each accessor raises
:class:`~dtensor_patches.errors.PatchError` naming the one that moved.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from dtensor_patches._torch.access import attribute, internal, moved
from dtensor_patches.errors import PatchError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "base_of",
    "check_internals",
    "dtensor_class",
    "dtensor_types",
    "first_mesh",
    "full_tensor",
    "full_value",
    "has_base",
    "has_internal_overlap",
    "is_dtensor",
    "is_view",
    "local_shape_and_offset",
    "local_shape_and_offset_function",
    "local_tensor",
    "make_dtensor",
    "mask_partial_owner",
    "module_parameters",
    "norm_partial_class",
    "relabel",
    "rewrap",
    "set_local",
    "set_spec",
    "shares_storage",
    "spec_of",
    "spec_shape",
    "spec_with_placements",
    "version_of",
    "view_root",
]


@functools.cache
def dtensor_class() -> type[DTensor]:
    """``torch.distributed.tensor.DTensor``."""
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (or an instance of a DTensor subclass)."""
    return isinstance(value, dtensor_class())


def full_tensor(value: Any) -> Any:
    """``value.full_tensor()`` for a DTensor (gathered on every rank, differentiable); anything
    else as it is."""
    return value.full_tensor() if isinstance(value, dtensor_class()) else value


def first_mesh(leaves: Iterable[Any]) -> DeviceMesh:
    """The mesh of the first DTensor among ``leaves``.

    Raises:
        TypeError: there is no DTensor among them.
    """
    dtensor = dtensor_class()
    for leaf in leaves:
        if isinstance(leaf, dtensor):
            return leaf.device_mesh
    raise TypeError("a DTensor handler was called without DTensor arguments")


@functools.cache
def dtensor_types() -> SimpleNamespace:
    """The private classes a strategy function builds with, resolved for the running release.

    Returns a namespace with ``OpSpec``, ``OpStrategy``, ``TupleStrategy``, ``OpSchema``,
    ``RuntimeSchemaInfo``, ``OutputSharding``, ``DTensorSpec`` and ``TensorMeta``.

    Raises:
        PatchError: one of them is missing (named in the error).
    """
    schema = "torch.distributed.tensor._op_schema"
    spec = "torch.distributed.tensor._dtensor_spec"
    return SimpleNamespace(
        OpSpec=internal(schema, "OpSpec"),
        OpStrategy=internal(schema, "OpStrategy"),
        TupleStrategy=internal(schema, "TupleStrategy"),
        OpSchema=internal(schema, "OpSchema"),
        RuntimeSchemaInfo=internal(schema, "RuntimeSchemaInfo"),
        OutputSharding=internal(schema, "OutputSharding"),
        DTensorSpec=internal(spec, "DTensorSpec"),
        TensorMeta=internal(spec, "TensorMeta"),
    )


def local_tensor(dtensor: DTensor) -> torch.Tensor:
    """The DTensor's local shard itself (``DTensor._local_tensor``), not a copy.

    In-place handlers write into it so that the caller's object changes in place; the public
    ``to_local()`` goes through autograd and is not meant for writing.

    Raises:
        PatchError: the attribute moved.
    """
    return attribute(dtensor, "_local_tensor", "DTensor._local_tensor")


def spec_of(dtensor: DTensor) -> DTensorSpec:
    """``DTensor._spec``: mesh, placements and tensor meta (global shape, stride, dtype).

    Raises:
        PatchError: the attribute moved.
    """
    return attribute(dtensor, "_spec", "DTensor._spec")


def set_spec(dtensor: DTensor, spec: DTensorSpec) -> None:
    """Give ``dtensor`` another spec in place (its local tensor unchanged)."""
    spec_of(dtensor)
    dtensor._spec = spec


def set_local(dtensor: DTensor, local: torch.Tensor) -> None:
    """Give ``dtensor`` another local tensor in place (same shape, its spec unchanged): for a
    local tensor that cannot be written into (an expanded one, whose elements overlap)."""
    if tuple(local_tensor(dtensor).shape) != tuple(local.shape):
        raise ValueError(
            f"set_local: shape {list(local.shape)} for a local tensor of "
            f"{list(local_tensor(dtensor).shape)}"
        )
    dtensor._local_tensor = local


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """Whether some elements of ``tensor`` share memory (``expand``): it cannot be written into
    with ``copy_``. ``torch._debug_has_internal_overlap`` answers 0 (no), 1 (yes) or 2 (too
    hard to tell); 2 counts as overlap.

    Raises:
        PatchError: the function moved.
    """
    check = attribute(torch, "_debug_has_internal_overlap", "torch._debug_has_internal_overlap")
    return int(check(tensor)) != 0


def make_dtensor(local: torch.Tensor, spec: DTensorSpec, *, cls: type | None = None) -> Any:
    """A DTensor (or an instance of the DTensor subclass ``cls``) over ``local`` with ``spec``,
    without communication or checks: ``DTensor(local, spec, requires_grad=False)``, the
    constructor DTensor's own dispatch wraps results with (same signature 2.9 to 2.15).

    For use inside dispatch (below autograd), where results carry no autograd history.
    """
    klass = dtensor_class() if cls is None else cls
    return klass(local, spec, requires_grad=False)


def rewrap(dtensor: DTensor, *, cls: type | None = None, local: torch.Tensor | None = None) -> Any:
    """A new DTensor object over ``dtensor``'s local tensor (or ``local``) and spec, without
    autograd history: a plain DTensor view of a DTensor subclass, or a scratch copy."""
    return make_dtensor(
        local_tensor(dtensor) if local is None else local, spec_of(dtensor), cls=cls
    )


def spec_with_placements(spec: DTensorSpec, placements: Iterable[Placement]) -> DTensorSpec:
    """A copy of the ``DTensorSpec`` ``spec`` with other placements and every other field kept.

    Copied with ``dataclasses.replace`` so that fields newer releases add (``shard_order`` in
    2.13) survive; where such a field is derived from the placements, it is dropped and left
    for ``DTensorSpec.__post_init__`` to derive again.

    Raises:
        PatchError: ``DTensorSpec`` is no longer a dataclass.
    """
    if not dataclasses.is_dataclass(spec):
        raise moved("torch.distributed.tensor._dtensor_spec.DTensorSpec", "no longer a dataclass")
    changes: dict[str, Any] = {"placements": tuple(placements)}
    names = {f.name for f in dataclasses.fields(spec) if f.init}
    if "shard_order" in names:
        # Derived from the placements when not given (2.13); the old order would not match.
        changes["shard_order"] = None
    return dataclasses.replace(spec, **changes)


def relabel(dtensor: DTensor, placements: Iterable[Placement]) -> None:
    """Relabel ``dtensor`` in place with ``placements`` (same mesh, same global shape).

    Only for relabels that keep the local tensor's shape.

    Raises:
        PatchError: ``DTensor._spec`` or ``DTensorSpec`` moved.
    """
    set_spec(dtensor, spec_with_placements(spec_of(dtensor), placements))


def spec_shape(dtensor: DTensor) -> tuple[int, ...] | None:
    """The global shape ``dtensor``'s spec records (``_spec.tensor_meta.shape``), which DTensor
    propagates from; ``None`` when the spec has no tensor meta."""
    meta = getattr(spec_of(dtensor), "tensor_meta", None)
    return None if meta is None else tuple(meta.shape)


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor (``Tensor._is_view()``)."""
    return bool(tensor._is_view())


def has_base(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` was made as a view of another (``Tensor._base`` is set)."""
    return tensor._base is not None


def base_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` was made as a view of (``Tensor._base``), or ``None``."""
    base: torch.Tensor | None = tensor._base
    return base


def view_root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor ``tensor`` is a view of (``Tensor._base``), or ``tensor`` itself."""
    base = tensor._base
    return tensor if base is None else base


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter (``Tensor._version``), shared with its views: it grows with
    every in-place write into the storage through any of them."""
    return int(tensor._version)


def module_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """A module's own parameter dict (``nn.Module._parameters``), to read and replace entries.

    Raises:
        PatchError: the attribute moved.
    """
    return attribute(module, "_parameters", "torch.nn.Module._parameters")


def full_value(dtensor: DTensor) -> torch.Tensor:
    """The full (global, reduced) value of ``dtensor`` as a plain tensor, without autograd
    history and without consuming state that a later redistribution needs.

    ``_MaskPartial`` (vocab-parallel embedding) keeps its mask on the placement object and
    releases it when reduced (a refcount); gathering such a tensor for a check would make the
    model's own reduction fail later, so the mask is put back.

    Raises:
        PatchError: ``redistribute_local_tensor`` moved.
    """
    from torch.distributed.tensor import Replicate

    buffers = []
    for placement in dtensor.placements:
        buffer = getattr(placement, "mask_buffer", None)
        if buffer is not None:
            buffers.append((buffer, dict(vars(buffer))))  # data and refcount
    redistribute = internal("torch.distributed.tensor._redistribute", "redistribute_local_tensor")
    spec = spec_of(dtensor)
    target = spec_with_placements(spec, [Replicate()] * len(spec.placements))
    try:
        # Below autograd on purpose: an autograd.Function inside a dispatch mode is refused
        # on 2.9 (``detach_`` has no strategy).
        with torch.no_grad():
            out = redistribute(local_tensor(dtensor), spec, target)
            wait = getattr(out, "wait", None)
            if type(out) is not torch.Tensor and callable(wait):
                out = wait()  # AsyncCollectiveTensor
            return out.clone()
    finally:
        for buffer, state in buffers:
            vars(buffer).update(state)


def local_shape_and_offset_function() -> Callable[..., Any]:
    """``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``.

    Raises:
        PatchError: the helper moved.
    """
    return internal("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")


def local_shape_and_offset(
    global_shape: Iterable[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and the global offset of its block, per tensor dim.

    Wraps ``compute_local_shape_and_global_offset`` (same signature 2.9 to 2.15; 2.10 adds an
    optional ``skip_offset``), which cuts shards exactly as DTensor does (uneven and empty last
    shards, several mesh dims sharding one tensor dim).

    Raises:
        PatchError: the helper moved.
    """
    compute = local_shape_and_offset_function()
    shape, offset = compute(tuple(global_shape), mesh, tuple(placements))
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


# Where torch keeps the placement of a vocab-parallel lookup's pending, masked sum: 2.9 beside
# the embedding strategy, 2.10 public-named, 2.11+ private-named in placement_types.
_MASK_PARTIAL_SITES = (
    ("torch.distributed.tensor.placement_types", "_MaskPartial"),
    ("torch.distributed.tensor.placement_types", "MaskPartial"),
    ("torch.distributed.tensor._ops._embedding_ops", "_MaskPartial"),
)


@functools.cache
def mask_partial_class() -> type:
    """torch's ``_MaskPartial`` placement class (``MaskPartial`` on 2.10).

    Raises:
        PatchError: none of the known locations has it.
    """
    for module_name, name in _MASK_PARTIAL_SITES:
        try:
            found = internal(module_name, name)
        except PatchError:
            continue
        if isinstance(found, type):
            return found
    raise moved(
        "torch.distributed.tensor.placement_types._MaskPartial",
        "looked in " + ", ".join(f"{m}.{n}" for m, n in _MASK_PARTIAL_SITES),
    )


def mask_partial_owner() -> str:
    """Where :func:`mask_partial_class` is defined, as ``module:Class`` (an owner for
    :class:`dtensor_patches.patch.WrappedFunction`).

    Raises:
        PatchError: none of the known locations has it.
    """
    cls = mask_partial_class()
    return f"{cls.__module__}:{cls.__qualname__}"


def is_mask_partial(placement: Placement) -> bool:
    """Whether ``placement`` is torch's ``_MaskPartial`` (a ``Partial`` whose pending sum
    needs a mask saved with the lookup's shape).

    Raises:
        PatchError: the class moved.
    """
    return isinstance(placement, mask_partial_class())


@functools.cache
def norm_partial_class() -> type:
    """torch's ``_NormPartial`` placement class (the pending p-norm of a vector norm over a
    sharded dim: its shares combine as ``(sum |share|^p)^(1/p)``, not as a sum;
    ``torch.distributed.tensor._ops._math_ops`` on 2.9 to 2.15).

    Raises:
        PatchError: the class moved.
    """
    found = internal("torch.distributed.tensor._ops._math_ops", "_NormPartial")
    if not isinstance(found, type):
        raise moved("torch.distributed.tensor._ops._math_ops._NormPartial", "not a class")
    return found


def check_internals() -> None:
    """Check every private internal that handlers and miss rules use while a call runs.

    Called when a patch with handlers or miss rules (or the fallback) is applied, so a release
    that moved one fails cleanly at apply time (torch untouched), never mid-training.

    Raises:
        PatchError: naming the first missing internal.
    """
    attribute(torch._C, "_is_alias_of", "torch._C._is_alias_of")
    annotations: dict[str, Any] = {}
    for klass in reversed(dtensor_class().__mro__):
        annotations.update(getattr(klass, "__annotations__", {}))
    for name in ("_local_tensor", "_spec"):
        if name not in annotations:
            raise moved(f"DTensor.{name}", "DTensor no longer declares it")
    types = dtensor_types()
    required = {
        "DTensorSpec": ("mesh", "placements", "tensor_meta"),
        "OpSchema": ("op", "args_schema", "kwargs_schema"),
        "OutputSharding": ("output_spec", "redistribute_schema", "needs_redistribute"),
    }
    for class_name, fields in required.items():
        klass = getattr(types, class_name)
        if not dataclasses.is_dataclass(klass):
            raise moved(f"torch.distributed.tensor.{class_name}", "no longer a dataclass")
        have = {f.name for f in dataclasses.fields(klass)}
        for name in fields:
            if name not in have:
                raise moved(f"{class_name}.{name}")
    local_shape_and_offset_function()


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two plain tensors are views of one storage (identity, so empty tensors too).

    Raises:
        PatchError: ``torch._C._is_alias_of`` moved.
    """
    is_alias_of = attribute(torch._C, "_is_alias_of", "torch._C._is_alias_of")
    return bool(is_alias_of(a, b))


def holds_real_values(tensor: Any) -> bool:
    """Whether ``tensor`` is a plain tensor, a ``Parameter`` or an ``AsyncCollectiveTensor``
    (what ``to_local()`` of a redistributed DTensor returns, ``torch.distributed.
    _functional_collectives``): real values on this rank, not a fake or other subclass."""
    kind = type(tensor)
    return kind in (torch.Tensor, torch.nn.Parameter) or kind is _async_collective_tensor()


@functools.cache
def _async_collective_tensor() -> type:
    return internal("torch.distributed._functional_collectives", "AsyncCollectiveTensor")
